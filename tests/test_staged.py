"""StagedWriteTensor against a plain-tensor reference model."""

from __future__ import annotations

import array

import numpy as np
import pytest
import torch
from helpers import TARGET_IDS, make_target, run_threads
from hypothesis import given, settings
from hypothesis import strategies as st

import pinstage
from pinstage._convert import NotANumberError
from pinstage.testing import simulated_accelerator

DTYPES = [torch.int32, torch.int64, torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_writes_match_reference(target, dtype):
    rng = np.random.default_rng(7)
    rows, cols = 9, 13
    swt = pinstage.StagedWriteTensor((rows, cols), dtype, target.device)
    ref = torch.zeros(rows, cols, dtype=dtype)
    for _round in range(4):
        for _ in range(25):
            r = int(rng.integers(rows))
            s = int(rng.integers(cols))
            n = int(rng.integers(0, cols - s + 1))
            vals = rng.integers(-100, 100, n)
            form = rng.integers(4)
            arg = (vals.tolist(), vals, torch.from_numpy(vals), tuple(vals.tolist()))[form]
            swt.stage_write(r, s, arg)
            ref[r, s : s + n] = torch.from_numpy(vals).to(dtype)
        swt.apply_write()
    target.sync()
    assert torch.equal(swt.gpu, ref)


def test_later_write_wins_and_elem_writes(target):
    swt = pinstage.StagedWriteTensor((3, 4), torch.int32, target.device)
    swt.stage_write(1, 0, [1, 2, 3, 4])
    swt.stage_write(1, 1, [9, 9])
    swt.stage_write(1, 2, [5])
    swt.stage_write_elem(2, 42)
    swt.apply_write()
    target.sync()
    assert swt.gpu.tolist() == [[0, 0, 0, 0], [1, 9, 5, 4], [42, 0, 0, 0]]


def test_one_dimensional(target):
    swt = pinstage.StagedWriteTensor(5, torch.int64, target.device)
    swt.stage_write_elem(3, 2**40)
    swt.stage_write(0, 0, [7])
    swt.apply_write()
    target.sync()
    assert swt.gpu.tolist() == [7, 0, 0, 2**40, 0]
    swt.stage_write(1, 2, [1, 2])  # vLLM's 1-D meaning: gpu[index+start : ...]
    swt.apply_write()
    target.sync()
    assert swt.gpu.tolist() == [7, 0, 0, 1, 2]
    for args in [(1, 3, [1, 2]), (-1, 1, [1]), (0, -1, [1]), (5, 0, [1])]:
        with pytest.raises(IndexError, match="outside"):
            swt.stage_write(*args)
    with pytest.raises(IndexError):
        swt.stage_write_elem(5, 1)


def test_out_of_bounds_refused_and_earlier_writes_kept(target):
    swt = pinstage.StagedWriteTensor((8, 64), torch.int32, target.device)
    swt.stage_write(0, 0, [1, 2])
    for args in [(8, 0, [1]), (-1, 0, [1]), (7, 60, list(range(8))), (0, -1, [1]),
                 (0, 64, [1])]:
        with pytest.raises(IndexError, match=r"row|outside"):
            swt.stage_write(*args)
    swt.apply_write()
    target.sync()
    assert swt.gpu[0, :3].tolist() == [1, 2, 0]
    assert int(swt.gpu.abs().sum()) == 3


def _refused(swt, target, bad, exc, match=None):
    """Stage ``bad`` at (0, 0) and check that it is refused: by ``stage_write`` for arrays and
    tensors, by ``apply_write`` for a list or tuple (its values are packed there), which then
    writes nothing and keeps every staged write; either way the table is unchanged."""
    before = swt.num_staged
    if isinstance(bad, (list, tuple)):
        swt.stage_write(0, 0, bad)
        with pytest.raises(exc, match=match):
            swt.apply_write()
        assert swt.num_staged == before + len(bad)  # nothing lost
        target.sync()
        assert float(swt.gpu.double().abs().sum()) == 0  # nothing written
        swt.clear_staged_writes()
    else:
        with pytest.raises(exc, match=match):
            swt.stage_write(0, 0, bad)
        assert swt.num_staged == before
        swt.clear_staged_writes()


@pytest.mark.parametrize("dtype,bad", [
    (torch.int32, [2**40]), (torch.int32, np.array([2**31], np.int64)),
    (torch.int64, [2**70]), (torch.float16, [1e6]), (torch.bfloat16, [1e39]),
    (torch.int32, torch.tensor([-(2**31) - 1])), (torch.float32, (1e39, 0.0)),
])
def test_value_that_does_not_fit_is_refused(target, dtype, bad):
    swt = pinstage.StagedWriteTensor((2, 4), dtype, target.device)
    swt.stage_write(1, 0, [1])
    _refused(swt, target, bad, (ValueError, OverflowError))
    swt.stage_write(1, 0, [1])
    swt.apply_write()
    target.sync()
    assert float(swt.gpu[1, 0]) == 1.0 and float(swt.gpu.double().abs().sum()) == 1.0


@pytest.mark.parametrize("bad,exc", [
    (["a"], (TypeError, ValueError)), ("abc", TypeError), ([[1, 2]], ValueError),
    ([1.5], ValueError), (5, TypeError), ({1: 2}, TypeError), ((1, None), ValueError),
    (np.array([0.5]), ValueError),
])
def test_bad_values(target, bad, exc):
    swt = pinstage.StagedWriteTensor((2, 4), torch.int32, target.device)
    _refused(swt, target, bad, exc)
    assert swt.num_staged == 0


def test_list_values_are_copied_when_staged(target):
    """The caller may change its list of numbers as soon as stage_write returns (the list is
    copied; its values are packed by apply_write): the write keeps the values it had."""
    swt = pinstage.StagedWriteTensor((2, 4), torch.int32, target.device)
    values = [1, 2, 3]
    swt.stage_write(0, 1, values)
    values[0] = 99
    values.append(5)
    swt.stage_write(1, 0, [3.0, np.int64(4)])  # integral floats and NumPy ints convert
    swt.apply_write()
    target.sync()
    assert swt.gpu.tolist() == [[0, 1, 2, 3], [3, 4, 0, 0]]


def test_bad_index_types(target):
    swt = pinstage.StagedWriteTensor((2, 4), torch.int32, target.device)
    with pytest.raises(TypeError):
        swt.stage_write(1.0, 0, [1])
    with pytest.raises(TypeError):
        swt.stage_write(True, 0, [1])
    with pytest.raises(TypeError):
        swt.stage_write_elem(0, [1, 2])
    swt.stage_write(np.int64(1), np.int32(0), [3])  # NumPy ints are fine
    assert swt.num_staged == 1


def test_unsupported_dtype_lists_supported(target):
    with pytest.raises(ValueError, match="int32"):
        pinstage.StagedWriteTensor(4, torch.uint8, target.device)
    with pytest.raises(ValueError):
        pinstage.StagedWriteTensor((2, 3, 4), torch.int32, target.device)
    with pytest.raises(ValueError):
        pinstage.StagedWriteTensor(-2, torch.int32, target.device)


def test_clear_and_empty(target):
    swt = pinstage.StagedWriteTensor((2, 4), torch.float32, target.device)
    swt.stage_write(0, 0, [1.0])
    swt.clear_staged_writes()
    swt.stage_write(1, 2, [])
    swt.stage_write(1, 2, np.array([], np.float32))
    swt.apply_write()
    target.sync()
    assert float(swt.gpu.abs().sum()) == 0


def test_queued_work_sees_old_contents(sim_target):
    sim = sim_target.sim
    swt = pinstage.StagedWriteTensor((2, 2), torch.int32, sim.device)
    seen = torch.empty(2, 2, dtype=torch.int32)
    sim.launch(lambda src, dst: dst.copy_(src), swt.gpu, seen)  # queued before the write
    swt.stage_write(0, 0, [5, 6])
    swt.apply_write()
    sim.synchronize()
    assert seen.tolist() == [[0, 0], [0, 0]]
    assert swt.gpu.tolist() == [[5, 6], [0, 0]]


def test_at_most_one_copy_per_apply(sim_target):
    sim = sim_target.sim
    swt = pinstage.StagedWriteTensor((64, 16), torch.int32, sim.device)
    c0, l0 = sim.stats.copies, sim.stats.launches
    for r in range(64):
        swt.stage_write(r, 0, list(range(16)))
    swt.apply_write()
    assert sim.stats.copies - c0 <= 1
    assert sim.stats.launches - l0 == 1
    sim.synchronize()
    assert torch.equal(swt.gpu, torch.arange(16, dtype=torch.int32).repeat(64, 1))


def test_uva_instead_of_gpu(target):
    before = pinstage.host_memory_stats(target.device)["requested_bytes"]
    swt = pinstage.StagedWriteTensor((3, 3), torch.int64, target.device, uva_instead_of_gpu=True)
    pinned_table = pinstage.host_memory_stats(target.device)["requested_bytes"] - before
    for step in range(6):
        swt.stage_write(step % 3, 0, [step, step, step])
        swt.apply_write()
    target.sync()
    assert swt.gpu.tolist() == [[3] * 3, [4] * 3, [5] * 3]
    if target.sim is not None and pinstage.capabilities(target.device).uva:
        assert pinned_table >= 3 * 3 * 8  # the table lives in pinned host memory
        assert swt.gpu.device == target.device  # seen through a device view


def test_64bit_offsets_beyond_2_31_elements():
    """A table of more than 2**31 elements (4 GiB of float16) written past element 2**31."""
    rows, cols = 2**16 + 1, 2**15
    swt = pinstage.StagedWriteTensor((rows, cols), torch.float16, "cpu")
    swt.stage_write(rows - 1, cols - 3, [1.0, 2.0, 3.0])
    swt.stage_write(0, 0, [4.0])
    swt.apply_write()
    assert swt.gpu[rows - 1, -3:].tolist() == [1.0, 2.0, 3.0]
    assert float(swt.gpu[0, 0]) == 4.0
    assert float(swt.gpu[rows // 2].abs().sum()) == 0.0  # nothing wrapped into the middle
    del swt


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 7),
                              st.lists(st.integers(-1000, 1000), max_size=8)), max_size=40),
       target_name=st.sampled_from(TARGET_IDS), seed=st.integers(0, 10_000),
       dtype=st.sampled_from(DTYPES))
