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
from pinstage._staged import SUPPORTED_DTYPES

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


# -- issue 20: the conversion rule's last holes, one row per case on every entry point -------
# Each case: (data, dtype, expected). expected: ("ok", result dtype, values) or
# (exception type, regex the message must match: it names the value).
M64 = np.uint64(2**64 - 1)
NOT_A_NUMBER = (NotANumberError, r"is b'1' \(bytes\), which is not a number")
CASES = {
    # complex into real dtypes: refused when the imaginary part is not zero
    "np.complex64(1j)->float32": ([np.complex64(1j)], torch.float32,
                                  (ValueError, r"1j.*imaginary")),
    "np.complex64(1j)->float16": ([np.complex64(1j)], torch.float16,
                                  (ValueError, r"1j.*imaginary")),
    "np.complex64(1j)->float64": ([np.complex64(1j)], torch.float64,
                                  (ValueError, r"1j.*imaginary")),
    "np.complex128(1j)->float32": ([np.complex128(1j)], torch.float32,
                                   (ValueError, r"1j.*imaginary")),
    "np.complex64(3j)->int32": ([np.complex64(3j)], torch.int32, (ValueError, r"3j.*imaginary")),
    "1j->float32": ([1j], torch.float32, (ValueError, r"1j.*imaginary")),
    "[1.0, np.complex64(1j)]->float32": ([1.0, np.complex64(1j)], torch.float32,
                                         (ValueError, r"1j at \[1\].*imaginary")),
    "[1, np.complex64(2j)]->int64": ([1, np.complex64(2j)], torch.int64,
                                     (ValueError, r"2j at \[1\].*imaginary")),
    "complex array->float32": (np.array([1j]), torch.float32, (ValueError, r"1j.*imaginary")),
    "complex tensor->float32": (torch.tensor([1j]), torch.float32, (ValueError, r"1j.*imaginary")),
    "np.complex64(2+0j)->float32": ([np.complex64(2 + 0j)], torch.float32,
                                    ("ok", torch.float32, [2.0])),
    "np.complex64(2+0j)->int32": ([np.complex64(2 + 0j)], torch.int32, ("ok", torch.int32, [2])),
    # bytes and strings are never numbers
    "b'1'->int32": ([b"1"], torch.int32, NOT_A_NUMBER),
    "b'1'->int64": ([b"1"], torch.int64, NOT_A_NUMBER),
    "b'1'->float32": ([b"1"], torch.float32, NOT_A_NUMBER),
    "b'1'->float16": ([b"1"], torch.float16, NOT_A_NUMBER),
    "b'1'->bfloat16": ([b"1"], torch.bfloat16, NOT_A_NUMBER),
    "[1, b'1']->int64": ([1, b"1"], torch.int64, (NotANumberError, r"\[1\] is b'1'")),
    "'1'->float32": (["1"], torch.float32, (NotANumberError, r"is '1' \(str\)")),
    "bytearray->int64": ([bytearray(b"1")], torch.int64,
                         (NotANumberError, r"bytearray\(b'1'\) \(bytearray\), which is not")),
    "bytearray->float32": ([bytearray(b"12")], torch.float32,
                           (NotANumberError, r"bytearray\(b'12'\)")),
    "memoryview->int32": ([memoryview(b"1")], torch.int32, (NotANumberError, r"memoryview")),
    "[[1], bytearray]->int32": ([[1], bytearray(b"1")], torch.int32,
                                (NotANumberError, r"\[1\] is bytearray\(b'1'\)")),
    "b'1'->None": ([b"1"], None, NOT_A_NUMBER),
    # ints beyond int64 with no dtype: refused, as torch.tensor refuses them
    "[2**63]->None": ([2**63], None, (pinstage.ValueOverflowError, r"9223372036854775808")),
    "[2**64]->None": ([2**64], None, (pinstage.ValueOverflowError, r"18446744073709551616")),
    "[-2**63-1]->None": ([-2**63 - 1], None,
                         (pinstage.ValueOverflowError, r"-9223372036854775809")),
    "[0, 2**63]->None": ([0, 2**63], None,
                         (pinstage.ValueOverflowError, r"9223372036854775808 at \[1\]")),
    "[2**63, -1]->None": ([2**63, -1], None,
                          (pinstage.ValueOverflowError, r"9223372036854775808 at \[0\]")),
    "[2**63, 1.5]->None": ([2**63, 1.5], None, ("ok", torch.float32, [2.0**63, 1.5])),
    # 2**63 and beyond into floating dtypes that hold them: the nearest value
    "2**63->bfloat16": ([2**63], torch.bfloat16, ("ok", torch.bfloat16, [2.0**63])),
    "2**63->float32": ([2**63], torch.float32, ("ok", torch.float32, [2.0**63])),
    "2**63->float64": ([2**63], torch.float64, ("ok", torch.float64, [2.0**63])),
    "[1.0, 2**63]->bfloat16": ([1.0, 2**63], torch.bfloat16,
                               ("ok", torch.bfloat16, [1.0, 2.0**63])),
    "2**64-1->float32": ([2**64 - 1], torch.float32, ("ok", torch.float32, [2.0**64])),
    "2**100->bfloat16": ([2**100], torch.bfloat16, ("ok", torch.bfloat16, [2.0**100])),
    "2**63+1->float64": ([2**63 + 1], torch.float64, ("ok", torch.float64, [2.0**63])),
    "2**63->float16": ([2**63], torch.float16,
                       (pinstage.ValueOverflowError, r"9223372036854775808.*float16")),
    "2**1100->float64": ([2**1100], torch.float64,
                         (pinstage.ValueOverflowError, r"13582985290493858492\d+ at \[0\]")),
    # np.array([2**63]): NumPy infers numpy.ulonglong, which torch.from_numpy refuses
    "np.array([2**63])->None": (np.array([2**63]), None, ("ok", torch.uint64, [2**63])),
    "np.array([2**63])->float32": (np.array([2**63]), torch.float32,
                                   ("ok", torch.float32, [2.0**63])),
    "np.array([2**63])->bfloat16": (np.array([2**63]), torch.bfloat16,
                                    ("ok", torch.bfloat16, [2.0**63])),
    "np.array([2**63])->int64": (np.array([2**63]), torch.int64,
                                 (pinstage.ValueOverflowError, r"9223372036854775808.*int64")),
    # np.uint64(2**64-1) into uint64: it fits
    "[np.uint64(2**64-1)]->uint64": ([M64], torch.uint64, ("ok", torch.uint64, [2**64 - 1])),
    "[np.uint64(2**64-1), 1]->uint64": ([M64, 1], torch.uint64,
                                        ("ok", torch.uint64, [2**64 - 1, 1])),
    "[1, np.uint64(2**64-1)]->uint64": ([1, M64], torch.uint64,
                                        ("ok", torch.uint64, [1, 2**64 - 1])),
    "[2**63+1, 1.0]->uint64": ([2**63 + 1, 1.0], torch.uint64,
                               ("ok", torch.uint64, [2**63 + 1, 1])),
    "[-(2**53+1), 0.0]->int64": ([-(2**53 + 1), 0.0], torch.int64,  # NumPy: float64, rounded
                                 ("ok", torch.int64, [-(2**53 + 1), 0])),
    "[np.uint64(2**62+1), -1]->int64": ([np.uint64(2**62 + 1), -1], torch.int64,
                                        ("ok", torch.int64, [2**62 + 1, -1])),
}


