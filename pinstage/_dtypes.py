"""dtype tables and the shape check shared by every entry point (struct codes, NumPy
equivalents, ``check_dtype``, ``check_shape``)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from ._errors import describe

__all__ = ["STRUCT_CODES", "torch_to_numpy", "numpy_to_torch", "packer", "check_dtype",
           "check_shape", "itemsize", "MAX_BYTES"]

MAX_BYTES = 2**62  # no tensor pinstage makes is larger (torch's storage sizes overflow near it)

# torch dtype -> struct format code (little-endian, standard sizes): lists are packed straight
# into staging memory with one cached ``Struct.pack_into`` call, no per-element Python loop.
STRUCT_CODES: dict[torch.dtype, str] = {
    torch.int8: "b", torch.uint8: "B", torch.int16: "h", torch.int32: "i", torch.int64: "q",
    torch.float16: "e", torch.float32: "f", torch.float64: "d", torch.bool: "?",
}
for _name, _code in (("uint16", "H"), ("uint32", "I"), ("uint64", "Q")):
    if hasattr(torch, _name):
        STRUCT_CODES[getattr(torch, _name)] = _code

_T2N: dict[torch.dtype, Any] = {
    torch.bool: np.bool_, torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16,
    torch.int32: np.int32, torch.int64: np.int64, torch.float16: np.float16,
    torch.float32: np.float32, torch.float64: np.float64, torch.complex64: np.complex64,
    torch.complex128: np.complex128,
}
for _name in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _T2N[getattr(torch, _name)] = getattr(np, _name)
_N2T: dict[Any, torch.dtype] = {np.dtype(v): k for k, v in _T2N.items()}


def torch_to_numpy(dtype: torch.dtype) -> np.dtype | None:
    """The NumPy dtype with the same bits, or ``None`` (bfloat16 and friends)."""
    n = _T2N.get(dtype)
    return None if n is None else np.dtype(n)


def numpy_to_torch(dtype: np.dtype) -> torch.dtype | None:
    """The torch dtype holding the same values (byte order aside), or ``None``."""
    return _N2T.get(dtype if dtype.isnative else dtype.newbyteorder("="))


@lru_cache(maxsize=512)
def packer(code: str, n: int) -> struct.Struct:
    """A cached ``Struct`` packing ``n`` values of format ``code``."""
    return struct.Struct(f"<{n}{code}")


# Dtypes whose bytes are not values pinstage can convert or stage: quantized tensors carry a
# scale and zero point beside their bytes, and ``bits*`` dtypes have no arithmetic at all.
_UNSUPPORTED = frozenset(getattr(torch, n) for n in (
    "qint8", "quint8", "qint32", "quint4x2", "quint2x4",
    "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16") if hasattr(torch, n))


def check_dtype(dtype: Any, what: str = "dtype") -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{what} must be a torch.dtype (e.g. torch.int32), got {dtype!r}")
    if dtype in _UNSUPPORTED:
        raise TypeError(f"{what} {dtype} is not supported: quantized and bits dtypes hold no "
                        "plain values (use an integer or floating dtype, e.g. torch.uint8)")
    return dtype


def check_out(out: Any, device: torch.device, shape: tuple[int, ...],
              dtype: torch.dtype) -> torch.Tensor:
    """``out=`` checked before anything is written: a tensor on ``device`` (not ``meta``, not
    the host for a device result) with this ``shape`` and ``dtype``, that autograd allows to be
    written in place and whose elements do not overlap (an ``expand()``-ed view)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a tensor on {device}, got {describe(out)}")
    if out.device != device:
        raise ValueError(f"out must be a tensor on {device}, got one on {out.device}")
    if out.dtype != dtype:
        raise ValueError(f"out has dtype {out.dtype} but the result's dtype is {dtype}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out has shape {tuple(out.shape)} but the data has shape "
                         f"{tuple(shape)}")
    if out.requires_grad and torch.is_grad_enabled():
        raise ValueError("out requires grad: pinstage writes it in place, which autograd "
                         "refuses; pass out.detach() or a tensor made without requires_grad")
    if overlaps(out):
        raise ValueError(f"out's elements overlap (shape {tuple(out.shape)}, strides "
                         f"{tuple(out.stride())}, e.g. an expand()-ed view): writing it "
                         "would be ambiguous; pass a tensor of its own, e.g. out.clone()")
    return out


def overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory. Exact for dense and sliced views (dims
    sorted by stride, each must step past everything the smaller ones span)."""
    dims = sorted((abs(st), n) for n, st in zip(t.shape, t.stride()) if n > 1)
    span = 0  # elements the dims so far reach beyond the first
    for stride, n in dims:
        if stride <= span:
            return True
        span += stride * (n - 1)
    return False


@lru_cache(maxsize=64)
def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def check_shape(size: Any, what: str = "size", ndims: Sequence[int] | None = None,
                dtype: torch.dtype | None = None) -> tuple[int, ...]:
    """``size`` (an int or a sequence of ints) as a shape: ``TypeError`` for what is not an
    int, ``ValueError`` for a negative dimension, a number of dimensions outside ``ndims``, or
    (with ``dtype``) more bytes than any tensor can hold."""
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
        dims: Sequence[Any] = (size,)
    elif isinstance(size, (tuple, list, torch.Size)):
        dims = size
    else:
        raise TypeError(f"{what} must be an int or a sequence of ints, got {describe(size)}")
    out = []
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
            raise TypeError(f"{what} must hold ints, got {describe(d)} in {tuple(dims)!r}")
        if d < 0:
            raise ValueError(f"{what} must not be negative, got {tuple(dims)!r}")
        out.append(int(d))
    if not out:
        raise ValueError(f"{what} needs at least one dimension, got {tuple(dims)!r}")
    if ndims is not None and len(out) not in ndims:
        allowed = " or ".join(str(n) for n in ndims)
        raise ValueError(f"{what} must have {allowed} dimension(s), got {tuple(out)!r}")
    if dtype is not None:
        nbytes = itemsize(dtype)
        for d in out:
            nbytes *= d
        if nbytes > MAX_BYTES:
            raise ValueError(f"{what} {tuple(out)!r} of {dtype} is {nbytes} bytes, more than "
                             f"any tensor can hold ({MAX_BYTES} bytes)")
    return tuple(out)