def test_property_matches_reference(ops, target_name, seed, dtype):
    with make_target(target_name, seed=seed) as t:
        swt = pinstage.StagedWriteTensor((6, 8), dtype, t.device, max_concurrency=2)
        ref = torch.zeros(6, 8, dtype=dtype)
        for i, (r, s, vals) in enumerate(ops):
            if s + len(vals) > 8:
                with pytest.raises(IndexError):
                    swt.stage_write(r, s, vals)
                continue
            swt.stage_write(r, s, vals)
            ref[r, s : s + len(vals)] = torch.tensor(vals, dtype=torch.float64).to(dtype)
            if i % 7 == 6:
                swt.apply_write()
        swt.apply_write()
        t.sync()
        assert torch.equal(swt.gpu, ref)


# -- vLLM's surface: any iterable, keyword x --------------------------------------------------
@pytest.mark.parametrize("make", [
    list, tuple, lambda v: range(v[0], v[0] + len(v)), lambda v: array.array("q", v),
    lambda v: (x for x in v), np.array, torch.tensor,
], ids=["list", "tuple", "range", "array.array", "generator", "ndarray", "tensor"])
def test_stage_write_takes_any_iterable(target, make):
    swt = pinstage.StagedWriteTensor((3, 8), torch.int64, target.device)
    swt.stage_write(1, 2, x=make([4, 5, 6]))
    swt.stage_write(2, 0, make([7]))
    swt.apply_write()
    target.sync()
    assert swt.gpu[1].tolist() == [0, 0, 4, 5, 6, 0, 0, 0]
    assert swt.gpu[2, 0].item() == 7


