"""The one conversion rule, used by every entry point (copies, ``h2d_many``, pools, staged
writes): values are converted to the target dtype only when they fit it.

Refused, never wrapped or truncated: a value outside the target's range
(:class:`ValueOverflowError`, also an ``OverflowError``), a non-integral or non-finite float
into an integer or bool dtype, a complex number with an imaginary part into a real dtype
(``ValueError``), and anything that is not a number (:class:`NotANumberError`, a ``ValueError``
and a ``TypeError``). Sources already of the target dtype, or of a dtype whose whole range fits
it (``int32`` into ``int64``), are not scanned: the hot path pays nothing.

:class:`HostSource` normalises one input of a copy; :func:`values_bytes` encodes the values of
one staged write.
"""

from __future__ import annotations

import array
import math
import struct
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._dtypes import STRUCT_CODES, check_dtype, itemsize, numpy_to_torch, packer, torch_to_numpy
from ._errors import NotANumberError, ValueOverflowError, describe

if TYPE_CHECKING:
    from ._device import Backend

__all__ = ["HostSource", "NotANumberError", "array_tensor", "check_fits", "values_bytes",
           "NATIVE_DTYPES"]

_NUMERIC_KINDS = "biufc"
NATIVE_DTYPES = frozenset(np.dtype(t) for t in (np.bool_, np.int8, np.uint8, np.int16, np.int32,
                                          np.int64, np.float16, np.float32, np.float64,
                                          np.complex64, np.complex128))
_STRUCT_ERRORS = (struct.error, OverflowError, TypeError)


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


def check_fits(arr: np.ndarray, dtype: torch.dtype, what: str = "data") -> np.ndarray:
    """Refuse any value of the numeric array ``arr`` that ``dtype`` cannot hold; returns the
    values to convert (the real part of complex values whose imaginary parts are all zero)."""
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
            raise ValueError(f"{what} holds {value}{_where(bad)}, a complex number with an "
                             f"imaginary part; {dtype} holds real numbers only")
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
            # float(hi_b) + 1 is exact: a power of two (2**31, 2**63, ...)
            out = (arr < float(lo_b)) | (arr >= float(hi_b) + 1)
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
    if kind == "c":
        parts = np.maximum(np.abs(arr.real), np.abs(arr.imag))
    elif kind in "iub":
        parts = np.abs(arr.astype(np.float64))
    else:
        parts = np.abs(arr)
    top = parts.max()
    if top < limit:  # common case; NaN (a representable value) takes the slow path below
        return arr
    out = (parts >= limit) & np.isfinite(parts)
    if out.any():
        value = arr[out].reshape(-1)[0]
        finfo = torch.finfo(torch.float32 if dtype == torch.complex64 else dtype)
        raise ValueOverflowError(f"{what} holds {value}{_where(out)}, which is outside "
                                 f"{dtype}'s range (+-{float(finfo.max):.6g}); it would become "
                                 "infinity")
    return arr


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


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, complex, np.number, np.bool_))


def _not_a_number(value: Any, where: str, what: str) -> NotANumberError:
    kind = "None" if value is None else f"{value!r} ({type(value).__name__})"
    return NotANumberError(f"{what}{where} is {kind}, which is not a number")


def _pos(flat_index: int, shape: tuple[int, ...]) -> list[int]:
    return [int(p) for p in np.unravel_index(flat_index, shape)]


def _numbers_from_objects(arr: np.ndarray, dtype: torch.dtype | None, what: str) -> np.ndarray:
    """A numeric array from an object array (NumPy makes one for ``None``, strings mixed with
    numbers, or integers beyond 64 bits): says which element is wrong, else converts the
    numbers by the rule. Rare inputs only, so a Python loop is fine here."""
    flat = arr.reshape(-1)
    for i, v in enumerate(flat):
        if not _is_number(v):
            raise _not_a_number(v, str(_pos(i, arr.shape)), what)
    values = flat.tolist()
    has_float = any(isinstance(v, (float, np.floating)) for v in values)
    if any(isinstance(v, (complex, np.complexfloating)) for v in values):
        return np.array(values, dtype=np.complex128).reshape(arr.shape)
    target = dtype if dtype is not None else (
        torch.get_default_dtype() if has_float else torch.int64)
    bounds = _int_bounds(target)
    if bounds is not None:
        for i, v in enumerate(values):
            if isinstance(v, (float, np.floating)):
                continue  # checked as floats below
            if not bounds[0] <= int(v) <= bounds[1]:
                raise ValueOverflowError(f"{what} holds {int(v)} at {_pos(i, arr.shape)}, "
                                         "which does not fit "
                                         f"{target} ({bounds[0]}..{bounds[1]})")
        if has_float:
            return np.array([float(v) for v in values], dtype=np.float64).reshape(arr.shape)
        npdt = torch_to_numpy(target) or np.int64
        return np.array([int(v) for v in values], dtype=npdt).reshape(arr.shape)
    out = np.empty(len(values), dtype=np.float64)
    for i, v in enumerate(values):
        try:
            out[i] = float(v)
        except OverflowError:
            raise ValueOverflowError(f"{what} holds {v} at {_pos(i, arr.shape)}, which is "
                                     f"outside {target}'s range") from None
    return out.reshape(arr.shape)