def _zeros(dtype, n, device):
    return pinstage.async_tensor_h2d(torch.zeros(n, dtype=dtype), device)


def _staged(data, dtype, device, how):
    """Stage ``data`` into a fresh table, apply it (``how``: stage_write, stage_write_elem or
    FusedStagedWriter) and return the table's values."""
    swt = pinstage.StagedWriteTensor(len(data), dtype, device)
    try:
        if how == "stage_write_elem":
            swt.stage_write_elem(0, data if isinstance(data, (np.ndarray, torch.Tensor))
                                 else data[0])
        else:
            swt.stage_write(0, 0, data)
        if how == "FusedStagedWriter":
            pinstage.FusedStagedWriter(device, 4).apply([swt])
        else:
            swt.apply_write()
    except Exception:
        pinstage.synchronize(device)
        assert int(swt.gpu.to(torch.float64).abs().sum()) == 0  # nothing written
        raise
    return swt.gpu


CONVERT_ENTRY_POINTS = {
    "async_tensor_h2d": lambda d, dt, dev, n: pinstage.async_tensor_h2d(d, dev, dtype=dt),
    "h2d_many": lambda d, dt, dev, n: pinstage.h2d_many([[7], d], dev, dtype=dt)[1],
    "async_tensor_h2d(out=)": lambda d, dt, dev, n: pinstage.async_tensor_h2d(
        d, out=_zeros(dt, n, dev)),
    "UvaBufferPool.copy_to_uva": lambda d, dt, dev, n: pinstage.UvaBufferPool(
        8, dt, device=dev).copy_to_uva(d),
    "UvaBufferPool.copy_to_gpu": lambda d, dt, dev, n: pinstage.UvaBufferPool(
        8, dt, device=dev).copy_to_gpu(d),
    "stage_write": lambda d, dt, dev, n: _staged(d, dt, dev, "stage_write"),
    "stage_write_elem": lambda d, dt, dev, n: _staged(d, dt, dev, "stage_write_elem"),
    "FusedStagedWriter": lambda d, dt, dev, n: _staged(d, dt, dev, "FusedStagedWriter"),
    "np_to_pinned_tensor": lambda d, dt, dev, n: pinstage.np_to_pinned_tensor(d),
}