def test_overlap_resolution_matches_reference(target):
    """Many overlapping runs of different lengths, in clusters: the last staged write of each
    position wins (in random simulator mode duplicates would land in any order)."""
    rng = np.random.default_rng(3)
    swt = pinstage.StagedWriteTensor((16, 32), torch.int32, target.device)
    ref = np.zeros((16, 32), np.int32)
    for _round in range(5):
        for _ in range(300):
            r = int(rng.integers(16))
            n = int(rng.integers(1, 12)) if rng.random() < 0.5 else 8
            s = int(rng.integers(0, 32 - n + 1))
            vals = rng.integers(-(2**31), 2**31, n).tolist()
            swt.stage_write(r, s, vals)
            ref[r, s : s + n] = vals
        swt.apply_write()
    target.sync()
    np.testing.assert_array_equal(swt.gpu.cpu().numpy(), ref)


def test_one_dimensional_overlaps_across_index_and_start(target):
    swt = pinstage.StagedWriteTensor(10, torch.float32, target.device)
    swt.stage_write(2, 1, [1.0, 2.0, 3.0])  # gpu[3:6]
    swt.stage_write(0, 4, [9.0, 8.0])  # gpu[4:6], later: wins
    swt.stage_write_elem(3, 7.0)  # gpu[3]
    swt.apply_write()
    target.sync()
    assert swt.gpu.tolist() == [0, 0, 0, 7.0, 9.0, 8.0, 0, 0, 0, 0]


