"""The one conversion rule, used by every entry point (copies, ``h2d_many``, pools, staged
writes): values are converted to the target dtype only when they fit it.

Refused, never wrapped or truncated: a value outside the target's range
(:class:`ValueOverflowError`, also an ``OverflowError``), a non-integral or non-finite float
into an integer or bool dtype, a complex number with a non-zero imaginary part into a real dtype
(``ValueError`` naming it), and anything that is not a number (:class:`NotANumberError`, a
``ValueError`` and a ``TypeError``): ``None``, strings, and bytes-like objects (``b'1'``,
``bytearray``, ``memoryview``), which NumPy and ``torch.tensor`` would read as byte values
(``torch.tensor([b'1'], dtype=torch.int32)`` is ``[[49]]``). Sources already of the target
dtype, or of a dtype whose whole range fits it (``int32`` into ``int64``), are not scanned: the
hot path pays nothing.

Values are converted as torch converts them. A list is read as ``torch.tensor(list,
dtype=...)`` reads it: with no dtype, a list of ints is ``int64`` and one holding an int outside
``int64`` (``[0, 2**63]``) is refused, as ``torch.tensor`` refuses it (NumPy would silently make
it float64, or uint64); ints go to floating dtypes through float64, rounded to the nearest
float64, then as torch casts float64 (to float16 and bfloat16 through float32: torch rounds
twice there, and so does pinstage). Integers are always exact: a list mixing ints of 2**53 or
more with floats, negative ints or ``np.uint64`` values (which NumPy would read as float64,
rounding them) is read element by element. Arrays and tensors convert as
``torch.from_numpy(a).to(dtype)`` does. An array NumPy typed ``numpy.ulonglong`` (what
``np.array([2**63])`` infers, which ``torch.from_numpy`` refuses) is read as the
``numpy.uint64`` it equals: ``torch.uint64`` with no dtype.

The list fast path (:func:`fast_pack`): one cached ``struct`` packs a flat list in C, with no
Python loop over its elements, when the dtype has a struct code (not bool, bfloat16, complex).
Which inputs a struct code takes decides what the fast path must check:

- integer codes (``b B h H i I q Q``) take only objects with ``__index__`` (int, bool,
  ``np.integer``, 0-d integer arrays and tensors) and range-check them; floats, complex
  numbers (``np.complex64.__index__`` raises ``TypeError``), strings, bytes and ``None`` make
  the pack raise. Nothing is checked beyond the pack: the engine's int hot path costs one pack,
  as before.
- float codes (``f d``) take anything with ``__float__``, and ``np.complex64`` /
  ``np.complex128`` scalars have one that drops the imaginary part with only a
  ``ComplexWarning``. So a float list is screened before it is packed, by
  ``type(sum(values, nan)) is float``: CPython sums a list of floats and ints in C. Measured
  with ``timeit`` on the 2-core CI machine, for 16 values: the sum about 115 ns, against about
  490 ns for ``frozenset.issuperset(map(type, values))``, 2-5 us for turning the warning into an
  error with ``warnings.catch_warnings`` (which ``struct`` would turn into a ``struct.error``
  anyway), about 4 us for ``np.errstate``; the pack itself is about 220 ns. Any other element
  type (a NumPy scalar, a 0-d tensor, a Python complex) makes the sum's type differ, and a
  Python loop then accepts the list only if every element is a real number (a list starting
  with a NumPy scalar, ``list(arr)``, goes to that loop at once); else the list takes the
  general path, which applies the rule and says what is wrong. The sum starts at NaN so it
  carries no magnitude into NumPy's scalar arithmetic; the one warning left: a Python number
  beyond the range of a NumPy float16/float32/complex64 scalar that comes before it in the
  list is cast by NumPy with an overflow ``RuntimeWarning`` (the result is still right).
- float16 packs as float32, then the float32 values as float16 (``e``), so it rounds as torch
  does (float64 -> float32 -> float16); ``e`` alone would round once, which differs for about
  one float64 in 16,000.

:func:`pack_batch` is the same fast path for one table's staged writes (``StagedWriteTensor.
_values``): the table's cached packs by length, one screen for the whole batch of a floating
table (about 10 ns a value), float16 converted once for the batch. Measured in one process,
alternating with the code before (best of 60 rounds, 64 writes of 16 values): packing int32
14.1 us before and after, float32 24 -> 45 us (the screen), float16 19 -> 41 us (the second
rounding); ``stage_write`` x 64 + ``apply_write`` on the CPU target int32/int64 within +-5%
(the machine's noise), float32 +17%, float16 +35%.

A list the fast path does not take goes through NumPy (:func:`list_values`), then the array
rule (:func:`check_fits`). :func:`pack_list` is both, for flat lists (staged writes, pools);
:class:`HostSource` normalises one input of a copy; :func:`values_bytes` encodes the values of
one staged write; :func:`number_bytes` one number (``stage_write_elem``).
"""

from __future__ import annotations

import array
import math
import numbers
import operator
import struct
from collections.abc import Iterable, Sequence
from functools import lru_cache
from itertools import chain
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._dtypes import STRUCT_CODES, check_dtype, itemsize, numpy_to_torch, packer, torch_to_numpy
from ._errors import NotANumberError, ValueOverflowError, describe

