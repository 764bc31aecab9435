"""The conversion rule against an independent reference, on random lists (hypothesis).

The reference is Python's exact arithmetic plus torch's own cast: a value is accepted iff it
is a number that the dtype holds (for integer and bool dtypes: integral, finite and in range;
for real dtypes: a zero imaginary part; for floating dtypes: it does not become infinity), and
an accepted floating value is ``torch.tensor(float(v), dtype=torch.float64).to(dtype)`` (what
``torch.tensor(list, dtype=dtype)`` writes). Every entry point must agree with it: the list
fast path (flat lists), the general path (the same values nested one level deeper), the
packing of a staged write (fresh and with the table's cached packs), and one input of
``h2d_many``.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pinstage
from pinstage._convert import values_bytes
from pinstage._staged import SUPPORTED_DTYPES

DTYPES = [torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
          torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.complex64, torch.complex128]

_BIG = [2**k + d for k in (7, 8, 15, 16, 24, 31, 32, 53, 54, 63, 64, 100, 128, 1100)
        for d in (-1, 0, 1)]
ints = st.one_of(st.integers(-300, 300), st.sampled_from(_BIG + [-v for v in _BIG]),
                 st.integers(-2**70, 2**70))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0.5, -0.0, 65504.0, 65519.99, 65520.0, 3.3961775e38,
                                    3.4028235e38, 3.5e38, 2.0**63, 2.0**64, 1 + 2**-11 + 2**-40,
                                    1 + 2**-8 + 2**-30, 255.0, 256.0, 1e300]),
                   st.integers(-2**20, 2**20).map(float))
complexes = st.builds(complex, st.one_of(floats, st.sampled_from([1.0, 2.0])),
                      st.sampled_from([0.0, 0.0, 1.0, -2.5, float("nan")]))
_NP_INT = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]


def _as(t):
    """``t(value)``, beyond ``t``'s range an infinity (NumPy's cast, without its warning)."""
    def make(value):
        with np.errstate(over="ignore"):
            return np.array(value).astype(t)[()]
    return make


np_scalars = st.one_of(
    st.sampled_from(_NP_INT).flatmap(
        lambda t: st.integers(int(np.iinfo(t).min), int(np.iinfo(t).max)).map(t)),
    st.sampled_from([np.float16, np.float32, np.float64]).flatmap(lambda t: floats.map(_as(t))),
    st.sampled_from([np.complex64, np.complex128]).flatmap(lambda t: complexes.map(_as(t))),
    st.booleans().map(np.bool_),
)
elements = st.one_of(ints, floats, complexes, st.booleans(), np_scalars)
lists = st.lists(elements, min_size=1, max_size=6)


def _exact(v):
    """The value ``v`` stands for: a Python int, float or complex (exact)."""
    if isinstance(v, (bool, np.bool_)):
        return int(bool(v))
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (complex, np.complexfloating)):
        return complex(v)
    return float(v)


class Refused(Exception):
    pass


def reference(values, dtype):
    """What the rule writes for ``values`` into ``dtype`` (Python numbers, exact), or raises
    ``Refused``."""
    out = []
    for v in map(_exact, values):
        if isinstance(v, complex) and not dtype.is_complex:
            if v.imag != 0 or math.isnan(v.imag):
                raise Refused(v)
            v = v.real
        if dtype.is_complex:
            try:
                c = complex(v)
            except OverflowError:
                raise Refused(v) from None
            ref = torch.tensor(c, dtype=torch.complex128).to(dtype).item()
            for part, whole in ((ref.real, c.real), (ref.imag, c.imag)):
                if math.isinf(part) and math.isfinite(whole):
                    raise Refused(v)
            out.append(ref)
        elif dtype.is_floating_point:
            try:
                f = float(v)
            except OverflowError:
                raise Refused(v) from None
            ref = torch.tensor(f, dtype=torch.float64).to(dtype).item()
            if math.isinf(ref) and math.isfinite(f):
                raise Refused(v)
            out.append(ref)
        else:
            lo, hi = (0, 1) if dtype == torch.bool else (int(torch.iinfo(dtype).min),
                                                          int(torch.iinfo(dtype).max))
            if isinstance(v, float):
                if not math.isfinite(v) or v != math.floor(v):
                    raise Refused(v)
                v = int(v)
            if not lo <= v <= hi:
                raise Refused(v)
            out.append(bool(v) if dtype == torch.bool else v)
    return out


def _same(actual, expected):
    assert len(actual) == len(expected), (actual, expected)
    for a, e in zip(actual, expected):
        if isinstance(e, complex):
            a = complex(a)
            ok = all(x == y or (math.isnan(x) and math.isnan(y))
                     for x, y in ((a.real, e.real), (a.imag, e.imag)))
        elif isinstance(e, float):
            ok = a == e or (math.isnan(a) and math.isnan(e))
            ok = ok and math.copysign(1, a) == math.copysign(1, e) if a == 0 == e else ok
        else:
            ok = a == e and type(a) is type(e)
        assert ok, (actual, expected)


def _from_bytes(data, dtype):
    return torch.frombuffer(bytearray(data), dtype=dtype).tolist() if data else []


def _check(call, values, dtype):
    try:
        expected = reference(values, dtype)
    except Refused:
        with pytest.raises(ValueError):  # every refusal is a ValueError (and names the value)
            call()
        return
    _same(call(), expected)


def _no_warnings(caught, values):
    """No ComplexWarning, nor any other, on the way. One known exception: the float screen
    sums the list in C (see _convert), and once that sum meets a NumPy float16/float32/complex64
    scalar NumPy adds the rest, casting a later Python number beyond that scalar's range with
    an overflow warning (the result is still right)."""
    small = (np.float16, np.float32, np.complex64)
    allowed = ("overflow encountered in cast",) if any(isinstance(v, small) for v in values) \
        else ()
    assert not [str(w.message) for w in caught
                if not (issubclass(w.category, RuntimeWarning) and str(w.message) in allowed)]


SETTINGS = settings(max_examples=400, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(values=lists, dtype=st.sampled_from(DTYPES))
def test_copies_match_the_reference(values, dtype):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # recorded: raised, struct.pack would hide them
        _check(lambda: pinstage.async_tensor_h2d(values, "cpu", dtype=dtype).tolist(),
               values, dtype)
        _check(lambda: pinstage.async_tensor_h2d([values], "cpu", dtype=dtype)[0].tolist(),
               values, dtype)  # nested: the general (NumPy) path
        _check(lambda: pinstage.h2d_many([[1], tuple(values)], "cpu", dtype=dtype)[1].tolist(),
               values, dtype)
        _check(lambda: _from_bytes(values_bytes(values, dtype)[0], dtype), values, dtype)
    _no_warnings(caught, values)


@SETTINGS
@given(values=lists, dtype=st.sampled_from(list(SUPPORTED_DTYPES)))
def test_staged_writes_match_the_reference(values, dtype):
    n = len(values)
    swt = pinstage.StagedWriteTensor((2, n), dtype, "cpu")
    warm = [1] * n
    swt.stage_write(1, 0, warm)
    swt.apply_write()  # the table's packs for this length are cached now: the batch path

    def staged():
        swt.stage_write(0, 0, values)
        swt.stage_write(1, 0, warm)
        try:
            swt.apply_write()
        except ValueError:
            assert swt.num_staged == 2 * n  # refused before writing: everything stays staged
            swt.clear_staged_writes()
            raise
        return swt.gpu[0].tolist()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _check(staged, values, dtype)
    _no_warnings(caught, values)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=lists, dtype=st.sampled_from([torch.int32, torch.float16, torch.bfloat16,
                                            torch.float32, torch.uint64]))
def test_simulator_matches_the_reference(values, dtype):
    from pinstage.testing import simulated_accelerator

    with simulated_accelerator(mode="eager") as sim:
        def copy():
            out = pinstage.async_tensor_h2d(values, sim.device, dtype=dtype)
            pinstage.synchronize(sim.device)
            return out.cpu().tolist()
        _check(copy, values, dtype)


_PY = st.lists(st.one_of(ints, floats, complexes, st.booleans()), min_size=1, max_size=6)


@SETTINGS
@given(values=_PY)
def test_no_dtype_reads_lists_as_torch_tensor_does(values):
    """With no dtype, a list of Python numbers is read as torch.tensor reads it (complex >
    float > int > bool), then converted by the rule (ints outside int64 refused, as
    torch.tensor refuses them)."""
    if any(isinstance(v, complex) for v in values):
        dtype = torch.complex64
    elif any(isinstance(v, float) for v in values):
        dtype = torch.float32
    elif all(isinstance(v, bool) for v in values):
        dtype = torch.bool
    else:
        dtype = torch.int64

    def copy():
        out = pinstage.async_tensor_h2d(values, "cpu")
        assert out.dtype == dtype
        return out.tolist()

    _check(copy, values, dtype)