@pytest.mark.parametrize("uva", [True, False])
def test_burst_of_applies_makes_no_host_stall(uva):
    """Metadata goes through the pinned arena, fenced by the kernel that reads it: four applies
    with the device far behind (lazy mode: nothing runs) never make the host wait."""
    with simulated_accelerator("lazy", uva=uva) as sim:
        swt = pinstage.StagedWriteTensor((64, 16), torch.int32, sim.device, max_concurrency=2)
        sim.synchronize()
        stalls = sim.stats.host_stalls
        for step in range(4):
            for r in range(64):
                swt.stage_write(r, 0, [step] * 16)
            swt.apply_write()
        assert sim.stats.host_stalls == stalls
        sim.synchronize()
        assert int(swt.gpu.min()) == int(swt.gpu.max()) == 3


def test_applied_metadata_keeps_no_pinned_memory(sim_target):
    """Once the device has read a batch, its staging memory is free again: nothing cached by the
    table keeps pinned memory in use."""
    dev = sim_target.device
    swt = pinstage.StagedWriteTensor((32, 8), torch.int32, dev)
    sim_target.sync()
    before = pinstage.host_memory_stats(dev)["in_use_bytes"]
    for n in range(1, 30):  # many different batch sizes
        for r in range(n):
            swt.stage_write(r, 0, [n] * 8)
        swt.apply_write()
    sim_target.sync()
    assert pinstage.host_memory_stats(dev)["in_use_bytes"] == before


def test_made_under_inference_mode_works_outside(target):
    with torch.inference_mode():
        swt = pinstage.StagedWriteTensor((4, 4), torch.int32, target.device)
        swt.stage_write(0, 0, [1, 2])
        swt.apply_write()
    swt.stage_write(1, 0, [3])
    swt.apply_write()
    with torch.inference_mode():
        swt.stage_write(2, 0, [4])
        swt.apply_write()
    target.sync()
    assert swt.gpu[:3, :2].tolist() == [[1, 2], [3, 0], [4, 0]]


def test_threads_staging_into_one_table(target):
    """Several threads stage into one table and apply at will: every write lands, in each
    thread's order, and the staged count never goes wrong."""
    rows_per_thread, threads = 4, 6
    steps = 3000 if target.sim is None else 200  # the simulator runs every op in Python
    swt = pinstage.StagedWriteTensor((rows_per_thread * threads, 16), torch.int64, target.device)
    ref = np.zeros((rows_per_thread * threads, 16), np.int64)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            rng = np.random.default_rng(t)
            for i in range(steps):
                r = t * rows_per_thread + int(rng.integers(rows_per_thread))
                s = int(rng.integers(0, 12))
                vals = [t * 100000 + i] * 4
                swt.stage_write(r, s, vals)
                ref[r, s : s + 4] = vals
                assert 0 <= swt.num_staged <= steps * 4 * threads
                if i % 7 == 0:
                    swt.apply_write()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    run_threads(work, threads)
    assert not errors, errors
    swt.apply_write()
    target.sync()
    np.testing.assert_array_equal(swt.gpu.cpu().numpy(), ref)


