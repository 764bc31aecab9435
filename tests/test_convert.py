"""The one conversion rule, on every entry point: values that don't fit the target dtype are
refused with a message naming them, never wrapped or truncated."""

from __future__ import annotations

import array
import warnings

import numpy as np
import pytest
import torch

import pinstage
from pinstage import _compat
from pinstage._convert import HostSource, NotANumberError, check_fits, values_bytes

# The table: input into int32 -> (exception, what the message must say)
ROWS = {
    "float-1.5": ([1.5], ValueError, r"1\.5.*not a whole number"),
    "ndarray-2**40": (np.array([2**40]), pinstage.ValueOverflowError, r"1099511627776.*int32"),
    "float-array-3e9": (np.array([3e9]), pinstage.ValueOverflowError, r"3000000000.*int32"),
    "none": ([1, None], ValueError, r"None.*not a number"),
}


def _elem(data):
    """The offending element alone (stage_write_elem takes one value)."""
    return data[-1]


def _async_copy_to_gpu(data, device):
    out = pinstage.async_tensor_h2d([0] * len(data), device, dtype=torch.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pinstage.async_copy_to_gpu(data, out=out)


ENTRY_POINTS = {
    "async_tensor_h2d": lambda d, dev: pinstage.async_tensor_h2d(d, dev, dtype=torch.int32),
    "h2d_many": lambda d, dev: pinstage.h2d_many([[7], d], dev, dtype=torch.int32),
    "pool.copy_to_uva": lambda d, dev: pinstage.UvaBufferPool(8, torch.int32,
                                                              device=dev).copy_to_uva(d),
    "pool.copy_to_gpu": lambda d, dev: pinstage.UvaBufferPool(8, torch.int32,
                                                              device=dev).copy_to_gpu(d),
    "async_copy_to_gpu": _async_copy_to_gpu,
}


@pytest.mark.parametrize("row", list(ROWS))
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_table_row_refused_by_copies_and_pools(target, entry, row):
    data, exc, message = ROWS[row]
    with pytest.raises(exc, match=message):
        ENTRY_POINTS[entry](data, target.device)


def _deferred(data):
    """Whether stage_write leaves checking these values to apply_write (a list or tuple)."""
    return isinstance(data, (list, tuple))


@pytest.mark.parametrize("row", list(ROWS))
def test_table_row_refused_by_stage_write(target, row):
    """Refused when staged (arrays), or by apply_write before it writes anything (lists, whose
    values are packed there): then nothing is written and every staged write stays staged."""
    data, exc, message = ROWS[row]
    def stage(swt, call):
        if call == "positional":
            swt.stage_write(0, 0, data)
        else:
            swt.stage_write(0, 0, x=data)

    for call in ("positional", "keyword"):
        swt = pinstage.StagedWriteTensor((2, 8), torch.int32, target.device)
        swt.stage_write(1, 0, [5])
        if _deferred(data):
            stage(swt, call)
            with pytest.raises(exc, match=message):
                swt.apply_write()
            names_it = r"row 0, columns 0\.\.\d+ of the \(2, 8\) torch.int32 table is refused"
            with pytest.raises(exc, match=names_it):
                swt.apply_write()  # still staged, still refused, naming the write
            assert swt.num_staged == 1 + len(data)
            target.sync()
            assert int(swt.gpu.abs().sum()) == 0  # nothing written, not even the good write
            swt.clear_staged_writes()
            swt.stage_write(1, 0, [5])
        else:
            with pytest.raises(exc, match=message):
                stage(swt, call)
            assert swt.num_staged == 1  # the earlier write stays staged
        swt.apply_write()
        target.sync()
        assert swt.gpu[1, 0].item() == 5 and int(swt.gpu.abs().sum()) == 5


@pytest.mark.parametrize("row", list(ROWS))
def test_table_row_refused_by_stage_write_elem(target, row):
    data, exc, message = ROWS[row]
    swt = pinstage.StagedWriteTensor(4, torch.int32, target.device)
    with pytest.raises(exc, match=message):
        swt.stage_write_elem(0, _elem(data))
    assert swt.num_staged == 0


@pytest.mark.parametrize("row", list(ROWS))
def test_table_row_refused_by_fused_writer_tables(target, row):
    """FusedStagedWriter applies what StagedWriteTensor staged: values are refused when staged
    or, for a list, by apply(), which then writes nothing to any table and keeps every write."""
    data, exc, message = ROWS[row]
    a = pinstage.StagedWriteTensor((2, 4), torch.int32, target.device)
    b = pinstage.StagedWriteTensor(4, torch.int64, target.device)
    writer = pinstage.FusedStagedWriter(target.device, 16)
    b.stage_write(1, 1, [7, 8])
    if _deferred(data):
        a.stage_write(0, 0, data)
        with pytest.raises(exc, match=message):
            writer.apply([b, a])
        assert b.num_staged == 2 and a.num_staged == len(data)
        target.sync()
        assert int(a.gpu.abs().sum()) == 0 and int(b.gpu.abs().sum()) == 0
        a.clear_staged_writes()
    else:
        with pytest.raises(exc, match=message):
            a.stage_write(0, 0, data)
    writer.apply([b, a])
    target.sync()
    assert int(a.gpu.abs().sum()) == 0
    assert b.gpu.tolist() == [0, 0, 7, 8]


def test_same_dtype_sources_are_not_scanned():
    big = np.arange(1 << 16, dtype=np.int32)
    assert check_fits(big, torch.int32) is big
    assert check_fits(big, torch.int64) is big  # int32 fits int64 whole: no scan
    assert check_fits(np.zeros(4, np.float16), torch.float32).dtype == np.float16


def test_list_fast_path_packs_in_one_call():
    src = HostSource(list(range(256)), torch.int32, pinstage._backend.get_backend("cpu"))
    assert src.packed is not None and src.dtype == torch.int32
    whole = HostSource([1.0, 2.0], torch.int32, pinstage._backend.get_backend("cpu"))
    assert whole.host_tensor().tolist() == [1, 2]  # integral floats convert exactly


@pytest.mark.parametrize("data,dtype,exc,message", [
    ([float("nan")], torch.int64, ValueError, "not a finite number"),
    ([float("inf")], torch.int32, ValueError, "not a finite number"),
    (np.array([2**31], np.int64), torch.int32, pinstage.ValueOverflowError, "2147483648"),
    (np.array([-1]), torch.uint8, pinstage.ValueOverflowError, "-1"),
    (np.array([2.0**63]), torch.int64, pinstage.ValueOverflowError, "does not fit"),
    ([2**70], torch.int64, pinstage.ValueOverflowError, "1180591620717411303424"),
    ([1e6], torch.float16, pinstage.ValueOverflowError, "infinity"),
    (np.array([70000], np.int32), torch.float16, pinstage.ValueOverflowError, "70000"),
    ([1e39], torch.bfloat16, pinstage.ValueOverflowError, "infinity"),
    (np.array([3.5e38]), torch.float32, pinstage.ValueOverflowError, "infinity"),
    ([2], torch.bool, pinstage.ValueOverflowError, "0 or 1"),
    ([0.5], torch.bool, ValueError, "whole number"),
    (np.array([1 + 2j]), torch.float32, ValueError, "imaginary"),
    (["a"], torch.int32, NotANumberError, "'a'"),
    ([[1, 2], [3, None]], torch.int32, NotANumberError, r"\[1, 1\] is None"),
])
def test_rule_per_dtype(target, data, dtype, exc, message):
    with pytest.raises(exc, match=message):
        pinstage.async_tensor_h2d(data, target.device, dtype=dtype)


@pytest.mark.parametrize("data,dtype,expected", [
    ([65504.0, float("inf"), float("nan")], torch.float16, [65504.0, float("inf"), float("nan")]),
    ([65519.0], torch.float16, [65504.0]),  # rounds to the largest float16, not to inf
    ([True, False, 1, 0], torch.bool, [True, False, True, False]),
    (np.array([1.0, 0.0]), torch.bool, [True, False]),
    ([2**70], torch.float32, [float(2**70)]),  # a big int fits float32's range
    (np.array([3.0, -2.0]), torch.int8, [3, -2]),
    (np.array([1 + 0j]), torch.float64, [1.0]),
    (torch.tensor([2.0, 3.0], dtype=torch.bfloat16), torch.int32, [2, 3]),
    (np.array([2**63 - 1], np.uint64), torch.int64, [2**63 - 1]),
])
def test_values_that_fit_are_converted(target, data, dtype, expected):
    out = pinstage.async_tensor_h2d(data, target.device, dtype=dtype)
    target.sync()
    np.testing.assert_array_equal(out.cpu().to(torch.float64).numpy(),
                                  np.asarray(expected, dtype=np.float64))


def test_tensor_sources_follow_the_rule(target):
    with pytest.raises(pinstage.ValueOverflowError, match="4294967296"):
        pinstage.async_tensor_h2d(torch.tensor([2**32]), target.device, dtype=torch.int32)
    with pytest.raises(ValueError, match="whole"):
        pinstage.async_tensor_h2d(torch.tensor([0.25]), target.device, dtype=torch.int64)
    with pytest.raises(pinstage.ValueOverflowError):
        pinstage.async_tensor_h2d(torch.tensor([1e5]), target.device, dtype=torch.float16)


@pytest.mark.parametrize("values", [
    [1, 2, 3], (1, 2, 3), range(1, 4), array.array("i", [1, 2, 3]), (v for v in (1, 2, 3)),
    np.array([1, 2, 3], np.int16), torch.tensor([1, 2, 3]), np.array([1.0, 2.0, 3.0]),
])
def test_values_bytes_takes_any_iterable(values):
    data, n = values_bytes(values, torch.int32)
    assert n == 3 and np.frombuffer(data, np.int32).tolist() == [1, 2, 3]


@pytest.mark.parametrize("values,exc", [
    ("abc", TypeError), (b"ab", TypeError), ({1: 2}, TypeError), ({1, 2}, TypeError),
    (5, TypeError),
    (np.zeros((2, 2)), ValueError), ([[1, 2]], ValueError), (np.array(["x"]), NotANumberError),
])
def test_values_bytes_refuses_non_sequences(values, exc):
    with pytest.raises(exc):
        values_bytes(values, torch.int32)


def test_bfloat16_bits():
    data, n = values_bytes([1.0, -2.5], torch.bfloat16)
    t = torch.frombuffer(bytearray(data), dtype=torch.bfloat16)
    assert n == 2 and t.tolist() == [1.0, -2.5]


def test_async_copy_to_gpu_warns_once(target, monkeypatch):
    monkeypatch.setattr(_compat, "_warned", False)
    with pytest.warns(DeprecationWarning, match="async_tensor_h2d"):
        pinstage.async_copy_to_gpu([1, 2], device=target.device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = pinstage.async_copy_to_gpu(np.arange(3), device=target.device)
    target.sync()
    assert out.tolist() == [0, 1, 2]
