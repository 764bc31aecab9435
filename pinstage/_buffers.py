"""Buffers that pair host memory with device memory or a device view of it.

* :class:`CpuGpuBuffer` - a host tensor (pinned where pinning is in use) and a device tensor.
* :class:`UvaBuffer` - pinned host memory and a device view aliasing it (no copies).
* :class:`NonUvaBuffer` - the same interface where UVA is off: ``uva()`` copies.
* :class:`UvaBufferPool` - round-robin slots whose reuse is fenced by events, not convention.
* :class:`UvaBackedTensor` - ordinary host memory as the source of truth, uploaded through a
  pool.

Memory reuse rule, everywhere: pinstage rewrites host memory the device may read only after an
event recorded after that read has completed.
"""

from __future__ import annotations

import threading
from typing import Any, Generic, Literal, TypeVar, overload

import numpy as np
import numpy.typing as npt
import torch

from ._capabilities import Capabilities, capabilities_for
from ._convert import HostSource
from ._device import Backend, Fence, refuse_capture
from ._dtypes import check_dtype, check_out, check_shape, itemsize, torch_to_numpy
from ._errors import BusyError, UnavailableError, describe
from ._registry import get_backend
from ._state import DeviceState, device_state, renew_locks_after_fork

__all__ = ["CpuGpuBuffer", "UvaBuffer", "NonUvaBuffer", "UvaBufferPool", "UvaBackedTensor",
           "check_concurrency", "get_default_max_concurrency", "set_default_max_concurrency"]

_DEFAULT_MAX_CONCURRENCY = 2
_CPU = torch.device("cpu")


def set_default_max_concurrency(n: int) -> None:
    """Default slot count of pools made afterwards (>= the number of engine steps in flight)."""
    global _DEFAULT_MAX_CONCURRENCY
    _DEFAULT_MAX_CONCURRENCY = check_concurrency(n)


def get_default_max_concurrency() -> int:
    return _DEFAULT_MAX_CONCURRENCY


def check_concurrency(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"max_concurrency must be an int >= 1, got {describe(n)}")
    if n < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {n}")
    return int(n)


def _check_n(n: Any, rows: int) -> int:
    """``n`` rows as Python slicing reads ``[:n]`` (above ``rows`` means all, as in vLLM); a
    negative ``n`` is refused (``[:-1]`` would silently drop the last row)."""
    if n is None:
        return rows
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"n must be an int or None, got {describe(n)}")
    if n < 0:
        raise ValueError(f"n={n} is negative; expected 0 <= n (n above {rows}, the buffer's "
                         "first dimension, means the whole buffer)")
    return min(int(n), rows)


def _host(backend: Backend, shape: tuple[int, ...], dtype: torch.dtype,
          pinned: bool) -> torch.Tensor:
    """Zero-filled host memory; pinned (exact size) when asked. Made outside inference mode,
    so objects created under ``torch.inference_mode()`` can be written outside it."""
    with torch.inference_mode(False):
        if not pinned:
            return torch.zeros(shape, dtype=dtype, device=_CPU)
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize(dtype)
        if not nbytes:
            return torch.zeros(shape, dtype=dtype, device=_CPU)
        mem = device_state(backend).alloc_pinned(nbytes)
        return mem.view(dtype).view(shape)


def _device(backend: Backend, shape: tuple[int, ...], dtype: torch.dtype,
            zero: bool = True) -> torch.Tensor:
    """Device memory of ``shape`` (zero-filled when ``zero``), made outside inference mode."""
    with torch.inference_mode(False):
        if not backend.accelerator:
            return torch.zeros(shape, dtype=dtype, device=_CPU) if zero else \
                torch.empty(shape, dtype=dtype, device=_CPU)
        return backend.zeros(shape, dtype) if zero else backend.empty(shape, dtype)


