"""``out=`` and dtype checks (issue 20, items 8-9): every entry point that takes ``out=``
refuses, before writing anything, an ``out`` the data could not land in or that autograd would
refuse, with pinstage's own message; quantized dtypes and impossible sizes are refused up front.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import pinstage


def _entry_points(device: torch.device) -> dict[str, Callable[[Any, torch.Tensor], Any]]:
    pool = pinstage.UvaBufferPool((3,), torch.int64, max_concurrency=2, device=device)
    return {
        "async_tensor_h2d": lambda x, out: pinstage.async_tensor_h2d(x, device, out=out),
        "async_copy_to_gpu": lambda x, out: pinstage.async_copy_to_gpu(x, out, device),
        "UvaBufferPool.copy_to_gpu": lambda x, out: pool.copy_to_gpu(x, out=out),
    }


def _bad_outs(device: torch.device) -> dict[str, tuple[torch.Tensor, str]]:
    other = torch.device("meta") if device.type == "cpu" else torch.device("cpu")
    return {
        "meta": (torch.empty(3, dtype=torch.int64, device="meta"), "must be a tensor on"),
        "other device": (torch.empty(3, dtype=torch.int64, device=other), "must be a tensor on"),
        "shape": (torch.empty(4, dtype=torch.int64, device=device), "shape"),
        "expanded": (torch.zeros(1, dtype=torch.int64, device=device).expand(3), "overlap"),
    }


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("case", ["meta", "other device", "shape", "expanded"])
def test_a_bad_out_is_refused_before_anything_is_written(target, case):
    out, match = _bad_outs(target.device)[case]
    for name, call in _entry_points(target.device).items():
        with pytest.raises(ValueError, match=match):
            call([1, 2, 3], out)
        if case == "expanded":  # nothing written: the one element keeps its value
            assert out.cpu().tolist() == [0, 0, 0], name


def test_an_out_that_requires_grad_is_refused(target):
    if target.sim is not None:  # no autograd there: refused up front, never dropped silently
        with pytest.raises(NotImplementedError, match="autograd"):
            torch.zeros(3, device=target.device, requires_grad=True)
        with pytest.raises(NotImplementedError, match="autograd"):
            torch.zeros(3, device=target.device).requires_grad_()
        return
    out = torch.zeros(3, dtype=torch.float32, device=target.device, requires_grad=True)
    pool = pinstage.UvaBufferPool((3,), torch.float32, max_concurrency=2, device=target.device)
    with pytest.raises(ValueError, match="requires grad"):
        pinstage.async_tensor_h2d([1.0, 2.0, 3.0], target.device, out=out)
    with pytest.raises(ValueError, match="requires grad"):
        pool.copy_to_gpu([1.0, 2.0, 3.0], out=out)
    with torch.no_grad():  # as torch allows an in-place write under no_grad
        pinstage.async_tensor_h2d([1.0, 2.0, 3.0], target.device, out=out)
    target.sync()
    assert out.detach().cpu().tolist() == [1.0, 2.0, 3.0]


def test_the_pool_refuses_an_out_of_another_dtype(target):
    """(async_tensor_h2d takes its dtype from out; a pool's dtype is fixed.)"""
    pool = pinstage.UvaBufferPool((3,), torch.int64, max_concurrency=2, device=target.device)
    with pytest.raises(ValueError, match="dtype torch.int32"):
        pool.copy_to_gpu([1, 2, 3], out=torch.empty(3, dtype=torch.int32, device=target.device))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_strided_out_of_its_own_is_written(target):
    base = torch.zeros(6, dtype=torch.int64, device=target.device)
    out = base[::2]  # non-contiguous, no overlap
    for call in _entry_points(target.device).values():
        base.zero_()
        assert call([4, 5, 6], out) is out
        target.sync()
        assert base.cpu().tolist() == [4, 0, 5, 0, 6, 0]


@pytest.mark.parametrize("dtype", [torch.quint8, torch.qint8, torch.qint32, torch.bits8])
def test_quantized_and_bits_dtypes_are_refused_with_pinstage_s_message(target, dtype):
    d = target.device
    makers = [
        lambda: pinstage.CpuGpuBuffer(4, dtype=dtype, device=d),
        lambda: pinstage.UvaBuffer(4, dtype, device=d),
        lambda: pinstage.UvaBufferPool((4,), dtype, max_concurrency=1, device=d),
        lambda: pinstage.StagedWriteTensor((2, 4), dtype, d),
        lambda: pinstage.async_tensor_h2d([1, 2], d, dtype=dtype),
    ]
    for make in makers:
        with pytest.raises(TypeError, match=f"dtype {dtype} is not supported"):
            make()


def test_a_size_no_tensor_can_hold_is_a_value_error(target):
    with pytest.raises(ValueError, match="bytes"):
        pinstage.CpuGpuBuffer(2**62, dtype=torch.float32, device=target.device)
