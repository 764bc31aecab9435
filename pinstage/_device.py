"""The device seam: the one interface through which every primitive does its device work.

A :class:`Backend` is a stateless strategy over one device: what it can do (``probe``), its
memory primitives (registering host memory, UVA views, device allocations), its device work
(copies, launches on the current stream) and its raw events. Every method is abstract: a
backend that forgets one fails when it is made, never by passing tests. What a device
accumulates (the staging arena, the probe's memo, fences, counters) lives in its
:class:`~pinstage._state.DeviceState`.

Ordering is explicit: a :class:`Fence` names the work it waits for (``done()`` never waits,
``wait_host()`` makes the host wait). Fences are made by the device state from the raw events
here, one stream at a time; :class:`AllOf` joins several; :data:`DONE` is the fence of a
device whose work has always finished (the CPU target).

Implementations: ``_cpu.CpuBackend`` and ``_cpu.GenericBackend``; ``_cuda.CudaBackend`` (CUDA
and ROCm, over a driver object: the real runtime, or the simulated CUDA's). This module imports
none of them.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._errors import CaptureError

__all__ = ["Backend", "Probe", "Fence", "AllOf", "DONE", "Stream", "Event", "HOST_STREAM",
           "HOST_EVENT", "SyncDevice", "refuse_capture"]

Stream = Hashable  # a backend's stream handle (torch.cuda.Stream, the host's one stream...)
Event = Any  # a backend's raw event handle, only ever passed back to that backend


@dataclass(frozen=True)
class Probe:
    """Platform facts a backend found for its device (policy is applied later)."""

    accelerator: bool
    can_pin: bool
    uva: bool
    reasons: tuple[str, ...] = ()
    staging_limit: int | None = None  # a platform-imposed default cap (e.g. WSL)


class Fence(abc.ABC):
    """The point after some device work: ``done()`` says whether it has completed (never
    waits); ``wait_host()`` makes the host wait until it has."""

    __slots__ = ()

    @abc.abstractmethod
    def done(self) -> bool:
        """Whether the fenced work has completed."""

    @abc.abstractmethod
    def wait_host(self) -> None:
        """Block the host until the fenced work has completed."""


class _Done(Fence):
    __slots__ = ()

    def done(self) -> bool:
        return True

    def wait_host(self) -> None:
        return None

    def __repr__(self) -> str:
        return "DONE"


DONE: Fence = _Done()  # nothing to wait for


class AllOf(Fence):
    """Several fences (one per stream) that together fence one thing."""

    __slots__ = ("fences",)

    def __init__(self, fences: Sequence[Fence]) -> None:
        self.fences = tuple(f for f in fences if f is not DONE)

    def done(self) -> bool:
        return all(f.done() for f in self.fences)

    def wait_host(self) -> None:
        for f in self.fences:
            f.wait_host()

    def __repr__(self) -> str:
        return f"AllOf({list(self.fences)!r})"


class Backend(abc.ABC):
    """What a primitive may ask of one device. Copies and launches go on the current stream.

    ``accelerator``: the target is not the host. ``asynchronous``: device work may still be
    running when a call returns (then events matter). ``checks_deferred_reads``: the backend
    wants host values pinstage reads later than it was handed them (a staged list's elements)
    verified then (the simulated CUDA does; real devices cannot afford it)."""

    device: torch.device
    name: str
    accelerator: bool
    asynchronous: bool
    checks_deferred_reads: bool = False

    # -- facts -------------------------------------------------------------------------------
    @abc.abstractmethod
    def probe(self, alloc_pinned: Callable[[int], torch.Tensor]) -> Probe:
        """Platform facts for this device (the device state runs it once). ``alloc_pinned``
        gives pinned test memory through the device's own accounting."""

    # -- memory ------------------------------------------------------------------------------
    @abc.abstractmethod
    def register_host(self, ptr: int, size: int) -> None:
        """Pin (page-lock and map) the host range ``[ptr, ptr+size)`` for this device;
        ``UnavailableError`` where impossible, ``DriverError`` when the driver refuses."""

    @abc.abstractmethod
    def unregister_host(self, ptr: int, size: int) -> None:
        """Undo :meth:`register_host` (the device no longer reads the range)."""

    @abc.abstractmethod
    def is_pinned(self, t: torch.Tensor) -> bool:
        """Whether host tensor ``t`` is pinned for this device."""

    @abc.abstractmethod
    def is_device_tensor(self, t: torch.Tensor) -> bool:
        """True for tensors that live on this target (never true for host inputs)."""

    @abc.abstractmethod
    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised device memory."""

    @abc.abstractmethod
    def zeros(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Zero-filled device memory (the fill is device work on the current stream)."""

    @abc.abstractmethod
    def uva_view(self, host: torch.Tensor) -> torch.Tensor:
        """A device tensor aliasing pinned, contiguous ``host`` memory."""

    # -- device work -------------------------------------------------------------------------
    @abc.abstractmethod
    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, pinned: bool = False) -> None:
        """host -> device; asynchronous when ``src`` is pinned and contiguous (``pinned``:
        the caller knows it is, e.g. staging memory, so the backend need not ask)."""

    @abc.abstractmethod
    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """device -> host; asynchronous when ``dst`` is pinned."""

    @abc.abstractmethod
    def copy_d2d(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """device -> device (or UVA view -> device), on the current stream."""

    @abc.abstractmethod
    def launch(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)``, a kernel made of torch ops on device tensors, on the current
        stream."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait for all device work on this device (an explicit wait, not a stall)."""

    @abc.abstractmethod
    def is_capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph (then staging through
        recycled memory must be refused: a replay would read whatever is there later)."""

    @abc.abstractmethod
    def capture_underway(self, streams: Iterable[Stream]) -> bool:
        """Whether a graph capture that forbids event queries, event records and host-memory
        registration may be under way on this device: on the current stream, on ``streams``
        (those pinstage used), or (where the driver can tell) in any thread. Housekeeping
        (collecting parked memory, reclaiming staging) waits while it is: in CUDA's default
        "global" capture mode such a call from any thread invalidates the capture."""

    # -- streams and raw events --------------------------------------------------------------
    @abc.abstractmethod
    def current_stream(self) -> Stream:
        """A hashable handle of this device's current stream (of the calling thread)."""

    @abc.abstractmethod
    def new_event(self) -> Event:
        """A new event (cheap to record again once its last record has completed)."""

    @abc.abstractmethod
    def record_event(self, event: Event, stream: Stream) -> None:
        """Record ``event`` on ``stream``, after all work queued on it so far. It fences that
        stream only: work queued on other streams is not covered."""

    @abc.abstractmethod
    def event_done(self, event: Event) -> bool:
        """Whether the work before ``event``'s last record has completed (never waits)."""

    @abc.abstractmethod
    def wait_event_host(self, event: Event) -> None:
        """Block the host until the work before ``event``'s last record has completed."""

    @abc.abstractmethod
    def deferred_read_changed(self, message: str) -> Exception:
        """The error for a deferred host read found changed (see ``checks_deferred_reads``)."""


HOST_STREAM: Stream = "host"  # the one "stream" of a device whose work finishes at once
HOST_EVENT: Event = "host-event"  # its events: complete from the moment they are made


class SyncDevice:
    """Streams and events for a backend whose work finishes before each call returns (the
    CPU target; blocking torch copies on other device types): every event is complete. Named
    in each such backend's bases, never a default."""

    asynchronous = False

    def current_stream(self) -> Stream:
        return HOST_STREAM

    def new_event(self) -> Event:
        return HOST_EVENT

    def record_event(self, event: Event, stream: Stream) -> None:
        return None

    def event_done(self, event: Event) -> bool:
        return True

    def wait_event_host(self, event: Event) -> None:
        return None


def refuse_capture(backend: Backend, what: str) -> None:
    """``CaptureError`` while the current stream captures a CUDA graph: ``what`` stages data
    in memory that is reused after the call, so a replayed copy would read stale or foreign
    data."""
    if backend.is_capturing():
        raise CaptureError(f"{what} cannot be captured in a CUDA graph: it stages data in "
                           "pinned memory that is reused after the call, so a replay would "
                           "read stale data; upload before capturing, or capture copies "
                           "between persistent buffers (CpuGpuBuffer.copy_to_gpu)")