class _Prefixes:
    """Cached ``t[:n]`` views of a few tensors (slicing costs microseconds on the hot path;
    engines use a handful of distinct ``n``)."""

    __slots__ = ("tensors", "cache")

    def __init__(self, *tensors: torch.Tensor) -> None:
        self.tensors = tensors
        self.cache: dict[int, tuple[torch.Tensor, ...]] = {}

    def get(self, n: int) -> tuple[torch.Tensor, ...]:
        hit = self.cache.get(n)
        if hit is None:
            if len(self.cache) >= 256:
                self.cache.clear()
            hit = self.cache[n] = tuple(t[:n] for t in self.tensors)
        return hit


def _raw(t: torch.Tensor) -> tuple[torch.Tensor, np.ndarray] | None:
    """``t``'s bytes as a uint8 tensor and NumPy array (for fast host writes), if any."""
    if t.numel() == 0:
        return None
    raw = t.view(-1).view(torch.uint8)
    return raw, raw.numpy()


def _numpy(t: torch.Tensor) -> np.ndarray | None:
    return t.numpy() if torch_to_numpy(t.dtype) is not None else None


# what ``CpuGpuBuffer.np`` is, for a type checker: an array with ``with_numpy=True`` (the
# default), ``None`` with ``with_numpy=False``
_Np = TypeVar("_Np", npt.NDArray[Any], None, "npt.NDArray[Any] | None")


class CpuGpuBuffer(Generic[_Np]):
    """A host tensor ``.cpu`` (with ``.np``) and a device tensor ``.gpu`` of one shape.

    ``.np`` is a NumPy view of ``.cpu`` (``None`` with ``with_numpy=False``); type checkers see
    an ``ndarray`` for the default ``with_numpy=True``.

    ``.cpu`` is read in place by ``copy_to_gpu``: don't change ``.cpu[:n]`` until that copy has
    completed (an event or ``synchronize()`` tells). Calls from several threads at once are
    fine (they share no state beyond the two tensors, as with torch's own copies).
    """

    np: _Np

    @overload
    def __init__(self: CpuGpuBuffer[npt.NDArray[Any]], *size: Any, dtype: torch.dtype,
                 device: Any, pin_memory: bool | None = None,
                 with_numpy: Literal[True] = True) -> None: ...

    @overload
    def __init__(self: CpuGpuBuffer[None], *size: Any, dtype: torch.dtype, device: Any,
                 pin_memory: bool | None = None, with_numpy: Literal[False]) -> None: ...

    @overload
    def __init__(self: CpuGpuBuffer[npt.NDArray[Any] | None], *size: Any, dtype: torch.dtype,
                 device: Any, pin_memory: bool | None = None, with_numpy: bool) -> None: ...

    def __init__(self, *size: Any, dtype: torch.dtype, device: Any,
                 pin_memory: bool | None = None, with_numpy: bool = True) -> None:
        if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
            size = tuple(size[0])
        check_dtype(dtype)
        shape = check_shape(tuple(size), dtype=dtype)
        if with_numpy and torch_to_numpy(dtype) is None:
            raise ValueError(f"dtype {dtype} has no NumPy equivalent: pass with_numpy=False")
        self._backend = backend = get_backend(device)
        caps = capabilities_for(backend)
        if pin_memory is None:
            pinned = caps.pin_memory
        else:
            pinned = bool(pin_memory)
            if pinned and not caps.can_pin:
                raise UnavailableError(f"pin_memory=True but pinned memory is unavailable for "
                                       f"{backend.device}: " + "; ".join(caps.reasons),
                                       caps.reasons)
        self.dtype = dtype
        self.device = backend.device
        self.cpu = _host(backend, shape, dtype, pinned)
        self.gpu = _device(backend, shape, dtype)
        self.np = self.cpu.numpy() if with_numpy else None  # type: ignore[assignment]
        self._pinned = pinned  # known once: no is_pinned() driver query per copy
        self._prefix = _Prefixes(self.cpu, self.gpu)
        self._state = device_state(backend) if pinned else None
        self._ptr = self.cpu.data_ptr()

    def copy_to_gpu(self, n: int | None = None) -> torch.Tensor:
        """Enqueue ``.cpu[:n] -> .gpu[:n]``; returns ``.gpu[:n]``."""
        cpu, gpu = self._prefix.get(_check_n(n, self.cpu.shape[0]))
        if self._state is not None:
            self._check_memory()
            self._state.note_reader()  # pinned memory read on this stream: fenced there too
        self._backend.copy_h2d(gpu, cpu, pinned=self._pinned)  # host -> device
        return gpu

    def copy_to_cpu(self, n: int | None = None) -> torch.Tensor:
        """Enqueue ``.gpu[:n] -> .cpu[:n]``; returns ``.cpu[:n]``, valid after a synchronize."""
        cpu, gpu = self._prefix.get(_check_n(n, self.cpu.shape[0]))
        if self._state is not None:
            self._check_memory()
            self._state.note_reader()
        self._backend.copy_d2h(cpu, gpu)  # device -> host
        return cpu

    def _check_memory(self) -> None:
        if self.cpu.data_ptr() != self._ptr:
            raise _moved("CpuGpuBuffer")


