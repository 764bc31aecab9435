"""Host-to-device copies: ``async_tensor_h2d``, ``h2d_many``, ``np_to_pinned_tensor``.

Where pinned memory is in use, every source that is not already pinned, contiguous and of the
right dtype is written (converted on the way) into a region of the device's staging arena, and
the device copies from there: the host never waits, and the caller may change its data as soon
as the call returns. Large sources go in chunks through the ring, so filling chunk k+1 overlaps
the transfer of chunk k. Where pinned memory is not in use, copies are plain (blocking) copies,
as ``capabilities().reasons`` says.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ._capabilities import capabilities_for
from ._convert import NATIVE_DTYPES, HostSource, array_tensor
from ._device import Backend, refuse_capture
from ._dtypes import check_out, itemsize, torch_to_numpy
from ._errors import describe
from ._host import ALIGN, align_up
from ._registry import get_backend
from ._state import device_state

__all__ = ["async_tensor_h2d", "h2d_many", "np_to_pinned_tensor", "synchronize"]

# Sources above this size are staged in chunks of this size (double-buffered through the ring).
CHUNK_BYTES = 8 * 2**20
_CPU = torch.device("cpu")


def _check_out(out: Any, backend: Backend, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    check_out(out, backend.device, shape, dtype)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def _typed_host(block_np: np.ndarray, block_t: torch.Tensor, start: int, nbytes: int,
                dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A typed tensor over bytes ``start:start+nbytes`` of a host block (one cheap view)."""
    npdt = torch_to_numpy(dtype)
    if npdt is not None:
        return torch.from_numpy(block_np[start : start + nbytes].view(npdt).reshape(shape))
    return block_t[start : start + nbytes].view(dtype).view(shape)


def _source_tensor(src: HostSource) -> torch.Tensor:
    if src.tensor is not None:
        return src.tensor
    if src.array is not None:
        return array_tensor(src.array)
    return src.host_tensor()


