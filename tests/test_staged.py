"""StagedWriteTensor against a plain-tensor reference model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pinstage
from helpers import TARGET_IDS, make_target

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


@pytest.mark.parametrize("dtype,bad", [
    (torch.int32, [2**40]), (torch.int32, np.array([2**31], np.int64)),
    (torch.int64, [2**70]), (torch.float16, [1e6]), (torch.bfloat16, [1e39]),
    (torch.int32, torch.tensor([-(2**31) - 1])),
])
def test_value_that_does_not_fit_is_refused(target, dtype, bad):
    swt = pinstage.StagedWriteTensor((2, 4), dtype, target.device)
    swt.stage_write(1, 0, [1])
    with pytest.raises((ValueError, OverflowError)):
        swt.stage_write(0, 0, bad)
    swt.apply_write()
    target.sync()
    assert float(swt.gpu[1, 0]) == 1.0 and float(swt.gpu[0, 0]) == 0.0


@pytest.mark.parametrize("bad,exc", [
    (["a"], (TypeError, ValueError)), ("abc", TypeError), ([[1, 2]], ValueError),
    ([1.5], ValueError), (5, TypeError), ({1: 2}, TypeError),
])
def test_bad_values(target, bad, exc):
    swt = pinstage.StagedWriteTensor((2, 4), torch.int32, target.device)
    with pytest.raises(exc):
        swt.stage_write(0, 0, bad)
    assert swt.num_staged == 0


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
    swt = pinstage.StagedWriteTensor((3, 3), torch.int64, target.device, uva_instead_of_gpu=True)
    for step in range(6):
        swt.stage_write(step % 3, 0, [step, step, step])
        swt.apply_write()
    target.sync()
    assert swt.gpu.tolist() == [[3] * 3, [4] * 3, [5] * 3]
    if target.sim is not None and pinstage.capabilities().uva:
        assert target.sim.backend.is_pinned(swt.gpu)


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