class UvaBuffer:
    """Pinned host memory ``.cpu``/``.np`` and ``uva(n)``: a device tensor aliasing it, so host
    writes are visible to the device with no copy call. Raises ``RuntimeError`` without UVA.

    ``cpu``: an existing pinned, contiguous tensor of ``size`` and ``dtype`` to wrap (no copy;
    the caller keeps it alive as long as the device may read it)."""

    def __init__(self, size: Any, dtype: torch.dtype, device: Any = None,
                 cpu: torch.Tensor | None = None) -> None:
        check_dtype(dtype)
        shape = check_shape(size, dtype=dtype)
        self._backend = backend = get_backend(device)
        caps = capabilities_for(backend)
        if not caps.uva:
            raise UnavailableError(f"UVA is not available for {backend.device}: "
                                   + "; ".join(caps.reasons) + " (use NonUvaBuffer)",
                                   caps.reasons)
        self.dtype = dtype
        self.device = backend.device
        if cpu is None:
            self.cpu = _host(backend, shape, dtype, backend.accelerator)
        else:
            self.cpu = _wrap_pinned(backend, cpu, shape, dtype)
        self.np = _numpy(self.cpu)
        self._bytes = _raw(self.cpu)
        with torch.inference_mode(False):
            self._view = backend.uva_view(self.cpu)
        self._prefix = _Prefixes(self._view)
        self._state = device_state(backend) if backend.accelerator else None
        self._ptr = self.cpu.data_ptr()

    def uva(self, n: int | None = None) -> torch.Tensor:
        """The device view of ``.cpu[:n]`` (the device reads it on the stream current now,
        where its kernels are queued: dropped memory is fenced there too)."""
        view = self._prefix.get(_check_n(n, self.cpu.shape[0]))[0]
        if self._state is not None:
            if self.cpu.data_ptr() != self._ptr:
                raise _moved("UvaBuffer")
            self._state.note_reader()
        return view


def _wrap_pinned(backend: Backend, cpu: Any, shape: tuple[int, ...],
                 dtype: torch.dtype) -> torch.Tensor:
    """``cpu`` checked for :class:`UvaBuffer` to wrap: a pinned contiguous CPU tensor of
    ``shape`` and ``dtype`` (any host tensor on the CPU target)."""
    if not isinstance(cpu, torch.Tensor) or cpu.device.type != "cpu" or \
            backend.is_device_tensor(cpu):
        raise TypeError(f"cpu must be a pinned CPU tensor, got {describe(cpu)}")
    if tuple(cpu.shape) != shape or cpu.dtype != dtype:
        raise ValueError(f"cpu has shape {tuple(cpu.shape)} and dtype {cpu.dtype}; expected "
                         f"{shape} and {dtype}")
    if not cpu.is_contiguous():
        raise ValueError(f"cpu must be contiguous, got strides {cpu.stride()}")
    if backend.accelerator and not backend.is_pinned(cpu):
        raise ValueError("cpu must be pinned host memory (a device view of pageable memory "
                         "would read garbage); allocate it with pin_memory=True")
    return cpu