if TYPE_CHECKING:
    from ._device import Backend

__all__ = ["HostSource", "NotANumberError", "PACK_MISS", "array_tensor", "check_fits",
           "fast_pack", "list_values", "number_bytes", "pack_batch", "pack_list", "plain_floats",
           "values_bytes", "NATIVE_DTYPES"]

_NUMERIC_KINDS = "biufc"
NATIVE_DTYPES = frozenset(np.dtype(t) for t in (np.bool_, np.int8, np.uint8, np.int16, np.int32,
                                          np.int64, np.float16, np.float32, np.float64,
                                          np.complex64, np.complex128))
# What a cached pack raises for values it cannot take (a ValueError from an element's own
# __index__ too): the list then takes the general path, which converts it by the rule or says
# what is wrong. The one set every list-packing caller catches.
PACK_MISS = (struct.error, OverflowError, TypeError, ValueError)

# Not numbers, though NumPy and torch.tensor read bytes-like ones as rows of byte values.
_TEXT = (str, bytes, bytearray, memoryview)
_EXACT_INT = float(2**53)  # from it on, a float64 NumPy made from ints may have rounded them

# dtype -> (struct code, screen): screen 0: an integer code (exact, nothing to check);
# 1: a float code (screened for NumPy complex scalars); 2: float16 (as float32, then float16)
_PLANS: dict[torch.dtype, tuple[str, int]] = {}
for _dt, _code in STRUCT_CODES.items():
    if _dt == torch.bool:
        continue  # '?' takes anything with a truth value
    if _dt.is_floating_point:
        _PLANS[_dt] = ("f", 2) if _dt == torch.float16 else (_code, 1)
    else:
        _PLANS[_dt] = (_code, 0)

# NumPy types equal to a type torch knows, that torch.from_numpy refuses (numpy.ulonglong,
# the type np.array([2**63]) infers, where numpy.uint64 is numpy.ulong)
_CANONICAL: dict[type, np.dtype] = {}
for _t, _u in ((np.ulonglong, np.uint64), (np.longlong, np.int64), (np.uintc, np.uint32),
               (np.intc, np.int32)):
    if _t is not _u and np.dtype(_t) == np.dtype(_u):
        _CANONICAL[_t] = np.dtype(_u)


def _canonical(arr: np.ndarray) -> np.ndarray:
    """``arr`` (native byte order) viewed with the NumPy type torch takes for its dtype."""
    canon = _CANONICAL.get(arr.dtype.type)
    return arr if canon is None else arr.view(canon)


# -- the rule ---------------------------------------------------------------------------------
@lru_cache(maxsize=256)
def _int_bounds(dtype: torch.dtype) -> tuple[int, int] | None:
    """The range of an integer (or bool) dtype; ``None`` for floating and complex ones."""
    if dtype == torch.bool:
        return 0, 1
    if dtype.is_floating_point or dtype.is_complex:
        return None
    info = torch.iinfo(dtype)
    return int(info.min), int(info.max)


@lru_cache(maxsize=256)
def _float_limit(dtype: torch.dtype) -> float:
    """The smallest magnitude that rounds to infinity in ``dtype`` (its components for complex
    dtypes): ``max + ulp(max) / 2`` (65520 for float16). ``inf`` for float64."""
    if dtype.is_complex:
        dtype = torch.float32 if dtype == torch.complex64 else torch.float64
    if dtype == torch.float64:
        return math.inf
    info = torch.finfo(dtype)
    return float(info.max) + float(info.eps) * 2.0 ** math.floor(math.log2(info.max)) / 2


def _magnitude(dtype: torch.dtype) -> float:
    """The largest magnitude a value (or complex component) of ``dtype`` can have."""
    if dtype == torch.bool:
        return 1.0
    if dtype.is_complex:
        dtype = torch.float32 if dtype == torch.complex64 else torch.float64
    if dtype.is_floating_point:
        return float(torch.finfo(dtype).max)
    info = torch.iinfo(dtype)
    return float(max(-int(info.min), int(info.max)))


