"""async_tensor_h2d, h2d_many, np_to_pinned_tensor against the source as reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import make_target, reference_equal
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import pinstage
from pinstage._state import device_state

LIST_CASES = [
    ([1, 2, 3], None, torch.int64),
    ([1.5, 2, -3], None, torch.float32),
    ([1, 2.5], None, torch.float32),
    ([True, False], None, torch.bool),
    ([[1, 2], [3, 4]], None, torch.int64),
    ((4, 5, 6), torch.int32, torch.int32),
    ([1, 2, 3], torch.float16, torch.float16),
    ([1.25, 2], torch.bfloat16, torch.bfloat16),
    ([], None, torch.float32),
    ([7], torch.int8, torch.int8),
]


@pytest.mark.parametrize("data,dtype,expected_dtype", LIST_CASES)
def test_lists_match_torch_tensor(target, data, dtype, expected_dtype):
    out = pinstage.async_tensor_h2d(data, target.device, dtype=dtype)
    target.sync()
    expected = torch.tensor(data, dtype=dtype)
    assert out.dtype == expected_dtype == expected.dtype
    assert out.shape == expected.shape
    assert torch.equal(out, expected)


def test_arrays_any_strides_and_dtypes(target):
    base = np.arange(60, dtype=np.int16).reshape(6, 10)
    cases = [base, base[::2, 1::3], base[::-1], base.T, np.float64(1.5) * base[:, ::-2],
             np.arange(5, dtype=">i4"), np.array(3.0), np.zeros((0, 3), np.float32)]
    outs = [pinstage.async_tensor_h2d(a, target.device) for a in cases]
    target.sync()
    for a, o in zip(cases, outs):
        ref = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("="))
        assert tuple(o.shape) == a.shape
        np.testing.assert_array_equal(o.cpu().numpy(), ref)


def test_tensors_pinned_or_not_contiguous_or_not(target):
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    srcs = [t, t[:, ::2], t.t(), t[1]]
    outs = [pinstage.async_tensor_h2d(s, target.device) for s in srcs]
    conv = pinstage.async_tensor_h2d(t[:, 1::2], target.device, dtype=torch.int64)
    target.sync()
    for s, o in zip(srcs, outs):
        assert torch.equal(o, s)
    assert torch.equal(conv, t[:, 1::2].to(torch.int64))


def test_source_may_change_after_return(target):
    arr = np.arange(8, dtype=np.int32)
    lst = [1, 2, 3]
    ten = torch.arange(5)
    a = pinstage.async_tensor_h2d(arr, target.device)
    b = pinstage.async_tensor_h2d(lst, target.device)
    c = pinstage.async_tensor_h2d(ten, target.device)
    arr[:] = -1
    lst[0] = 99
    ten.fill_(7)
    target.sync()  # no HazardError: these sources were staged
    reference_equal(a, np.arange(8, dtype=np.int32))
    reference_equal(b, [1, 2, 3])
    reference_equal(c, torch.arange(5))


def test_out_is_written_and_returned(target):
    out = pinstage.async_tensor_h2d([0, 0, 0], target.device, dtype=torch.int32)
    target.sync()
    res = pinstage.async_tensor_h2d([4, 5, 6], out=out)
    target.sync()
    assert res is out
    reference_equal(out, torch.tensor([4, 5, 6], dtype=torch.int32))


def test_out_mismatch_is_refused_and_out_unchanged(target):
    out = pinstage.async_tensor_h2d([1, 2, 3], target.device, dtype=torch.int32)
    target.sync()
    with pytest.raises(ValueError, match="dtype"):
        pinstage.async_tensor_h2d([1, 2, 3], out=out, dtype=torch.int64)
    with pytest.raises(ValueError, match="shape"):
        pinstage.async_tensor_h2d([1, 2], out=out)
    target.sync()
    reference_equal(out, torch.tensor([1, 2, 3], dtype=torch.int32))


def test_no_device_and_no_out_is_a_value_error():
    with pytest.raises(ValueError, match="device"):
        pinstage.async_tensor_h2d([1, 2])


@pytest.mark.parametrize("bad,exc", [
    ("abc", TypeError), ({"a": 1}, TypeError), (5, TypeError), (None, TypeError),
    ([[1, 2], [3]], ValueError), (["a", "b"], TypeError), ([1, "a"], TypeError),
    (np.array(["x"]), TypeError), (np.array([object()], dtype=object), TypeError),
    ([2**70], OverflowError), (b"bytes", TypeError), ({1, 2}, TypeError),
])
def test_bad_data_is_refused(target, bad, exc):
    with pytest.raises(exc):
        pinstage.async_tensor_h2d(bad, target.device)


def test_device_tensor_as_data_is_refused(sim_target):
    dev = pinstage.async_tensor_h2d([1, 2], sim_target.device)
    with pytest.raises(TypeError, match="device"):
        pinstage.async_tensor_h2d(dev, sim_target.device)
    with pytest.raises(TypeError):
        pinstage.async_tensor_h2d(torch.empty(2, device="meta"), sim_target.device)


def test_int_overflow_for_explicit_dtype_is_refused(target):
    with pytest.raises(OverflowError):
        pinstage.async_tensor_h2d([1, 2**40], target.device, dtype=torch.int32)


def test_bad_dtype_type():
    with pytest.raises(TypeError, match="dtype"):
        pinstage.async_tensor_h2d([1], "cpu", dtype="int32")


def test_h2d_many_returns_each_input(target):
    inputs = [[1, 2, 3], np.arange(6, dtype=np.float32).reshape(2, 3), torch.tensor([True]),
              np.zeros(0, np.int64), (9.5,)]
    outs = pinstage.h2d_many(inputs, target.device)
    target.sync()
    assert len(outs) == len(inputs)
    for i, o in zip(inputs, outs):
        ref = torch.as_tensor(np.asarray(i)) if not isinstance(i, (list, tuple)) else \
            torch.tensor(i)
        assert o.dtype == ref.dtype and o.shape == ref.shape
        assert torch.equal(o, ref)


def test_h2d_many_forced_dtype(target):
    outs = pinstage.h2d_many([[1, 2], np.array([3.0])], target.device, dtype=torch.int32)
    target.sync()
    assert all(o.dtype == torch.int32 for o in outs)
    reference_equal(outs[0], torch.tensor([1, 2], dtype=torch.int32))
    reference_equal(outs[1], torch.tensor([3], dtype=torch.int32))


def test_h2d_many_is_one_transfer(sim_target):
    before = sim_target.sim.stats.copies
    outs = pinstage.h2d_many([np.arange(i + 1) for i in range(8)], sim_target.device)
    sim_target.sync()
    assert sim_target.sim.stats.copies - before == 1
    for i, o in enumerate(outs):
        reference_equal(o, np.arange(i + 1))


def test_h2d_many_bad_input_names_position(target):
    with pytest.raises(TypeError, match=r"arrays\[1\]"):
        pinstage.h2d_many([[1], "x"], target.device)
    with pytest.raises(TypeError):
        pinstage.h2d_many(np.arange(3), target.device)


def test_np_to_pinned_tensor(target):
    arr = np.arange(10, dtype=np.float32)[::2]
    t = pinstage.np_to_pinned_tensor(arr)
    assert t.device.type == "cpu"
    np.testing.assert_array_equal(t.cpu().numpy(), arr)
    if pinstage.capabilities().pin_memory:
        assert target.sim.backend.is_pinned(t)
        arr[0] = 100  # a pinned result is a copy
        assert t[0] == 0
    with pytest.raises(TypeError):
        pinstage.np_to_pinned_tensor([1, 2])


def test_pageable_fallback_counts_stalls():
    from pinstage.testing import simulated_accelerator

    with simulated_accelerator("lazy", pin_memory=False) as sim:
        x = pinstage.async_tensor_h2d([1, 2, 3], sim.device)
        assert sim.stats.pageable_copies == 1 and sim.stats.host_stalls == 1
        reference_equal(x, [1, 2, 3])  # blocking: done on return


def test_pinned_staging_never_stalls_in_steady_state():
    from pinstage.testing import simulated_accelerator

    with simulated_accelerator("lazy") as sim:
        for i in range(200):
            pinstage.async_tensor_h2d(np.arange(64) + i, sim.device)
        assert sim.stats.host_stalls == 0
        assert sim.pending == 200  # nothing had to run: the host never waited


def test_large_source_is_chunked_and_exact(monkeypatch):
    from pinstage import _copies
    from pinstage.testing import simulated_accelerator

    monkeypatch.setattr(_copies, "CHUNK_BYTES", 4096)
    monkeypatch.setenv("PINSTAGE_STAGING_LIMIT", "16KiB")
    src = torch.arange(50_000, dtype=torch.float32).reshape(500, 100)[:, ::2]  # non-contiguous
    for mode in ("lazy", "random", "eager"):
        with simulated_accelerator(mode, seed=3) as sim:
            out = pinstage.async_tensor_h2d(src, sim.device, dtype=torch.float64)
            sim.synchronize()
            assert torch.equal(out, src.double())
            assert sim.stats.copies > 10  # went in chunks
            assert device_state(sim.backend).arena().reserved <= 16 * 1024  # the cap holds


@settings(max_examples=60, deadline=None)
@given(arr=hnp.arrays(dtype=st.sampled_from([np.int32, np.int64, np.float32, np.float64,
                                              np.uint8, np.bool_]),
                      shape=hnp.array_shapes(min_dims=1, max_dims=3, max_side=7)),
       target_name=st.sampled_from(["cpu", "sim-random-pin-uva", "sim-lazy-pin-nouva",
                                    "sim-eager-nopin-nouva"]),
       seed=st.integers(0, 1000))
def test_property_array_round_trip(arr, target_name, seed):
    with make_target(target_name, seed=seed) as t:
        out = pinstage.async_tensor_h2d(arr, t.device)
        many = pinstage.h2d_many([arr, arr[::-1]], t.device)
        t.sync()
        np.testing.assert_array_equal(out.cpu().numpy(), arr)
        np.testing.assert_array_equal(many[1].cpu().numpy(), arr[::-1])


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.integers(-2**31, 2**31 - 1), max_size=300),
       dtype=st.sampled_from([torch.int32, torch.int64, torch.float64]))
def test_property_int_lists(values, dtype):
    with make_target("sim-random-pin-uva", seed=len(values)) as t:
        out = pinstage.async_tensor_h2d(values, t.device, dtype=dtype)
        t.sync()
        assert torch.equal(out, torch.tensor(values, dtype=dtype))


def test_large_source_into_strided_out(monkeypatch):
    from pinstage import _copies
    from pinstage.testing import simulated_accelerator

    monkeypatch.setattr(_copies, "CHUNK_BYTES", 1024)
    with simulated_accelerator("random", seed=2) as sim:
        base = pinstage.async_tensor_h2d(np.zeros((64, 64), np.float32), sim.device)
        out = base[:, ::2]
        src = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
        res = pinstage.async_tensor_h2d(src, out=out)
        sim.synchronize()
        assert res is out
        np.testing.assert_array_equal(out.cpu().numpy(), src)
        assert float(base[:, 1::2].abs().sum()) == 0.0