# -- FusedStagedWriter -------------------------------------------------------------------------
def test_fused_writer_two_groups_one_copy(sim_target):
    sim = sim_target.sim
    a = pinstage.StagedWriteTensor((8, 16), torch.int32, sim.device)
    b = pinstage.StagedWriteTensor((8, 4), torch.int64, sim.device)
    c = pinstage.StagedWriteTensor(6, torch.bfloat16, sim.device)
    writer = pinstage.FusedStagedWriter(sim.device, max_writes=4)
    for r in range(8):  # more writes than max_writes: grows, never refused
        a.stage_write(r, r, list(range(r, r + 4)))
        b.stage_write(r, 0, [r * 2**40])
    a.stage_write(0, 0, [99])  # overlaps the first write to row 0: wins
    c.stage_write(1, 2, [1.5, -2.0])
    copies, launches = sim.stats.copies, sim.stats.launches
    writer.apply([a, b, c], output_ptrs=object(), output_strides=object())
    assert sim.stats.copies - copies <= 1  # one transfer for all three tables
    assert sim.stats.launches - launches <= 3  # a scatter per table, nothing else
    assert a.num_staged == b.num_staged == c.num_staged == 0
    sim.synchronize()
    ref = torch.zeros(8, 16, dtype=torch.int32)
    for r in range(8):
        ref[r, r : r + 4] = torch.arange(r, r + 4)
    ref[0, 0] = 99
    assert torch.equal(a.gpu, ref)
    assert b.gpu[:, 0].tolist() == [r * 2**40 for r in range(8)]
    assert c.gpu.float().tolist() == [0, 0, 0, 1.5, -2.0, 0]


def test_fused_writer_on_cpu_and_errors(target):
    a = pinstage.StagedWriteTensor((2, 2), torch.float32, target.device)
    writer = pinstage.FusedStagedWriter(target.device, 8)
    writer.apply([])  # nothing staged anywhere: nothing to do
    a.stage_write(1, 0, [0.5, 0.25])
    writer.apply([a, a])  # the same table twice is applied once
    target.sync()
    assert a.gpu.tolist() == [[0, 0], [0.5, 0.25]]
    with pytest.raises(TypeError):
        writer.apply(a)
    with pytest.raises(TypeError, match=r"tensors\[0\]"):
        writer.apply([torch.zeros(2)])
    with pytest.raises(ValueError):
        pinstage.FusedStagedWriter(target.device, -1)
    with pytest.raises(TypeError):
        pinstage.FusedStagedWriter(target.device, 1.5)
    if target.device.type != "cpu":  # (the old simulator's device was the CPU itself)
        cpu_table = pinstage.StagedWriteTensor(2, torch.int32, "cpu")
        with pytest.raises(ValueError, match="cpu"):
            writer.apply([cpu_table])


def test_overlap_resolver_leaves_unique_positions_last_write_wins():
    """The device scatter may apply duplicates in any order (a GPU does): the host resolver
    must hand it unique positions holding each position's last staged value."""
    from pinstage._staged import _last_writes

    rng = np.random.default_rng(5)
    for trial in range(200):
        w = int(rng.integers(2, 40))
        same = trial % 2 == 0
        lens = np.full(w, 4) if same else rng.integers(1, 9, w)
        starts = rng.integers(0, 60, w)
        idx = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)])
        vals = np.arange(idx.shape[0])  # value = staging order of the element
        keep = _last_writes(starts, lens, idx, 4 if same else 0)
        if keep is not None:
            idx, vals = idx[keep], vals[keep]
        assert len(np.unique(idx)) == len(idx)
        expected: dict[int, int] = {}
        for i, v in zip(np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)]),
                        range(int(lens.sum()))):
            expected[int(i)] = v
        assert dict(zip(idx.tolist(), vals.tolist())) == expected


def test_staging_calls_refused_while_capturing_a_graph():
    """apply_write and the pools stage through memory reused after the call: a captured copy
    would replay stale data, so they refuse while the stream captures (writes stay staged)."""
    with simulated_accelerator("lazy") as sim:
        backend = pinstage._backend.get_backend(sim.device)
        if not (hasattr(backend, "is_capturing") and hasattr(torch.cuda, "CUDAGraph")
                and torch.cuda.is_available()):
            pytest.skip("needs the simulated CUDA's graphs")
        swt = pinstage.StagedWriteTensor((2, 2), torch.int32, sim.device)
        pool = pinstage.UvaBufferPool(2, torch.int32, device=sim.device)
        swt.stage_write(0, 0, [1, 2])
        graph = torch.cuda.CUDAGraph()
        # (all refused: the graph is empty, which CUDA warns about at capture_end)
        with pytest.warns(UserWarning, match="The CUDA Graph is empty"), \
                torch.cuda.graph(graph):
            with pytest.raises(RuntimeError, match="CUDA graph"):
                swt.apply_write()
            with pytest.raises(RuntimeError, match="CUDA graph"):
                pool.copy_to_uva([1])
        assert swt.num_staged == 2
        swt.apply_write()
        sim.synchronize()
        assert swt.gpu.cpu().tolist() == [[1, 2], [0, 0]]