def numeric_array(data: Any, dtype: torch.dtype | None, what: str) -> np.ndarray:
    """``data`` (nested lists or any array-like of numbers) as a numeric NumPy array; says
    what is wrong when it is not one (ragged, not numbers)."""
    try:
        arr = np.asarray(data)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{what} is not a rectangular list of numbers "
                         f"({describe(data)}): {exc}") from None
    if arr.dtype.kind == "O":
        return _numbers_from_objects(arr, dtype, what)
    if arr.dtype.kind not in _NUMERIC_KINDS:
        first = arr.reshape(-1)[0].item() if arr.size else None
        raise NotANumberError(f"{what} must hold numbers only; it holds {first!r} "
                              f"({describe(data)}, which NumPy reads as {arr.dtype})")
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
        self.shape = arr.shape
        self.dtype = dtype or src
        self.array = arr if self.dtype == src else check_fits(arr, self.dtype, what)

    def _from_list(self, data: Sequence[Any], dtype: torch.dtype | None, what: str) -> None:
        tf = type(data[0]) if data else None
        if (tf is int or tf is float) and dtype != torch.bool:
            target = dtype or (torch.int64 if tf is int else torch.get_default_dtype())
            code = STRUCT_CODES.get(target)
            if code is not None:
                # One cached struct packs (and range-checks) the whole list in C: no
                # per-element Python loop. Floats into integer dtypes, non-numbers, nested
                # lists and out-of-range values are refused there and take the general path
                # below, which applies the rule and says what is wrong.
                try:
                    self.packed = packer(code, len(data)).pack(*data)
                except _STRUCT_ERRORS:
                    pass
                else:
                    self.shape, self.dtype = (len(data),), target
                    return
        self._from_nested(data, dtype, what)

    def _from_nested(self, data: Sequence[Any], dtype: torch.dtype | None, what: str) -> None:
        arr = numeric_array(data, dtype, what)
        if arr.dtype.kind == "u" and dtype is None:
            raise ValueOverflowError(f"{what} holds {int(arr.max())}, an integer too large "
                                     f"for int64 (the dtype lists of ints take)")
        if dtype is None:
            kind = arr.dtype.kind
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
    try:
        return torch.from_numpy(arr)
    except ValueError:  # strides torch can't express: one host copy
        return torch.from_numpy(np.array(arr, order="C", copy=True))


# -- the values of one staged write ------------------------------------------------------------
_NOT_ITERABLE_VALUES = (str, bytes, bytearray, memoryview, dict, set, frozenset)


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
        n = len(flat)
        if n == 0:
            return b"", 0
        code = STRUCT_CODES.get(dtype)
        if code is not None and dtype != torch.bool:
            try:
                return packer(code, n).pack(*flat), n
            except _STRUCT_ERRORS:
                pass  # the array path says exactly what is wrong
        arr = numeric_array(flat, dtype, what)
        if arr.ndim != 1:
            raise ValueError(f"{what} must be a flat sequence of numbers, got shape "
                             f"{arr.shape} ({describe(values)})")
        return _array_bytes(arr, dtype, what), n
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


def _array_bytes(arr: np.ndarray, dtype: torch.dtype, what: str) -> bytes:
    arr = check_fits(arr, dtype, what)
    npdt = torch_to_numpy(dtype)
    if npdt is not None:
        return arr.astype(npdt).tobytes()
    src = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float64))
    return src.to(dtype).view(torch.int16).numpy().tobytes()  # bfloat16 bits