@lru_cache(maxsize=256)
def fits_without_scan(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether every value of ``src`` fits ``dst`` (same dtype, bool, or a contained range),
    so no value needs checking."""
    if src == dst or src == torch.bool:
        return True
    if src.is_complex and not dst.is_complex:
        return False
    bounds = _int_bounds(dst)
    if bounds is not None:
        sb = _int_bounds(src)
        return sb is not None and bounds[0] <= sb[0] and sb[1] <= bounds[1]
    return _magnitude(src) < _float_limit(dst)  # (float64's limit is inf: everything fits it)


def _where(mask: np.ndarray) -> str:
    """`` at [i, j]`` for the first true element of ``mask`` (for messages)."""
    flat = int(np.argmax(mask.reshape(-1)))
    pos = np.unravel_index(flat, mask.shape) if mask.ndim else ()
    return f" at {list(int(p) for p in pos)}" if pos else ""


def _through_float32(arr: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """The values torch converts to ``dtype``: float64 (and wider) into float16 or bfloat16 goes
    through float32 in torch's casts, so it is rounded to float32 first here too."""
    if (dtype == torch.float16 or dtype == torch.bfloat16) and arr.dtype.kind == "f" \
            and arr.dtype.itemsize > 4:
        with np.errstate(over="ignore"):  # beyond float32: inf, refused below (finite before)
            return arr.astype(np.float32)
    return arr


def _magnitudes(part: np.ndarray) -> np.ndarray:
    """``|part|`` (a real array), without wrapping (``abs`` of int64's minimum)."""
    return np.abs(part if part.dtype.kind == "f" else part.astype(np.float64))


def check_fits(arr: np.ndarray, dtype: torch.dtype, what: str = "data") -> np.ndarray:
    """Refuse any value of the numeric array ``arr`` that ``dtype`` cannot hold; returns the
    values to convert (the real part of complex values whose imaginary parts are all zero;
    float64 values bound for float16 or bfloat16 rounded to float32, as torch does)."""
    if arr.size == 0:
        return arr
    src = numpy_to_torch(arr.dtype)
    if src is not None and fits_without_scan(src, dtype):
        return arr
    kind = arr.dtype.kind
    if kind == "c" and not dtype.is_complex:
        bad = arr.imag != 0
        if bad.any():
            value = arr[bad].reshape(-1)[0]
            raise ValueError(f"{what} holds {value}{_where(bad)}, a complex number with a "
                             f"non-zero imaginary part; {dtype} holds real numbers only")
        arr = arr.real
        kind = "f"
    bounds = _int_bounds(dtype)
    if bounds is not None:
        lo_b, hi_b = bounds
        rng = f"{lo_b}..{hi_b}" if dtype != torch.bool else "0 or 1"
        if kind == "f":
            finite = np.isfinite(arr)
            if not finite.all():
                value = arr[~finite].reshape(-1)[0]
                raise ValueError(f"{what} holds {value}{_where(~finite)}, which is not a finite "
                                 f"number; {dtype} holds integers only")
            frac = arr != np.trunc(arr)
            if frac.any():
                value = arr[frac].reshape(-1)[0]
                raise ValueError(f"{what} holds {value}{_where(frac)}, which is not a whole "
                                 f"number; {dtype} holds integers only (round it first)")
            # float(hi_b) + 1 is exact: a power of two (2**31, 2**63, ...); compared in
            # float64 (NumPy would cast the bound to float16 or float32: inf, with a warning)
            wide = arr if arr.dtype.itemsize >= 8 else arr.astype(np.float64)
            out = (wide < float(lo_b)) | (wide >= float(hi_b) + 1)
        else:
            lo, hi = int(arr.min()), int(arr.max())
            if lo_b <= lo and hi <= hi_b:
                return arr
            out = (arr < lo_b) | (arr > hi_b)
        if out.any():
            value = arr[out].reshape(-1)[0]
            raise ValueOverflowError(f"{what} holds {value}{_where(out)}, which does not fit "
                                     f"{dtype} ({rng})")
        return arr
    limit = _float_limit(dtype)
    if limit == math.inf:
        return arr
    conv = _through_float32(arr, dtype)
    # each component on its own (a complex value overflows if either part does)
    parts = ((conv.real, arr.real), (conv.imag, arr.imag)) if kind == "c" else ((conv, arr),)
    # (Python floats: NumPy would cast limit to float32, to inf; NaN takes the slow path)
    if all(float(_magnitudes(c).max()) < limit for c, _ in parts):
        return conv
    out = np.zeros(arr.shape, dtype=bool)
    for c, orig in parts:
        out |= (_magnitudes(c).astype(np.float64) >= limit) & np.isfinite(orig)
    if out.any():
        value = arr[out].reshape(-1)[0]
        finfo = torch.finfo(torch.float32 if dtype == torch.complex64 else dtype)
        raise ValueOverflowError(f"{what} holds {value}{_where(out)}, which is outside "
                                 f"{dtype}'s range (+-{float(finfo.max):.6g}); it would become "
                                 "infinity")
    return conv


def check_tensor_fits(t: torch.Tensor, dtype: torch.dtype, what: str = "data") -> torch.Tensor:
    """:func:`check_fits` for a CPU tensor; returns the tensor to convert (real part of a
    complex tensor with zero imaginary parts)."""
    if t.numel() == 0 or fits_without_scan(t.dtype, dtype):
        return t
    t = t.detach().resolve_conj().resolve_neg()
    if torch_to_numpy(t.dtype) is None:  # bfloat16 and friends: exact in float32
        arr = t.to(torch.complex64 if t.is_complex() else torch.float32).numpy()
    else:
        arr = t.numpy()
    check_fits(arr, dtype, what)
    if t.is_complex() and not dtype.is_complex:
        return t.real
    return t


# -- the list fast path -----------------------------------------------------------------------
_REAL_SCALARS = (int, float, np.integer, np.floating, np.bool_)


def _real_scalars(values: Sequence[Any]) -> bool:
    """Whether every element is a real number a float code packs as is (the Python loop of the
    float screen, only for lists holding NumPy scalars, 0-d arrays or tensors)."""
    for v in values:
        if isinstance(v, _REAL_SCALARS):
            if isinstance(v, np.timedelta64):
                return False
            continue
        if isinstance(v, np.ndarray):
            if v.ndim or v.dtype.kind not in "biuf":
                return False
        elif isinstance(v, torch.Tensor):
            if v.dim() or v.is_complex():
                return False
        elif not isinstance(v, numbers.Real):
            return False
    return True


def plain_floats(values: Iterable[Any]) -> bool:
    """The float screen: whether ``values`` are Python floats, ints and bools only (then a
    float code packs them as the rule converts them). One ``sum`` in C; ``False`` for anything
    else (a NumPy scalar, a 0-d tensor, a value whose own ``__add__`` fails), which then needs
    a closer look. The sum starts at NaN so that it carries no magnitude: once it meets a
    NumPy scalar it is NumPy's NaN, which adds without overflow warnings."""
    try:
        return type(sum(values, math.nan)) is float
    except Exception:
        return False


def fast_pack(values: Sequence[Any], dtype: torch.dtype,
              packers: dict[int, struct.Struct] | None = None) -> bytes | None:
    """A flat list's values as bytes of ``dtype`` by one cached ``struct`` (in C, no Python
    loop over the elements), or ``None`` when the list must take the general path (a value the
    pack refuses, a NumPy complex scalar, a dtype without a struct code). ``packers``: a
    caller's cache of the packs by length, for :func:`pack_batch` (a float one is used there
    only after the float screen)."""
    plan = _PLANS.get(dtype)
    if plan is None:
        return None
    code, screen = plan
    n = len(values)
    pk = packer(code, n)
    if not screen:
        try:
            data = pk.pack(*values)
        except PACK_MISS:
            return None
        if packers is not None and len(packers) < 256:
            packers[n] = pk
        return data
    # screened before packing, so a NumPy complex scalar never reaches the pack (whose
    # ComplexWarning would reach the caller). A list starting with a NumPy scalar (list(arr))
    # is looked at in Python at once: summing NumPy scalars could warn of an overflow.
    t0 = type(values[0])
    if not ((t0 is float or t0 is int) and plain_floats(values)) \
            and not _real_scalars(values):
        return None
    try:
        data = pk.pack(*values)
    except PACK_MISS:
        return None
    if packers is not None and len(packers) < 256:
        packers[n] = pk  # (float16's: the float32 pack, as pack_batch uses it)
    if screen == 1:
        return data
    try:  # float16 (screen 2), as torch rounds it: float64 -> float32 -> float16
        return packer("e", n).pack(*pk.unpack(data))
    except OverflowError:
        return None  # rounds to 65520 or more: refused by the general path


_BATCH_MISS = (KeyError, IndexError, *PACK_MISS)


def pack_batch(chunks: Sequence[Any], dtype: torch.dtype, packers: dict[int, struct.Struct],
               length: int = 0) -> bytes | bytearray | None:
    """The fast path of :func:`pack_list` for a batch (one table's staged writes): each chunk,
    a tuple of values or bytes already of ``dtype``, packed by the cached pack of its length
    in ``packers`` (filled by :func:`pack_list`; ``length``: the common length of all chunks,
    or 0), with one float screen for the whole batch. ``None`` when any chunk needs more: a
    length not cached yet, a value a pack refuses, anything but plain Python numbers for a
    floating dtype, a chunk that is not a tuple (a snapshot): the caller then packs each chunk
    with :func:`pack_list`, which converts or refuses it by the rule."""
    plan = _PLANS.get(dtype)
    if plan is None:
        return None
    screen = plan[1]
    try:
        if screen:  # the values of the tuples, all at once (bytes were checked when staged)
            tuples = chunks
            if bytes in map(type, chunks):
                if screen == 2:
                    return None  # float16 bytes can't join float32 packs: chunk by chunk
                tuples = [c for c in chunks if type(c) is not bytes]
            t0 = type(tuples[0][0]) if tuples else float
            if not (t0 is float or t0 is int) or not plain_floats(chain.from_iterable(tuples)):
                return None  # (NumPy scalars: chunk by chunk, as pack_list looks at them)
        if length:  # one pack for all (block-table appends)
            pack = packers[length].pack
            parts = [c if type(c) is bytes else pack(*c) for c in chunks]
        else:
            parts = [c if type(c) is bytes else packers[len(c)].pack(*c) for c in chunks]
    except _BATCH_MISS:
        return None
    data = bytearray().join(parts)
    if screen != 2:
        return data
    # float16: the float32 packs, then float32 -> float16 once for the batch (as torch rounds)
    f32 = np.frombuffer(data, np.float32)
    with np.errstate(over="ignore"):
        f16 = f32.astype(np.float16)
    if np.isinf(f16).any() and bool((np.isinf(f16) & np.isfinite(f32)).any()):
        return None  # rounds to 65520 or more: refused by pack_list, naming it
    return bytearray(f16.tobytes())  # (writable: torch.from_numpy takes it without a warning)


def pack_list(values: Sequence[Any], dtype: torch.dtype, what: str = "x",
              packers: dict[int, struct.Struct] | None = None) -> bytes:
    """A flat list's values as bytes of ``dtype`` by the rule (bfloat16 as its bits): the
    cached-struct fast path, else the general path, which converts what the pack cannot
    (``3.0`` into int32) or raises saying what is wrong."""
    if not values:
        return b""
    data = fast_pack(values, dtype, packers)
    if data is not None:
        return data
    arr = list_values(values, dtype, what)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a flat sequence of numbers, got shape "
                         f"{arr.shape} ({describe(values)})")
    return _array_bytes(arr, dtype, what)