class NonUvaBuffer:
    """``UvaBuffer``'s interface without UVA: ``uva(n)`` copies ``.cpu[:n]`` into device memory
    (reused by the next call; non-blocking where ``.cpu`` is pinned). One thread at a time: a
    call while another thread is inside ``uva()`` raises ``RuntimeError``."""

    def __init__(self, size: Any, dtype: torch.dtype, device: Any = None) -> None:
        check_dtype(dtype)
        shape = check_shape(size, dtype=dtype)
        self._backend = backend = get_backend(device)
        caps = capabilities_for(backend)
        self.dtype = dtype
        self.device = backend.device
        self._pinned = caps.pin_memory
        self.cpu = _host(backend, shape, dtype, self._pinned)
        self.np = _numpy(self.cpu)
        self._bytes = _raw(self.cpu)
        self._dev = _device(backend, shape, dtype, zero=False)
        self._prefix = _Prefixes(self.cpu, self._dev)
        self._busy = threading.Lock()
        renew_locks_after_fork(self, "_busy")

    def uva(self, n: int | None = None) -> torch.Tensor:
        """Device memory holding ``.cpu[:n]`` as it is now."""
        cpu, dev = self._prefix.get(_check_n(n, self.cpu.shape[0]))
        if self._busy.locked():
            raise _busy_error("NonUvaBuffer.uva")
        # Held by a one-line ``with`` (released whatever interrupts the copy; see _host). Two
        # threads that both pass the check above are serialized here, as two calls in a row.
        with self._busy: self._backend.copy_h2d(dev, cpu, pinned=self._pinned)  # noqa: E701
        return dev


def _moved(what: str) -> ValueError:
    return ValueError(
        f"this {what}'s .cpu no longer uses the pinned memory it was made with: its storage "
        "was moved (share_memory_(), or torch.multiprocessing sending it to another process, "
        "copies it into shared pageable memory), so .cpu, .np and the device view disagree. "
        "Don't share pinstage buffers between processes; send a copy (t.clone()) instead")


def _busy_error(what: str) -> BusyError:
    return BusyError(f"{what} was called from two threads at once; this object serves one "
                        "thread at a time (give each thread its own, or guard it with a lock)")


class _Ring:
    """One thread's slots of a :class:`UvaBufferPool` and the fences of their hand-outs."""

    __slots__ = ("slots", "events", "curr", "last", "last_stream")

    def __init__(self, n: int) -> None:
        self.slots: list[UvaBuffer | NonUvaBuffer | None] = [None] * n
        self.events: list[Fence | None] = [None] * n
        self.curr = -1
        self.last: int | None = None  # the slot of the latest hand-out
        self.last_stream: Any = None  # the stream current at that hand-out


_SLOTS_UP_FRONT = 8