def _stage_and_copy(backend: Backend, src: HostSource, dst: torch.Tensor) -> None:
    """host -> pinned staging -> device; large sources go in chunks through the ring, so the
    host fills chunk k+1 while chunk k transfers."""
    arena = device_state(backend).arena()
    chunk = min(CHUNK_BYTES, max(ALIGN, arena.limit // 4))
    if src.nbytes <= chunk:
        with arena.staging(src.nbytes) as region:  # released whatever happens, interrupts too
            block = region.block
            src.write_into(block.tensor, block.np, region.start)
            typed = _typed_host(block.np, block.tensor, region.start, src.nbytes, src.dtype,
                                src.shape)
            backend.copy_h2d(dst, typed, pinned=True)  # host -> device, from staging
        return
    if not dst.is_contiguous():  # a strided `out`: stage into fresh memory, then one copy
        tmp = backend.empty(src.shape, src.dtype)
        _stage_and_copy(backend, src, tmp)
        backend.copy_d2d(dst, tmp)
        return
    # Large: split along the first dimension (or the flat view) into chunks of <= chunk bytes.
    t = _source_tensor(src)
    size = itemsize(src.dtype)
    if t.dim() == 0:
        t = t.reshape(1)
    row_bytes = (t[0].numel() if t.shape[0] else 1) * size
    if row_bytes > chunk:
        t = t.contiguous().reshape(-1)
        dflat = dst.view(-1)
        row_bytes = size
    else:
        dflat = dst if dst.dim() else dst.view(1)
    rows = max(1, chunk // row_bytes)
    for i in range(0, t.shape[0], rows):
        piece = t[i : i + rows]
        nb = piece.numel() * size
        with arena.staging(nb) as region:
            typed = _typed_host(region.block.np, region.block.tensor, region.start, nb,
                                src.dtype, tuple(piece.shape))
            typed.copy_(piece)  # host memcpy (+ conversion); torch runs large ones on threads
            backend.copy_h2d(dflat[i : i + rows], typed, pinned=True)  # host -> device


def _upload(backend: Backend, src: HostSource, out: torch.Tensor | None) -> torch.Tensor:
    if not backend.accelerator:  # CPU target: a finished host copy
        if out is None:
            return src.host_tensor()
        out.copy_(_source_tensor(src))
        return out
    dst = out if out is not None else backend.empty(src.shape, src.dtype)
    if src.numel == 0:
        return dst
    if src.tensor is not None and src.reads_in_place(backend):
        backend.copy_h2d(dst, src.tensor)  # host -> device, read in place (pinned)
    elif capabilities_for(backend).pin_memory:
        _stage_and_copy(backend, src, dst)
    else:
        t = src.tensor
        host = t if (t is not None and t.dtype == src.dtype and t.is_contiguous()) else \
            src.host_tensor()
        backend.copy_h2d(dst, host)  # host -> device, blocking: pinning is off
    return dst


def async_tensor_h2d(data: Any, device: Any = None, dtype: torch.dtype | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Upload ``data`` (list, NumPy array or CPU tensor) to ``device`` without making the host
    wait where pinned memory is in use; returns the device tensor (``out`` when given)."""
    if device is None:
        if out is None:
            raise ValueError("async_tensor_h2d needs a device (or an out tensor to take it "
                             "from); got neither")
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a device tensor, got {describe(out)}")
        device = out.device
    if dtype is None and isinstance(out, torch.Tensor):
        dtype = out.dtype
    backend = get_backend(device)
    refuse_capture(backend, "async_tensor_h2d")
    if out is None and dtype is None and not backend.accelerator:
        plain = _plain_copy(data)
        if plain is not None:
            return plain
    src = HostSource(data, dtype, backend)
    if out is not None:
        _check_out(out, backend, src.shape, src.dtype)
    return _upload(backend, src, out)


def _views(base: torch.Tensor, srcs: list[HostSource],
           offsets: list[int]) -> tuple[torch.Tensor, ...]:
    """One typed view of ``base`` (uint8, 64-byte aligned offsets) per source."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    outs = []
    for s, o in zip(srcs, offsets):
        size = itemsize(s.dtype)
        t = typed.get(s.dtype)
        if t is None:
            t = typed[s.dtype] = base.view(s.dtype)
        outs.append(torch.as_strided(t, s.shape, _contiguous_strides(s.shape), o // size))
    return tuple(outs)


def _plain_copy(data: Any) -> torch.Tensor | None:
    """On the CPU target with nothing to convert, a plain host copy is all the work there is:
    a native-endian numeric array or a dense CPU tensor, copied once with no normalisation.
    ``None`` for anything else (it takes the general path, which checks it)."""
    if type(data) is np.ndarray and data.dtype.isnative and data.dtype in NATIVE_DTYPES:
        return torch.from_numpy(data.copy())
    if type(data) is torch.Tensor and data.device.type == "cpu" and \
            data.layout == torch.strided:
        return data.clone(memory_format=torch.contiguous_format)
    return None


def _host_copy(data: Any, backend: Backend, i: int, dtype: torch.dtype | None) -> torch.Tensor:
    """A new host tensor equal to ``data`` (the CPU target's h2d_many)."""
    plain = _plain_copy(data) if dtype is None else None
    if plain is not None:
        return plain
    return HostSource(data, dtype, backend, what=f"arrays[{i}]").host_tensor()


def h2d_many(arrays: Sequence[Any], device: Any = None,
             dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """Upload several lists/arrays/CPU tensors in one host-to-device transfer; returns one
    device tensor per input (views of one device allocation)."""
    if not isinstance(arrays, (list, tuple)):
        raise TypeError(f"arrays must be a list or tuple of inputs, got {describe(arrays)}")
    backend = get_backend(device)
    refuse_capture(backend, "h2d_many")
    if not backend.accelerator:  # CPU target: nothing to batch, a finished copy of each
        return tuple(_host_copy(a, backend, i, dtype) for i, a in enumerate(arrays))
    srcs = [HostSource(a, dtype, backend, what=f"arrays[{i}]") for i, a in enumerate(arrays)]
    if not srcs:
        return ()
    offsets = []
    total = 0
    for s in srcs:
        offsets.append(total)
        total += align_up(s.nbytes)
    total = max(total, ALIGN)
    dev = backend.empty((total,), torch.uint8)
    outs = _views(dev, srcs, offsets)
    pinned = capabilities_for(backend).pin_memory
    arena = device_state(backend).arena() if pinned else None
    if arena is not None and total <= arena.limit:
        with arena.staging(total) as region:
            for o, s in zip(offsets, srcs):
                s.write_into(region.block.tensor, region.block.np, region.start + o)
            backend.copy_h2d(dev, region.tensor(total), pinned=True)  # host -> device, once
    elif arena is not None:  # larger than the whole staging cap: each input staged on its own
        for s, dst in zip(srcs, outs):
            _upload(backend, s, dst)
    else:
        host = torch.empty(total, dtype=torch.uint8, device=_CPU)
        host_np = host.numpy()
        for o, s in zip(offsets, srcs):
            s.write_into(host, host_np, o)
        backend.copy_h2d(dev, host)  # host -> device, blocking: pinning is off
    return outs


def np_to_pinned_tensor(array: np.ndarray) -> torch.Tensor:
    """A CPU tensor equal to ``array``: a pinned copy where pinned memory is in use, otherwise
    possibly sharing memory with ``array``. The pinned memory comes from a per-device pool and
    returns to it once the tensor is gone and the device work queued before has completed."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"array must be a NumPy array, got {describe(array)}")
    backend = get_backend(None)
    src = HostSource(array, None, backend, what="array")
    if not capabilities_for(backend).pin_memory:
        return array_tensor(array)
    if not src.nbytes:
        return torch.empty(src.shape, dtype=src.dtype, device=_CPU)
    refuse_capture(backend, "np_to_pinned_tensor")
    # pooled: pins only when no slab fits; its fences cover every device (a copy to any of
    # them may read it: the memory is registered portable)
    mem = device_state(backend).pinned_copy_memory(src.nbytes)
    mem_np = mem.numpy()
    src.write_into(mem, mem_np, 0)
    return _typed_host(mem_np, mem, 0, src.nbytes, src.dtype, src.shape)


def synchronize(device: Any = None) -> None:
    """Wait until all device work pinstage issued for ``device`` has completed, then take
    back the staging and parked pinned memory that work was reading."""
    backend = get_backend(device)
    if not backend.accelerator:  # the CPU target: every call finished when it returned
        return
    state = device_state(backend)
    pending = state.pending()  # pinned memory dropped before this sync: free once it is done
    backend.synchronize()
    state.release_synced(pending)
    state.drain()