def _applies(entry, data, dtype, expected):
    """Whether the case is one this entry point takes (its dtype, its kind of input)."""
    ok = expected[0] == "ok"
    if entry == "np_to_pinned_tensor":
        return isinstance(data, np.ndarray) and dtype is None
    if entry == "async_tensor_h2d(out=)":
        return dtype is not None or ok  # (out= gives the dtype: the result's)
    if dtype is None:
        return entry in ("async_tensor_h2d", "h2d_many")
    if entry.startswith(("stage", "Fused")):
        if dtype not in SUPPORTED_DTYPES:
            return False
        if entry == "stage_write_elem":
            return len(data) == 1
        return True
    return True


CONVERT_ROWS = [pytest.param(case, entry, id=f"{entry}-{case}")
                for case, (data, dtype, expected) in CASES.items()
                for entry in CONVERT_ENTRY_POINTS if _applies(entry, data, dtype, expected)]
# one simulated configuration per mode (pinned memory and UVA vary between them)
CONVERT_TARGETS = ["cpu", "sim-eager-pin-uva", "sim-lazy-pin-nouva", "sim-random-nopin-nouva"]


@pytest.fixture(params=CONVERT_TARGETS)
def conv_target(request):
    from helpers import make_target

    with make_target(request.param) as t:
        yield t


@pytest.mark.parametrize("case,entry", CONVERT_ROWS)
def test_conversion_case_on_every_entry_point(conv_target, case, entry):
    data, dtype, expected = CASES[case]
    n = len(data)
    call = CONVERT_ENTRY_POINTS[entry]
    # Warnings recorded, not raised: a ComplexWarning raised as an error inside struct.pack
    # becomes a struct.error there, which would hide a pack that drops imaginary parts.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if expected[0] == "ok":
            _, result_dtype, values = expected
            out = call(data, dtype or result_dtype if entry.endswith("(out=)") else dtype,
                       conv_target.device, n)
            conv_target.sync()
            assert out.dtype == result_dtype
            assert out.cpu().tolist() == values
        else:
            exc, message = expected
            out_dtype = dtype or torch.int64  # out= of what torch.tensor would infer
            with pytest.raises(exc, match=message) as info:
                call(data, out_dtype if entry.endswith("(out=)") else dtype,
                     conv_target.device, n)
            assert type(info.value) is exc, (type(info.value), info.value)
    assert not [str(w.message) for w in caught]  # no ComplexWarning (nor any other) on the way


def test_every_case_has_rows_on_the_entry_points_it_applies_to():
    """The table is not silently thin: each case runs on the copies, and each case with a
    staged dtype on the staged writes too."""
    for case, (data, dtype, _) in CASES.items():
        entries = {e for c, e in (p.values for p in CONVERT_ROWS) if c == case}
        if not isinstance(data, np.ndarray) or dtype is not None:
            assert {"async_tensor_h2d", "h2d_many"} <= entries, case
        if dtype in SUPPORTED_DTYPES:
            assert {"stage_write", "FusedStagedWriter"} <= entries, case
    assert sum(1 for c, e in (p.values for p in CONVERT_ROWS) if e == "np_to_pinned_tensor")