class UvaBufferPool:
    """Round-robin device-visible staging slots whose reuse is fenced.

    At each hand-out the pool records an event for the previous one, on the stream that was
    current at that hand-out (where the caller queued its readers); a slot is rewritten only
    after its event has completed, so reuse never changes data the device may still read.
    Each thread rotates over its own slots, so threads never receive one another's data.
    """

    def __init__(self, size: Any, dtype: torch.dtype, max_concurrency: int | None = None,
                 device: Any = None) -> None:
        self.dtype = check_dtype(dtype)
        self.size = check_shape(size, dtype=dtype)
        self.max_concurrency = check_concurrency(
            _DEFAULT_MAX_CONCURRENCY if max_concurrency is None else max_concurrency)
        self._backend = backend = get_backend(device)
        self._state: DeviceState = device_state(backend)
        self.device = backend.device
        self.caps: Capabilities = capabilities_for(backend)
        self._local = threading.local()
        ring = self._ring()
        # This thread's first slots are made up front (the hot path then pins nothing); the
        # rest on first use, so a large max_concurrency costs nothing until it is used.
        for i in range(min(self.max_concurrency, _SLOTS_UP_FRONT)):
            ring.slots[i] = self._new_slot(self.size)

    def _ring(self) -> _Ring:
        ring: _Ring | None = getattr(self._local, "ring", None)
        if ring is None:
            ring = self._local.ring = _Ring(self.max_concurrency)
        return ring

    def _new_slot(self, shape: tuple[int, ...]) -> UvaBuffer | NonUvaBuffer:
        cls = UvaBuffer if self.caps.uva else NonUvaBuffer
        with torch.inference_mode(False):
            return cls(shape, self.dtype, self.device)

    def _source(self, x: Any) -> HostSource:
        src = HostSource(x, self.dtype, self._backend, what="x")
        if len(src.shape) == 0:
            raise ValueError(f"x must have at least one dimension (rows), got a scalar {x!r}")
        if src.shape[1:] != self.size[1:]:
            raise ValueError(f"x has shape {src.shape}; its trailing dimensions must be "
                             f"{self.size[1:]} (the pool's size is {self.size})")
        return src

    def _take(self, rows: int) -> UvaBuffer | NonUvaBuffer:
        """This thread's next slot, once the device is done with it; grown when too small."""
        backend = self._backend
        refuse_capture(backend, "UvaBufferPool")
        ring = self._ring()
        state = self._state
        state.collect()  # cheap when nothing was dropped: dropped slots go back once read
        if ring.last is not None:  # fence the previous hand-out's readers, on their stream
            ring.events[ring.last] = state.fence(ring.last_stream)
        curr = ring.curr = (ring.curr + 1) % self.max_concurrency
        fence = ring.events[curr]
        if fence is not None:
            state.wait(fence)  # a host stall only if the device still reads it
            ring.events[curr] = None
        ring.last = curr
        ring.last_stream = backend.current_stream()
        slot = ring.slots[curr]
        if slot is None or rows > slot.cpu.shape[0]:
            cap = max(self.size[0], 1 << max(rows - 1, 0).bit_length())
            # the old slot is unused now (its event completed): dropping it frees its memory
            slot = ring.slots[curr] = self._new_slot((cap, *self.size[1:]))
        return slot

    def _fill(self, src: HostSource) -> tuple[UvaBuffer | NonUvaBuffer, int]:
        rows = src.shape[0]
        slot = self._take(rows)
        if slot._bytes is not None and src.nbytes:
            src.write_into(*slot._bytes, 0)  # host write into the fenced slot
        return slot, rows

    def copy_to_uva(self, x: Any) -> torch.Tensor:
        """A device-visible tensor with ``len(x)`` rows holding ``x``."""
        slot, rows = self._fill(self._source(x))
        return slot.uva(rows)

    def copy_to_gpu(self, x: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        """Device-resident memory (not aliasing host memory) holding ``x``; ``out`` if given."""
        src = self._source(x)
        src_shape = src.shape
        if out is not None:
            check_out(out, self.device, src_shape, self.dtype)
        slot, rows = self._fill(src)
        backend = self._backend
        dst = out if out is not None else _device(backend, src_shape, self.dtype, zero=False)
        if isinstance(slot, UvaBuffer):
            backend.copy_d2d(dst, slot.uva(rows))  # UVA view -> device
        else:
            host = slot._prefix.get(rows)[0]  # slot.cpu[:rows]
            backend.copy_h2d(dst, host, pinned=slot._pinned)  # host -> device
        return dst


class UvaBackedTensor:
    """``.cpu`` (ordinary host memory, the source of truth) uploaded through a
    :class:`UvaBufferPool`; ``.gpu`` is the device-visible copy of the last upload."""

    def __init__(self, size: Any, dtype: torch.dtype, max_concurrency: int | None = None,
                 device: Any = None) -> None:
        self.dtype = check_dtype(dtype)
        shape = check_shape(size, dtype=dtype)
        self.pool = UvaBufferPool(shape, dtype, max_concurrency, device)
        self.device = self.pool.device
        self.cpu = _host(self.pool._backend, shape, dtype, False)
        self.np = _numpy(self.cpu)
        self.gpu = self.pool.copy_to_uva(self.cpu)

    def copy_to_uva(self, n: int | None = None) -> torch.Tensor:
        """Upload ``.cpu[:n]``; updates and returns ``.gpu``."""
        n = _check_n(n, self.cpu.shape[0])
        gpu = self.gpu = self.pool.copy_to_uva(self.cpu[:n])
        return gpu