def test_batch_larger_than_the_staging_cap_goes_in_pieces(monkeypatch):
    """A batch whose metadata exceeds PINSTAGE_STAGING_LIMIT is applied in pieces (one copy
    each) instead of failing; the result is the same."""
    monkeypatch.setenv("PINSTAGE_STAGING_LIMIT", "8KiB")
    with simulated_accelerator("lazy", uva=False) as sim:
        swt = pinstage.StagedWriteTensor((512, 16), torch.int32, sim.device)
        for r in range(512):
            swt.stage_write(r, 0, list(range(r, r + 16)))  # 8192 values: ~96 KiB of metadata
        swt.stage_write(0, 0, [-1])  # overlaps: still the last write wins
        swt.apply_write()
        sim.synchronize()
        expected = torch.arange(16).repeat(512, 1) + torch.arange(512)[:, None]
        expected[0, 0] = -1
        assert torch.equal(swt.gpu.cpu(), expected.to(torch.int32))
        assert swt.num_staged == 0


def test_dropped_table_is_freed_at_once(target):
    """No reference cycle: a dropped table (and its device and pinned memory) goes when its last
    reference does, not at some later garbage collection."""
    import gc
    import weakref

    gc.disable()
    try:
        swt = pinstage.StagedWriteTensor((4, 4), torch.int32, target.device)
        swt.stage_write(0, 0, [1, 2])
        swt.apply_write()
        ref = weakref.ref(swt)
        del swt
        assert ref() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("bad,exc,not_exc", [
    ([2**40], pinstage.ValueOverflowError, None),
    ((1, None), NotANumberError, None),
    ([1.5], ValueError, OverflowError),
    (["a"], NotANumberError, None),
])
def test_apply_time_refusal_keeps_the_exception_type(target, bad, exc, not_exc):
    """A list's values refused by apply_write raise what the rule raises at staging
    (``ValueOverflowError`` for out-of-range values, ``NotANumberError`` for non-numbers)."""
    swt = pinstage.StagedWriteTensor((2, 4), torch.int32, target.device)
    swt.stage_write(1, 0, bad)
    with pytest.raises(exc, match=r"row 1, columns 0\.\.\d+ of the \(2, 4\) torch.int32") as info:
        swt.apply_write()
    if not_exc is not None:
        assert not isinstance(info.value, not_exc)
    with pytest.raises(exc):  # the rule's own error for the same values, at staging
        pinstage.async_tensor_h2d(list(bad), target.device, dtype=torch.int32)


def test_apply_time_refusal_of_an_odd_exception_type(target):
    """An element whose ``__index__`` raises a ValueError subclass with its own constructor:
    apply_write still refuses with a ValueError naming the write (and keeps it staged)."""
    class CodedError(ValueError):
        def __init__(self, code, msg):
            super().__init__(msg)
            self.code = code

    class BadId:
        def __index__(self):
            raise CodedError(7, "no such block")

    swt = pinstage.StagedWriteTensor(8, torch.int32, target.device)
    swt.stage_write(0, 2, [1, BadId()])
    with pytest.raises(ValueError, match=r"elements 2\.\.4 .* is refused"):
        swt.apply_write()
    assert swt.num_staged == 2


@pytest.mark.parametrize("element", ["tensor", "ndarray"])
def test_simulator_catches_a_list_element_changed_before_apply(sim_target, element):
    """stage_write copies the list, not its elements: a 0-d tensor or array in it that the
    caller changes before apply_write is read changed. On a GPU machine that is a silently
    wrong table; the simulated CUDA raises HazardError, writes nothing and keeps the writes."""
    from pinstage.testing import HazardError

    swt = pinstage.StagedWriteTensor((3, 4), torch.int32, sim_target.device)
    scratch = torch.zeros(4, dtype=torch.int32) if element == "tensor" else np.zeros(4, np.int32)
    for r, ids in enumerate([[1, 2, 3, 4], [5, 6, 7, 8]]):
        scratch[:] = torch.tensor(ids) if element == "tensor" else ids  # reused per request
        swt.stage_write(r, 0, list(scratch) if element == "tensor" else
                        [scratch[i : i + 1].reshape(()) for i in range(4)])
    with pytest.raises(HazardError, match=r"row 0, columns 0\.\.4 .* changed between "
                                          r"stage_write and apply_write"):
        swt.apply_write()
    assert swt.num_staged == 8
    sim_target.sync()
    assert int(swt.gpu.abs().sum()) == 0
    swt.clear_staged_writes()
    swt.stage_write(0, 0, [1, 2, 3, 4])  # numbers: nothing to check, nothing to report
    swt.stage_write(1, 0, list(scratch))  # elements unchanged until applied: fine
    swt.apply_write()
    sim_target.sync()
    assert swt.gpu.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [0, 0, 0, 0]]