# -- lists, the general path ------------------------------------------------------------------
def _not_a_number(value: Any, where: str, what: str) -> NotANumberError:
    kind = "None" if value is None else f"{describe(value)}"
    hint = (" (bytes and strings are not read as numbers: convert them first, e.g. "
            "int(b), float(s) or np.frombuffer(b, dtype))") if isinstance(value, _TEXT) else ""
    return NotANumberError(f"{what}{where} is {kind}, which is not a number{hint}")


def _pos(flat_index: int, shape: tuple[int, ...]) -> list[int]:
    return [int(p) for p in np.unravel_index(flat_index, shape)]


def _scalar(v: Any) -> Any:
    """An element as a Python number (NumPy scalars, 0-d arrays and CPU tensors unwrapped;
    a ``Fraction`` kept exact), or ``None`` for what is not a number."""
    if isinstance(v, (np.ndarray, torch.Tensor)):
        if v.ndim or (v.device.type != "cpu" if isinstance(v, torch.Tensor)
                      else v.dtype.kind not in _NUMERIC_KINDS):
            return None
        v = v.item()
    elif isinstance(v, np.generic):
        if not isinstance(v, (np.number, np.bool_)) or isinstance(v, np.timedelta64):
            return None
        v = v.item()
    if isinstance(v, (int, float, complex)):  # (bool is an int)
        return v
    if isinstance(v, numbers.Integral) or (not isinstance(v, numbers.Number)
                                           and hasattr(type(v), "__index__")):
        return operator.index(v)  # what an integer struct code takes, the same here
    if isinstance(v, numbers.Rational):
        return v
    if isinstance(v, numbers.Real):  # np.longdouble
        return float(v)
    if isinstance(v, numbers.Complex):
        return complex(v)
    return None