def test_not_a_number_error_lives_in_errors():
    from pinstage import _convert, _errors

    assert _convert.NotANumberError is _errors.NotANumberError
    assert _errors.NotANumberError.__bases__ == (_errors.PinstageError, TypeError, ValueError)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_cached_packs_of_a_table_still_refuse_complex(target, dtype):
    """Once a table has cached packs for a length (the batch fast path of apply_write), a NumPy
    complex scalar in a later write of that length is still refused, naming it, and nothing of
    the batch is written."""
    swt = pinstage.StagedWriteTensor((3, 2), dtype, target.device)
    swt.stage_write(0, 0, [1.0, 2.0])
    swt.apply_write()  # caches the pack for 2 values
    swt.stage_write(1, 0, [3.0, 4.0])
    swt.stage_write(2, 0, [5.0, np.complex64(1j)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match=r"row 2, columns 0\.\.2 .* 1j at \[1\].*imaginary"):
            swt.apply_write()
    assert not [str(w.message) for w in caught]
    assert swt.num_staged == 4
    target.sync()
    assert swt.gpu.cpu().tolist() == [[1.0, 2.0], [0.0, 0.0], [0.0, 0.0]]
    swt.clear_staged_writes()
    swt.stage_write(2, 0, [5.0, np.complex64(6 + 0j)])  # a zero imaginary part converts
    swt.apply_write()
    target.sync()
    assert swt.gpu.cpu().tolist() == [[1.0, 2.0], [0.0, 0.0], [5.0, 6.0]]


Y = 1 + 2**-11 + 2**-40  # float64 -> float16 rounds to 1.0009765625 once, to 1.0 via float32


@pytest.mark.parametrize("data", [[Y], [[Y]], np.array([Y]), torch.tensor([Y], dtype=torch.float64),
                                  [np.float64(Y)], [Y, 2.0]])
def test_float16_rounds_as_torch_does(target, data):
    """torch casts float64 to float16 through float32 (torch.tensor([Y], dtype=torch.float16) is
    1.0): every path rounds the same way, the struct fast path included."""
    assert torch.tensor([Y], dtype=torch.float16).item() == 1.0  # the reference, and not
    assert np.float16(Y) != 1.0  # NumPy's (or struct 'e''s) single rounding
    out = pinstage.async_tensor_h2d(data, target.device, dtype=torch.float16)
    target.sync()
    assert out.cpu().reshape(-1)[0].item() == 1.0
    if isinstance(data, list) and not isinstance(data[0], list):
        swt = pinstage.StagedWriteTensor((2, len(data)), torch.float16, target.device)
        for row in (0, 1):  # the second apply uses the table's cached packs
            swt.stage_write(row, 0, data)
            swt.apply_write()
        target.sync()
        assert swt.gpu[:, 0].cpu().tolist() == [1.0, 1.0]


@pytest.mark.parametrize("data", [[65519.999999999], [[65519.999999999]],
                                  np.array([65519.999999999])])
def test_float16_overflow_is_checked_after_torchs_rounding(target, data):
    """65519.999999999 is below float16's rounding limit (65520) but rounds to it in float32,
    so torch's cast makes it infinity: refused, naming it."""
    with pytest.raises(pinstage.ValueOverflowError, match=r"65519\.999999999.*infinity"):
        pinstage.async_tensor_h2d(data, target.device, dtype=torch.float16)
    swt = pinstage.StagedWriteTensor((2, 1), torch.float16, target.device)
    for row in (0, 1):  # fresh, then with the table's cached packs
        swt.stage_write(row, 0, [1.0] if row == 0 else [65519.999999999])
        if row == 0:
            swt.apply_write()
    with pytest.raises(pinstage.ValueOverflowError, match=r"65519\.999999999"):
        swt.apply_write()


def test_ints_go_to_floats_through_float64_as_torch_tensor_does(target):
    """A list's ints are read as torch.tensor reads them (nearest float64, then the cast), on
    the fast path and the nested one alike; an int64 array converts directly, as
    torch.from_numpy(a).to() does."""
    v = 2**62 + 2**38 + 1
    via_f64 = torch.tensor([v], dtype=torch.float32).item()
    direct = torch.tensor([v]).to(torch.float32).item()
    assert via_f64 != direct  # the two roundings differ for this value
    for data, expected in (([v], via_f64), ([[v]], via_f64), (np.array([v]), direct)):
        out = pinstage.async_tensor_h2d(data, target.device, dtype=torch.float32)
        target.sync()
        assert out.cpu().reshape(-1)[0].item() == expected, data


@pytest.mark.parametrize("values", [b"12", bytearray(b"12"), "12", memoryview(b"12")])
def test_stage_write_refuses_bytes_and_strings(target, values):
    swt = pinstage.StagedWriteTensor(4, torch.int32, target.device)
    with pytest.raises(NotANumberError, match="not read as numbers"):
        swt.stage_write(0, 0, values)
    with pytest.raises(NotANumberError, match="not a number"):
        swt.stage_write_elem(0, values)
    with pytest.raises(NotANumberError, match="not a number"):
        pinstage.async_tensor_h2d(values, target.device, dtype=torch.int32)
    assert swt.num_staged == 0


def test_complex_overflow_is_checked_per_component():
    """A component that becomes infinity is refused even when the other one is NaN."""
    big = complex(3.4028235677973366e38, float("nan"))
    with pytest.raises(pinstage.ValueOverflowError, match="infinity"):
        pinstage.async_tensor_h2d([big], "cpu", dtype=torch.complex64)
    with pytest.raises(pinstage.ValueOverflowError, match="infinity"):
        pinstage.async_tensor_h2d(np.array([big]), "cpu", dtype=torch.complex64)
    with pytest.raises(pinstage.ValueOverflowError, match=r"13582985290493858492\d+"):
        pinstage.async_tensor_h2d([2**1100, 1j], "cpu")