# -- issue 19: vLLM's private staged state, as read-only views ---------------------------------

@pytest.mark.parametrize("dtype", [torch.int32, torch.float32, torch.bfloat16])
def test_vllm_private_staging_lists_are_views_of_what_is_staged(target, dtype):
    swt = pinstage.StagedWriteTensor((4, 8), dtype, target.device)
    swt.stage_write(2, 3, [3, 1, 2])
    swt.stage_write(0, 1, np.array([-1, -2, -4]))
    swt.stage_write_elem(1, 7)
    assert swt._staged_write_indices == [2, 0, 1]
    assert swt._staged_write_starts == [3, 1, 0]
    assert swt._staged_write_contents == [3, 1, 2, -1, -2, -4, 7]
    assert swt._staged_write_cu_lens == [3, 6, 7]
    assert swt._staged_write_numel == 7
    mat = swt._materialize_staged_write_contents()
    assert mat.tolist() == [3, 1, 2, -1, -2, -4, 7] and mat.dtype == (
        np.float32 if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype)
    # what vLLM's FusedStagedWriter reads reproduces the table pinstage writes
    ref = torch.zeros(4, 8, dtype=dtype)
    cu = [0, *swt._staged_write_cu_lens]
    for w, (i, s) in enumerate(zip(swt._staged_write_indices, swt._staged_write_starts)):
        vals = swt._staged_write_contents[cu[w]:cu[w + 1]]
        ref[i, s:s + len(vals)] = torch.tensor(vals, dtype=dtype)
    swt.apply_write()
    target.sync()
    assert torch.equal(swt.gpu.cpu(), ref)
    assert swt._staged_write_indices == [] and swt._staged_write_cu_lens == []
    assert swt._materialize_staged_write_contents().size == 0


def test_vllm_private_staging_views_refuse_changes_clearly():
    swt = pinstage.StagedWriteTensor(8, torch.int64, "cpu")
    swt.stage_write(2, 1, [5, 6])  # 1-D: vLLM's meaning, gpu[3:5]
    assert swt._staged_write_indices == [3] and swt._staged_write_starts == [0]
    for change in (lambda v: v.clear(), lambda v: v.append(1), lambda v: v.__setitem__(0, 1)):
        with pytest.raises(TypeError, match="read-only view"):
            change(swt._staged_write_indices)
    with pytest.raises(AttributeError, match="read-only view"):
        swt._staged_write_indices = []
    # a table built as vLLM's test builds one (__new__, then assigning the lists) fails at
    # the first assignment, saying why, rather than later with a missing attribute
    bare = pinstage.StagedWriteTensor.__new__(pinstage.StagedWriteTensor)
    with pytest.raises(AttributeError, match="stage_write"):
        bare._staged_write_contents = []
    assert swt._staged_write_contents == [5, 6]  # nothing changed
    # and pinstage's FusedStagedWriter refuses a table that is not pinstage's
    with pytest.raises(TypeError, match="StagedWriteTensor"):
        pinstage.FusedStagedWriter("cpu", 4).apply([object()])  # type: ignore[list-item]


def test_write_contents_says_whether_the_table_lives_in_pinned_memory(target):
    plain = pinstage.StagedWriteTensor((2, 4), torch.int32, target.device)
    assert plain.write_contents is None
    uva = pinstage.StagedWriteTensor((2, 4), torch.int32, target.device, uva_instead_of_gpu=True)
    in_uva_buffer = pinstage.capabilities(target.device).uva  # (the CPU target: always)
    assert (uva.write_contents is not None) == in_uva_buffer
    if in_uva_buffer:
        assert uva.write_contents.uva().data_ptr() == uva.gpu.data_ptr()