def _numbers_from_objects(arr: np.ndarray, dtype: torch.dtype | None, what: str) -> np.ndarray:
    """A numeric array from an object array (NumPy makes one for ``None``, strings mixed with
    numbers, integers beyond 64 bits; :func:`list_values` makes one where NumPy would round
    integers): says which element is wrong, else converts the numbers by the rule, exactly.
    Rare inputs only, so a Python loop is fine here."""
    flat = arr.reshape(-1)
    values = []
    for i, v in enumerate(flat.tolist()):
        s = _scalar(v)
        if s is None:
            raise _not_a_number(v, str(_pos(i, arr.shape)), what)
        values.append(s)
    has_complex = any(isinstance(v, complex) for v in values)
    has_float = has_complex or any(not isinstance(v, int) for v in values)
    target = dtype if dtype is not None else (
        (torch.complex64 if torch.get_default_dtype() == torch.float32 else torch.complex128)
        if has_complex else torch.get_default_dtype() if has_float else torch.int64)
    if target.is_complex:
        cplx = np.empty(len(values), dtype=np.complex128)
        for i, v in enumerate(values):
            try:
                cplx[i] = complex(v)
            except OverflowError:
                raise ValueOverflowError(f"{what} holds {v} at {_pos(i, arr.shape)}, which is "
                                         f"outside {target}'s range; it would become "
                                         "infinity") from None
        return cplx.reshape(arr.shape)
    if has_complex:
        for i, v in enumerate(values):
            if isinstance(v, complex):
                if v.imag != 0:
                    raise ValueError(f"{what} holds {v} at {_pos(i, arr.shape)}, a complex "
                                     "number with a non-zero imaginary part; "
                                     f"{target} holds real numbers only")
                values[i] = v.real
    bounds = _int_bounds(target)
    if bounds is None:  # floating: each value to the nearest float64 (as torch.tensor reads)
        limit = _float_limit(target)
        out = np.empty(len(values), dtype=np.float64)
        for i, v in enumerate(values):
            try:
                out[i] = float(v)
            except OverflowError:
                raise ValueOverflowError(f"{what} holds {v} at {_pos(i, arr.shape)}, which is "
                                         f"outside {target}'s range; it would become "
                                         "infinity") from None
        conv = _through_float32(out, target)
        parts = np.abs(conv).astype(np.float64)
        if limit != math.inf and not float(parts.max()) < limit:
            bad = (parts >= limit) & np.isfinite(out)
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueOverflowError(f"{what} holds {values[i]} at {_pos(i, arr.shape)}, "
                                         f"which is outside {target}'s range; it would become "
                                         "infinity")
        return out.reshape(arr.shape)
    lo_b, hi_b = bounds
    rng = f"{lo_b}..{hi_b}" if target != torch.bool else "0 or 1"
    ints = []
    for i, v in enumerate(values):
        shown = v
        if not isinstance(v, int):
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"{what} holds {v} at {_pos(i, arr.shape)}, which is not a "
                                 f"finite number; {target} holds integers only")
            if v != math.floor(v):
                raise ValueError(f"{what} holds {v} at {_pos(i, arr.shape)}, which is not a "
                                 f"whole number; {target} holds integers only (round it "
                                 "first)")
            v = int(v)
        if not lo_b <= v <= hi_b:
            hint = ("; a list of ints is read as torch.int64, as torch.tensor reads it (which "
                    "refuses it too): pass dtype= to convert it to another dtype"
                    ) if dtype is None else ""
            raise ValueOverflowError(f"{what} holds {shown} at {_pos(i, arr.shape)}, which "
                                     f"does not fit {target} ({rng}){hint}")
        ints.append(v)
    npdt = torch_to_numpy(target) or np.int64
    return np.array(ints, dtype=npdt).reshape(arr.shape)


