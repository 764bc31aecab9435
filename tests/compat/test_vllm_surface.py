"""vLLM's documented public behaviour for every name pinstage shares with it, written from that
behaviour (not copied): code written against vLLM's helpers runs with the import changed.

Run on the CPU target and on the simulator in every mode (the ``target`` fixture)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import reference_equal

import pinstage
from pinstage import (
    CpuGpuBuffer,
    FusedStagedWriter,
    NonUvaBuffer,
    StagedWriteTensor,
    UvaBackedTensor,
    UvaBuffer,
    UvaBufferPool,
    async_copy_to_gpu,
    async_tensor_h2d,
    get_accelerator_view_from_cpu_tensor,
    is_pin_memory_available,
    is_uva_available,
    set_default_max_concurrency,
)


def test_async_tensor_h2d_list_to_device(target):
    t = async_tensor_h2d([3, 1, 2], dtype=torch.int32, device=target.device)
    assert t.dtype == torch.int32 and t.device == target.device
    target.sync()
    assert t.tolist() == [3, 1, 2]


def test_async_copy_to_gpu_into_out_and_new(target):
    out = async_tensor_h2d([0, 0, 0], dtype=torch.int64, device=target.device)
    with pytest.warns(DeprecationWarning) if _first_warning() else _nothing():
        res = async_copy_to_gpu(np.array([4, 5, 6]), out=out)
    assert res is out
    fresh = async_copy_to_gpu(torch.tensor([1.5, 2.5]), device=target.device)
    target.sync()
    assert out.tolist() == [4, 5, 6] and fresh.tolist() == [1.5, 2.5]
    assert fresh.device == target.device


def _first_warning() -> bool:
    from pinstage import _compat

    return not _compat._warned


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_cpu_gpu_buffer(target):
    buf = CpuGpuBuffer(4, 3, dtype=torch.float32, device=target.device)
    assert buf.cpu.shape == buf.gpu.shape == (4, 3) and buf.np.shape == (4, 3)
    assert buf.cpu.device.type == "cpu" and buf.gpu.device == target.device
    buf.np[:2] = 1.5
    g = buf.copy_to_gpu(2)
    assert g.shape == (2, 3)
    all_rows = buf.copy_to_gpu(100)  # above the size: the whole buffer, as slicing does
    assert all_rows.shape == (4, 3)
    target.sync()
    buf.gpu.mul_(2)
    c = buf.copy_to_cpu()
    target.sync()
    assert c.shape == (4, 3) and c[:2].eq(3.0).all() and c[2:].eq(0).all()
    one_d = CpuGpuBuffer(5, dtype=torch.int64, device=target.device, pin_memory=False,
                         with_numpy=False)
    assert one_d.np is None and one_d.copy_to_gpu().shape == (5,)


def test_uva_buffer_and_non_uva_buffer(target):
    if is_uva_available(target.device):
        u = UvaBuffer(4, torch.int32, target.device)
        u.np[:] = [1, 2, 3, 4]
        target.sync()
        reference_equal(u.uva(), [1, 2, 3, 4])  # no copy call: the view aliases .cpu
        reference_equal(u.uva(2), [1, 2])
    else:
        with pytest.raises(RuntimeError):
            UvaBuffer(4, torch.int32, target.device)
    n = NonUvaBuffer(4, torch.int32, target.device)
    n.np[:] = [5, 6, 7, 8]
    d = n.uva(3)
    target.sync()
    reference_equal(d, [5, 6, 7])


def test_uva_buffer_pool_round_robin_and_growth(target):
    pool = UvaBufferPool(4, torch.int64, max_concurrency=2, device=target.device)
    assert pool.max_concurrency == 2
    a = pool.copy_to_uva([1, 2])
    b = pool.copy_to_gpu([3, 4, 5])
    c = pool.copy_to_uva(list(range(10)))  # grows beyond 4 rows
    target.sync()
    assert a.shape == (2,) and b.shape == (3,) and c.shape == (10,)
    reference_equal(b, [3, 4, 5])
    reference_equal(c, list(range(10)))
    out = async_tensor_h2d([0, 0], dtype=torch.int64, device=target.device)
    assert pool.copy_to_gpu(np.array([7, 8]), out=out) is out
    target.sync()
    reference_equal(out, [7, 8])


def test_uva_backed_tensor(target):
    t = UvaBackedTensor((3, 2), torch.int32, max_concurrency=2, device=target.device)
    t.np[:] = [[1, 2], [3, 4], [5, 6]]
    g = t.copy_to_uva()
    assert g is t.gpu
    target.sync()
    reference_equal(g, [[1, 2], [3, 4], [5, 6]])
    g2 = t.copy_to_uva(2)
    target.sync()
    reference_equal(g2, [[1, 2], [3, 4]])


def test_staged_write_tensor_2d_and_1d(target):
    table = StagedWriteTensor((3, 6), torch.int32, target.device)
    table.stage_write(0, 0, [1, 2, 3])
    table.stage_write(0, 3, x=[4])
    table.stage_write_elem(2, x=9)  # vLLM names the value x
    table.apply_write()
    flat = StagedWriteTensor(6, torch.int64, target.device, max_concurrency=3)
    flat.stage_write(1, 2, [7, 8])  # 1-D: gpu[index+start : ...]
    flat.stage_write_elem(0, 5)
    flat.apply_write()
    dropped = StagedWriteTensor(2, torch.float32, target.device)
    dropped.stage_write_elem(0, 1.0)
    dropped.clear_staged_writes()
    dropped.apply_write()
    target.sync()
    assert table.gpu.tolist() == [[1, 2, 3, 4, 0, 0], [0] * 6, [9, 0, 0, 0, 0, 0]]
    assert flat.gpu.tolist() == [5, 0, 0, 7, 8, 0]
    assert dropped.gpu.tolist() == [0.0, 0.0]


def test_staged_write_tensor_uva_instead_of_gpu(target):
    table = StagedWriteTensor((2, 3), torch.float32, target.device, uva_instead_of_gpu=True)
    table.stage_write(1, 0, np.array([0.5, 1.5, 2.5], np.float32))
    table.apply_write()
    target.sync()
    assert table.gpu.tolist() == [[0, 0, 0], [0.5, 1.5, 2.5]]


def test_fused_staged_writer_applies_all_tables(target):
    groups = [StagedWriteTensor((4, 8), torch.int32, target.device),
              StagedWriteTensor((4, 4), torch.int32, target.device)]
    writer = FusedStagedWriter(target.device, max_writes=2, max_concurrency=2)
    groups[0].stage_write(0, 0, [1, 2, 3])
    groups[1].stage_write(3, 1, [4, 5])
    groups[1].stage_write(0, 0, [6])
    writer.apply(groups)
    target.sync()
    assert groups[0].gpu[0, :3].tolist() == [1, 2, 3]
    assert groups[1].gpu[3].tolist() == [0, 4, 5, 0] and groups[1].gpu[0, 0].item() == 6


def test_get_accelerator_view_from_cpu_tensor(target):
    if not is_uva_available(target.device):
        with pytest.raises(RuntimeError, match="UVA"):
            get_accelerator_view_from_cpu_tensor(torch.zeros(2))
        return
    pinned = CpuGpuBuffer(4, dtype=torch.int32, device=target.device).cpu
    view = get_accelerator_view_from_cpu_tensor(pinned)
    pinned[:] = torch.tensor([4, 3, 2, 1], dtype=torch.int32)
    target.sync()
    reference_equal(view, [4, 3, 2, 1])
    with pytest.raises(ValueError, match="contiguous"):
        get_accelerator_view_from_cpu_tensor(pinned[::2])
    if target.accelerator:
        with pytest.raises(ValueError, match="pinned"):
            get_accelerator_view_from_cpu_tensor(torch.zeros(4))
        # vLLM's own idiom: torch's pinned memory, viewed from the device, wrapped by UvaBuffer
        own = torch.zeros(4, dtype=torch.int32, pin_memory=True)
        view = get_accelerator_view_from_cpu_tensor(own)
        wrapped = UvaBuffer(4, torch.int32, target.device, cpu=own)
        own[:] = torch.tensor([5, 6, 7, 8], dtype=torch.int32)
        doubled = view * 2
        target.sync()
        assert view.device == target.device and doubled.cpu().tolist() == [10, 12, 14, 16]
        reference_equal(wrapped.uva(), [5, 6, 7, 8])


def test_capability_shorthands_and_defaults(target):
    caps = pinstage.capabilities(target.device)
    assert is_pin_memory_available(target.device) == caps.pin_memory
    assert is_uva_available(target.device) == caps.uva
    assert pinstage.PIN_MEMORY == pinstage.is_pin_memory_available()
    set_default_max_concurrency(3)
    assert UvaBufferPool(2, torch.int32, device=target.device).max_concurrency == 3
    assert StagedWriteTensor(2, torch.int32, target.device).max_concurrency == 3


@pytest.mark.parametrize("where", ["cpu", "sim"])
def test_pin_memory_flag_passed_to_torch(where):
    """``torch.zeros(..., pin_memory=PIN_MEMORY)``: vLLM's idiom must work where pinstage says
    it does (on a CPU-only build PIN_MEMORY is False there)."""
    if where == "cpu":
        t = torch.zeros(4, pin_memory=pinstage.PIN_MEMORY)
        assert t.shape == (4,)
        return
    from pinstage.testing import simulated_accelerator

    with simulated_accelerator("lazy"):
        t = torch.zeros(4, pin_memory=pinstage.PIN_MEMORY)
        assert t.is_pinned() == pinstage.PIN_MEMORY
