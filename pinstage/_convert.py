"""The one conversion rule: every entry point (copies, ``h2d_many``, pools, staged writes)
normalises its input through :class:`HostSource`, which knows the input's shape, the target
dtype, and how to write the converted values into host memory."""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._dtypes import STRUCT_CODES, check_dtype, itemsize, numpy_to_torch, packer, torch_to_numpy
from ._errors import ValueOverflowError, describe

if TYPE_CHECKING:
    from ._backend import Backend

__all__ = ["HostSource", "array_tensor", "NATIVE_DTYPES"]

_NUMERIC_KINDS = "biufc"
NATIVE_DTYPES = frozenset(np.dtype(t) for t in (np.bool_, np.int8, np.uint8, np.int16, np.int32,
                                          np.int64, np.float16, np.float32, np.float64,
                                          np.complex64, np.complex128))


def _int_bounds(dtype: torch.dtype) -> tuple[int, int] | None:
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        return None
    info = torch.iinfo(dtype)
    return int(info.min), int(info.max)


class HostSource:
    """One input normalised: its shape, the target dtype, and how to write it into memory.

    Exactly one of ``packed`` (the bytes of a flat list, packed by a cached ``struct``),
    ``array`` (a NumPy array, any strides) or ``tensor`` (a CPU tensor, any strides) is set.
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
            self.tensor = data
            self.shape = tuple(data.shape)
            self.dtype = dtype or data.dtype
        else:
            raise TypeError(f"{what} must be a list or tuple of numbers, a NumPy array or a CPU "
                            f"tensor; got {describe(data)}")
        self.numel = math.prod(self.shape)
        self.nbytes = self.numel * itemsize(self.dtype)

    def _from_array(self, arr: np.ndarray, dtype: torch.dtype | None, what: str) -> None:
        if arr.dtype.kind not in _NUMERIC_KINDS:
            raise TypeError(f"{what} is a NumPy array of dtype {arr.dtype} (kind "
                            f"{arr.dtype.kind!r}); expected a numeric dtype (bool, int, uint, "
                            "float, complex)")
        src = numpy_to_torch(arr.dtype)
        if src is None:
            raise TypeError(f"{what} has NumPy dtype {arr.dtype}, which torch cannot hold")
        self.array = arr
        self.shape = arr.shape
        self.dtype = dtype or src

    def _from_list(self, data: Sequence[Any], dtype: torch.dtype | None, what: str) -> None:
        tf = type(data[0]) if data else None
        if tf is int or tf is float:
            target = dtype or (torch.int64 if tf is int else torch.get_default_dtype())
            code = STRUCT_CODES.get(target)
            if code is not None:
                # One cached struct packs (and validates) the whole list in C: no per-element
                # Python loop. Non-numbers, nested lists and out-of-range values are refused
                # there and take the general path below, which says what is wrong.
                try:
                    self.packed = packer(code, len(data)).pack(*data)
                except (struct.error, OverflowError, TypeError):
                    pass
                else:
                    self.shape, self.dtype = (len(data),), target
                    return
        self._from_nested(data, dtype, what)

    def _from_nested(self, data: Sequence[Any], dtype: torch.dtype | None, what: str) -> None:
        try:
            arr = np.asarray(data)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{what} is not a rectangular list of numbers "
                             f"({describe(data)}): {exc}") from None
        if arr.dtype.kind == "O":
            if any(type(x) is int for x in arr.reshape(-1)[:1]):
                raise ValueOverflowError(f"{what} holds an integer too large for 64 bits: "
                                         f"{describe(data)}")
            raise TypeError(f"{what} must hold numbers only; got {describe(data)}")
        if arr.dtype.kind not in _NUMERIC_KINDS:
            raise TypeError(f"{what} must hold numbers only; got {describe(data)} "
                            f"(NumPy reads it as {arr.dtype})")
        if arr.dtype.kind == "u" and dtype is None:
            raise ValueOverflowError(f"{what} holds an integer too large for int64: "
                                     f"{describe(data)}")
        if dtype is None:
            kind = arr.dtype.kind
            dtype = (torch.int64 if kind in "iu" else torch.bool if kind == "b" else
                     torch.get_default_dtype() if kind == "f" else
                     torch.complex64 if torch.get_default_dtype() == torch.float32 else
                     torch.complex128)
        bounds = _int_bounds(dtype)
        if bounds is not None and arr.dtype.kind in "iu" and arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < bounds[0] or hi > bounds[1]:
                raise ValueOverflowError(f"{what} holds {lo if lo < bounds[0] else hi}, which "
                                         f"does not fit {dtype} ({bounds[0]}..{bounds[1]})")
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
            # NumPy assignment: any strides and byte order, converted as torch's copy_ would
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