def _depth(seq: Sequence[Any], what: str) -> int:
    """How many list/tuple levels ``seq`` nests; refuses a bytes-like or string element at
    any level above the numbers (NumPy reads a ``bytearray`` as a row of byte values). The
    numbers themselves are not looked at: the caller compares NumPy's ndim with this."""
    if not seq:
        return 1
    first = seq[0]
    if not isinstance(first, (list, tuple)):
        return 1
    deepest = 0
    for v in seq:
        if isinstance(v, (list, tuple)):
            deepest = max(deepest, _depth(v, what))
        elif isinstance(v, _TEXT):
            _refuse_text(seq, what)
    return 1 + deepest


def _refuse_text(seq: Sequence[Any], what: str, where: tuple[int, ...] = ()) -> None:
    """Raise NotANumberError for the first string or bytes-like element anywhere in ``seq``."""
    for i, v in enumerate(seq):
        if isinstance(v, _TEXT):
            raise _not_a_number(v, str(list(where + (i,))), what)
        if isinstance(v, (list, tuple)):
            _refuse_text(v, what, where + (i,))


def _object_array(data: Sequence[Any]) -> np.ndarray:
    """``data``'s elements as they are (Python ints stay exact) in an object array."""
    return np.array(data, dtype=object)


def list_values(data: Sequence[Any], dtype: torch.dtype | None, what: str) -> np.ndarray:
    """``data`` (a list or tuple, nested or not) as a numeric NumPy array read as
    ``torch.tensor`` reads it; says what is wrong when it is not one (ragged, not numbers).
    With a floating ``dtype``, integers come as float64 (rounded once, as torch.tensor does)."""
    depth = _depth(data, what)
    try:
        arr = np.asarray(data)
    except (ValueError, TypeError, OverflowError) as exc:
        _refuse_text(data, what)
        raise ValueError(f"{what} is not a rectangular list of numbers "
                         f"({describe(data)}): {exc}") from None
    kind = arr.dtype.kind
    if kind == "O":
        return _numbers_from_objects(arr, dtype, what)
    if kind not in _NUMERIC_KINDS:
        _refuse_text(data, what)
        first = arr.reshape(-1)[0].item() if arr.size else None
        raise NotANumberError(f"{what} must hold numbers only; it holds {first!r} "
                              f"({describe(data)}, which NumPy reads as {arr.dtype})")
    if arr.ndim > depth:  # an element read as a row: a bytes-like one is not a number
        _refuse_text(data, what)
    floating = dtype is not None and (dtype.is_floating_point or dtype.is_complex)
    if kind in "fc" and not floating and arr.size and not (
            float(np.abs(arr).max()) < _EXACT_INT):  # (NaN too: it is no int either)
        # NumPy makes float64 of ints mixed with floats, of ints beyond int64 with negative
        # ones ([2**63, -1]), of np.uint64 values with Python ints, rounding those beyond
        # 2**53: read them one by one, exactly
        return _numbers_from_objects(_object_array(data), dtype, what)
    if dtype is not None and floating and kind in "iu" and arr.size and (int(arr.max()) > 2**53
                                                   or int(arr.min()) < -2**53):
        check_fits(arr, dtype, what)  # refused naming the integer itself
        arr = arr.astype(np.float64)  # torch.tensor's route: nearest float64, then the cast
    return arr


# -- one input of a copy ----------------------------------------------------------------------
class HostSource:
    """One input normalised: its shape, the target dtype, and how to write it into memory.

    Exactly one of ``packed`` (the bytes of a flat list, packed by a cached ``struct``),
    ``array`` (a NumPy array, any strides) or ``tensor`` (a CPU tensor, any strides) is set.
    Values that do not fit the target dtype are refused here, before anything is written.
    """

    __slots__ = ("shape", "dtype", "numel", "nbytes", "tensor", "array", "packed")

    def __init__(self, data: Any, dtype: torch.dtype | None, backend: Backend,
                 what: str = "data") -> None:
        self.tensor: torch.Tensor | None = None
        self.array: np.ndarray | None = None
        self.packed: bytes | None = None
        if dtype is not None:
            check_dtype(dtype)
        if isinstance(data, list) or isinstance(data, tuple):
            self._from_list(data, dtype, what)
        elif isinstance(data, np.ndarray):
            self._from_array(data, dtype, what)
        elif isinstance(data, torch.Tensor):
            if data.device.type != "cpu" or backend.is_device_tensor(data):
                raise TypeError(f"{what} must be host data (a list, an array or a CPU tensor); "
                                f"got a tensor on the device ({data.device}): it is already "
                                "there, use .to()/.copy_() for device copies")
            if data.layout != torch.strided:
                raise TypeError(f"{what} must be a dense (strided) CPU tensor, got layout "
                                f"{data.layout}")
            self.shape = tuple(data.shape)
            self.dtype = dtype or data.dtype
            self.tensor = check_tensor_fits(data, self.dtype, what)
        elif isinstance(data, _TEXT):
            raise _not_a_number(data, "", what)
        else:
            raise TypeError(f"{what} must be a list or tuple of numbers, a NumPy array or a CPU "
                            f"tensor; got {describe(data)}")
        self.numel = math.prod(self.shape)
        self.nbytes = self.numel * itemsize(self.dtype)

    def _from_array(self, arr: np.ndarray, dtype: torch.dtype | None, what: str) -> None:
        if arr.dtype.kind == "O":
            arr = _numbers_from_objects(arr, dtype, what)
        if arr.dtype.kind not in _NUMERIC_KINDS:
            raise NotANumberError(f"{what} is a NumPy array of dtype {arr.dtype} (kind "
                                  f"{arr.dtype.kind!r}); expected a numeric dtype (bool, int, "
                                  "uint, float, complex)")
        src = numpy_to_torch(arr.dtype)
        if src is None:
            raise TypeError(f"{what} has NumPy dtype {arr.dtype}, which torch cannot hold")
        if arr.dtype.isnative:
            arr = _canonical(arr)
        self.shape = arr.shape
        self.dtype = dtype or src
        self.array = arr if self.dtype == src else check_fits(arr, self.dtype, what)

    def _from_list(self, data: Sequence[Any], dtype: torch.dtype | None, what: str) -> None:
        target = dtype
        if target is None and data:
            tf = type(data[0])
            target = (torch.int64 if tf is int else
                      torch.get_default_dtype() if tf is float else None)
        if target is not None and data:
            # One cached struct packs (and range-checks) the whole list in C: no per-element
            # Python loop (see the module docstring for what it takes). What it does not take
            # (nested lists, floats into integer dtypes, non-numbers, out-of-range values)
            # takes the general path below, which applies the rule and says what is wrong.
            packed = fast_pack(data, target)
            if packed is not None:
                self.packed = packed
                self.shape, self.dtype = (len(data),), target
                return
        self._from_nested(data, dtype, what)

    def _from_nested(self, data: Sequence[Any], dtype: torch.dtype | None, what: str) -> None:
        arr = list_values(data, dtype, what)
        if dtype is None:
            kind = arr.dtype.kind
            if kind == "u" and arr.size and int(arr.max()) > 2**63 - 1:
                big = arr > 2**63 - 1
                raise ValueOverflowError(
                    f"{what} holds {int(arr[big].reshape(-1)[0])}{_where(big)}, which does not "
                    "fit torch.int64; a list of ints is read as torch.int64, as torch.tensor "
                    "reads it (which refuses it too): pass dtype= (torch.uint64, a floating "
                    "dtype) to convert it")
            dtype = (torch.int64 if kind in "iu" else torch.bool if kind == "b" else
                     torch.get_default_dtype() if kind == "f" else
                     torch.complex64 if torch.get_default_dtype() == torch.float32 else
                     torch.complex128)
        self._from_array(arr, dtype, what)

    # -- use ---------------------------------------------------------------------------------
    def reads_in_place(self, backend: Backend) -> bool:
        """True when the device may read the caller's tensor directly (pinned, contiguous,
        right dtype): no staging copy."""
        t = self.tensor
        return (t is not None and t.dtype == self.dtype and t.is_contiguous()
                and backend.is_pinned(t))

    def write_into(self, mem: torch.Tensor, mem_np: np.ndarray, offset: int) -> None:
        """Write the values, converted to ``dtype``, at byte ``offset`` of ``mem`` (uint8;
        ``mem_np`` is the same memory as NumPy)."""
        if self.numel == 0:
            return
        end = offset + self.nbytes
        if self.packed is not None:
            mem_np[offset:end] = np.frombuffer(self.packed, np.uint8)
            return
        npdt = torch_to_numpy(self.dtype)
        if self.array is not None and npdt is not None:
            # NumPy assignment, any strides and byte order; the values fit (checked above)
            mem_np[offset:end].view(npdt).reshape(self.shape)[...] = self.array
            return
        src = self.tensor if self.tensor is not None else array_tensor(self.array)
        mem[offset:end].view(self.dtype).view(self.shape).copy_(src)

    def host_tensor(self) -> torch.Tensor:
        """The values as a new contiguous CPU tensor of ``dtype`` that nothing else shares."""
        if self.packed is not None:
            return torch.frombuffer(bytearray(self.packed), dtype=self.dtype)
        if self.tensor is not None:
            return self.tensor.to(dtype=self.dtype, copy=True,
                                  memory_format=torch.contiguous_format)
        npdt = torch_to_numpy(self.dtype)
        if npdt is not None:
            return torch.from_numpy(np.array(self.array, dtype=npdt, order="C"))
        return array_tensor(self.array).to(dtype=self.dtype, copy=True,
                                            memory_format=torch.contiguous_format)


def array_tensor(arr: np.ndarray | None) -> torch.Tensor:
    """A CPU tensor over ``arr`` (copied only where torch can't express its strides)."""
    if arr is None:
        raise TypeError("no data")  # unreachable: HostSource always holds one source
    if arr.dtype.byteorder == ">" or any(s < 0 for s in arr.strides) or arr.size == 0:
        arr = np.array(arr, dtype=arr.dtype.newbyteorder("="), order="C", copy=True)
    arr = _canonical(arr)
    try:
        return torch.from_numpy(arr)
    except ValueError:  # strides torch can't express: one host copy
        return torch.from_numpy(np.array(arr, order="C", copy=True))


# -- the values of one staged write ------------------------------------------------------------
_NOT_ITERABLE_VALUES = (dict, set, frozenset)


def _flat_values(values: Any, dtype: torch.dtype, what: str,
                 backend: Backend | None) -> np.ndarray | torch.Tensor | list[Any]:
    """``values`` as a 1-D array, a 1-D CPU tensor, or a list (to pack)."""
    if isinstance(values, np.ndarray):
        return values
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu" or (backend is not None
                                           and backend.is_device_tensor(values)):
            raise TypeError(f"{what} must be host data, got a tensor on {values.device}")
        return values
    if isinstance(values, (list, tuple)):
        return list(values)
    if isinstance(values, array.array):
        return np.asarray(values)  # typed by its typecode, no per-element work
    if isinstance(values, range):
        try:
            return np.arange(values.start, values.stop, values.step, dtype=np.int64)
        except (OverflowError, ValueError):
            return list(values)
    if isinstance(values, _TEXT):
        raise NotANumberError(f"{what} must be an iterable of numbers, got {describe(values)}: "
                              "bytes and strings are not read as numbers (convert them first, "
                              "e.g. list(map(int, s.split())) or np.frombuffer(b, dtype))")
    if isinstance(values, _NOT_ITERABLE_VALUES) or not isinstance(values, Iterable):
        raise TypeError(f"{what} must be an iterable of numbers (list, tuple, range, "
                        f"array.array, generator), a NumPy array or a CPU tensor; got "
                        f"{describe(values)}")
    return list(values)


def values_bytes(values: Any, dtype: torch.dtype, what: str = "x",
                 backend: Backend | None = None) -> tuple[bytes, int]:
    """The values of one staged write (any iterable of numbers, a 1-D NumPy array or CPU
    tensor) as bytes of ``dtype`` and their count, by the rule (bfloat16 as its bits)."""
    flat = _flat_values(values, dtype, what, backend)
    if isinstance(flat, list):
        return pack_list(flat, dtype, what), len(flat)
    if flat.ndim != 1:
        raise ValueError(f"{what} must be one-dimensional, got shape {tuple(flat.shape)}")
    n = int(flat.shape[0])
    if n == 0:
        return b"", 0
    if isinstance(flat, torch.Tensor):
        t = check_tensor_fits(flat, dtype, what)
        t = t.to(dtype).contiguous()
        if torch_to_numpy(dtype) is None:
            t = t.view(torch.int16)
        return t.numpy().tobytes(), n
    if flat.dtype.kind == "O":
        flat = _numbers_from_objects(flat, dtype, what)
    elif flat.dtype.kind not in _NUMERIC_KINDS:
        raise NotANumberError(f"{what} must hold numbers, got a NumPy array of {flat.dtype} "
                              f"({describe(values)})")
    return _array_bytes(flat, dtype, what), n


def number_bytes(x: Any, dtype: torch.dtype, what: str = "x",
                 backend: Backend | None = None) -> bytes:
    """One number (a Python or NumPy scalar, or a one-element array or CPU tensor) as bytes of
    ``dtype``, by the rule."""
    if isinstance(x, (np.ndarray, torch.Tensor)):
        if int(np.prod(x.shape)) != 1:
            raise TypeError(f"{what} must be a single number, got {describe(x)}")
        return values_bytes(x.reshape(1), dtype, what, backend)[0]
    if isinstance(x, _TEXT) or x is None:
        raise _not_a_number(x, "", what)
    if isinstance(x, Iterable):
        raise TypeError(f"{what} must be a single number, got {describe(x)}")
    if _scalar(x) is None:
        raise _not_a_number(x, "", what)
    return pack_list([x], dtype, what)


def _array_bytes(arr: np.ndarray, dtype: torch.dtype, what: str) -> bytes:
    arr = check_fits(arr, dtype, what)
    npdt = torch_to_numpy(dtype)
    if npdt is not None:
        return arr.astype(npdt).tobytes()
    return array_tensor(arr).to(dtype).view(torch.int16).numpy().tobytes()  # bfloat16 bits
