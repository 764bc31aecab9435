"""The simulated device's clock: streams, events, queued operations, hazards.

Each simulated stream is a FIFO of :class:`Op`. Work on one stream runs in order; an op that
waits on an event (``Stream.wait_event``) also needs the other stream to have reached the
event's point. Nothing runs on its own: the host drives execution, at once (``"eager"``), only
when it has to wait (``"lazy"``), or also at seeded random points (``"random"``), which then
explores the orders the events allow.

Every read of host memory by queued work (a copy from pinned memory, a kernel reading a UVA
view) is snapshotted when queued and compared when it runs; memory pinstage registered and
then unregistered before the read ran is reported too. Both raise :class:`HazardError`.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._errors import HazardError

if TYPE_CHECKING:
    from . import Simulator

__all__ = ["Op", "HostRead", "SimStream", "SimEvent", "Registration", "PinnedBlock",
           "MAX_QUEUED", "poison_", "host_bytes"]

MAX_QUEUED = 1024  # per stream, like a GPU's launch queue: one more makes the host wait

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_SIM_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_QUIET = (_SIM_DIR, _TORCH, os.path.join(_PKG, "testing.py"))
_NOT_PINSTAGE_CALLS = (os.path.join(_PKG, "bench.py"), os.path.join(_PKG, "cli.py"))


def poison_(t: torch.Tensor) -> None:
    """Fill ``t`` with an obviously wrong value: NaN for floats, the dtype's minimum for signed
    integers, its maximum for unsigned ones (what a destination holds until the device
    writes it)."""
    if t.numel() == 0:
        return
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    elif torch.iinfo(t.dtype).min == 0:  # unsigned: the minimum (0) would look like data
        t.fill_(torch.iinfo(t.dtype).max)
    else:
        t.fill_(torch.iinfo(t.dtype).min)


def host_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (so NaN == NaN when comparing snapshots)."""
    flat = t.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(torch.uint8) if flat.dtype != torch.bool else flat


def span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range of memory ``t`` may touch."""
    if t.numel() == 0:
        return (t.data_ptr(), t.data_ptr())
    size = t.element_size()
    lo = hi = t.data_ptr()
    for n, st in zip(t.shape, t.stride()):
        if st >= 0:
            hi += (n - 1) * st * size
        else:
            lo += (n - 1) * st * size
    return (lo, hi + size)


class Registration:
    """Host memory pinstage registered with the (simulated) driver. Queued reads hold this,
    not the memory: if it is unregistered before they run, that is a use-after-free."""

    __slots__ = ("alive", "ptr", "size")

    def __init__(self, ptr: int, size: int) -> None:
        self.ptr, self.size, self.alive = ptr, size, True


class PinnedBlock:
    """Host memory that torch's (simulated) caching host allocator pinned: ``pin_memory=True``,
    ``Tensor.pin_memory()``. Queued reads keep it alive, as torch's allocator does on CUDA."""

    def __init__(self, sim: Simulator, nbytes: int) -> None:
        self._buf = np.zeros(max(nbytes, 1) + 64, dtype=np.uint8)
        base = self._buf.ctypes.data
        self.ptr = (base + 63) // 64 * 64
        self.nbytes = nbytes
        self._sim = sim
        self.__array_interface__ = {"data": (self.ptr, False), "shape": (nbytes,),
                                    "typestr": "|u1", "version": 3}
        sim.pinned.add(self.ptr, self.ptr + max(nbytes, 1), self, weak=True)

    def __del__(self) -> None:
        try:
            self._sim.pinned.remove(self.ptr)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _from_address(ptr: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over raw host memory (used only while its registration is alive)."""
    buf = (ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr)
    return torch.from_numpy(np.ctypeslib.as_array(buf)[:nbytes])


@dataclass
class HostRead:
    """One read of host memory by queued work, checked when the work runs."""

    what: str
    tensor: torch.Tensor | None  # held (torch-pinned or pageable memory) ...
    reg: Registration | None  # ... or only described (pinstage-registered memory)
    layout: tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype, int] | None
    snapshot: torch.Tensor | None
    span: tuple[int, int]
    frozen: torch.Tensor | None = None  # the values it will read, taken before poisoning

    @classmethod
    def of(cls, sim: Simulator, t: torch.Tensor, what: str, snapshot: bool = True) -> HostRead:
        reg = sim.registration_of(t)
        sp = span(t)
        snap = host_bytes(t).clone() if snapshot else None
        if reg is None:
            return cls(what, t, None, None, snap, sp)
        layout = (sp[0], tuple(t.shape), tuple(t.stride()), t.dtype,
                  (t.data_ptr() - sp[0]) // max(t.element_size(), 1))
        return cls(what, None, reg, layout, snap, sp)

    def resolve(self, label: str) -> torch.Tensor:
        """The memory, now; a hazard if pinstage unregistered (freed) it meanwhile."""
        if self.tensor is not None:
            return self.tensor
        assert self.reg is not None and self.layout is not None  # noqa: S101 - internal
        if not self.reg.alive:
            raise HazardError(
                f"{label}: the {self.what} (pinned host memory at {self.span[0]:#x}, "
                f"{self.span[1] - self.span[0]} bytes, registered by pinstage) was "
                "unregistered/freed before this queued work read it; on a real device the "
                "copy reads freed memory")
        lo, shape, stride, dtype, offset = self.layout
        raw = _from_address(lo, self.span[1] - lo)
        itemsize = torch.empty((), dtype=dtype).element_size()
        pad = (-raw.numel()) % itemsize
        if pad:
            raw = torch.cat([raw, raw.new_zeros(pad)])
        return raw.view(dtype).as_strided(shape, stride, offset)

    def freeze(self, label: str) -> None:
        """The simulator is about to poison memory this pending read covers (a device-to-host
        destination queued after it): by stream order the read happens first, so keep what
        it will see now (unless the host already changed it: that hazard still raises)."""
        if self.frozen is not None:
            return
        t = self.resolve(label)
        if self.snapshot is None or torch.equal(host_bytes(t), self.snapshot):
            self.frozen = t.clone()

    def check(self, label: str) -> torch.Tensor:
        if self.frozen is not None:
            return self.frozen
        t = self.resolve(label)
        if self.snapshot is not None and not torch.equal(host_bytes(t), self.snapshot):
            raise HazardError(
                f"{label}: the {self.what} (host memory at {self.span[0]:#x}, shape "
                f"{tuple(t.shape)}, {t.dtype}) was changed by the host after the work was "
                "queued and before it ran; on a real device the work would see the new values")
        return t


class Op:
    """One queued device operation."""

    __slots__ = ("deps", "fn", "host_writes", "label", "reads", "seq", "stream")

    def __init__(self, label: str, fn: Callable[[list[torch.Tensor]], Any] | None,
                 reads: list[HostRead] | None = None,
                 deps: list[tuple[SimStream, int]] | None = None,
                 host_writes: list[tuple[int, int]] | None = None) -> None:
        self.label = label
        self.fn = fn  # called with the checked host reads, in order
        self.reads = reads or []
        self.deps = deps or []
        self.host_writes = host_writes or []
        self.stream: SimStream | None = None
        self.seq = 0


class SimStream:
    """``torch.cuda.Stream`` while a simulator is open: a FIFO of device work."""

    def __init__(self, device: Any = None, priority: int = 0, *, _sim: Simulator | None = None,
                 _index: int | None = None) -> None:
        from . import active

        sim = _sim or active()
        if _index is None:
            _index = sim.device_index(device)
        self._sim = sim
        self.device_index = _index
        self.device = torch.device("cuda", _index)
        self.priority = priority
        self.stream_id = sim.new_stream_id()
        self.cuda_stream = 0x5100_0000 + self.stream_id
        self._queue: deque[Op] = deque()
        self._done = 0
        self._last = 0
        self._capture: Any = None  # the CUDAGraph capturing this stream, if any

    # -- torch.cuda.Stream API -----------------------------------------------------------------
    def wait_event(self, event: SimEvent) -> None:
        """Work queued on this stream from now on waits for ``event``'s point."""
        if event._stream is None:
            return
        self._sim.enqueue(self, Op(f"wait for an event of stream {event._stream.stream_id}",
                                   None, deps=[(event._stream, event._seq)]))

    def wait_stream(self, stream: SimStream) -> None:
        """Work queued on this stream from now on waits for all work queued on ``stream``."""
        ev = SimEvent()
        ev.record(stream)
        self.wait_event(ev)

    def record_event(self, event: SimEvent | None = None) -> SimEvent:
        event = event or SimEvent()
        event.record(self)
        return event

    def query(self) -> bool:
        self._sim.check_not_capturing("Stream.query()")
        with self._sim.lock:
            self._sim.maybe_progress()
            if self._done < self._last:
                return self._sim.poll(self, self._last)
            return True

    def synchronize(self) -> None:
        self._sim.host_wait(self, self._last, "Stream.synchronize()", explicit=True)

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return hash((self.device_index, self.stream_id))

    def __repr__(self) -> str:
        return (f"<torch.cuda.Stream device={self.device} cuda_stream={self.cuda_stream:#x} "
                "(simulated)>")

    def __enter__(self) -> SimStream:
        from ._api import _stream_ctx_enter

        _stream_ctx_enter(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        from ._api import _stream_ctx_exit

        _stream_ctx_exit(self)


class SimEvent:
    """``torch.cuda.Event`` while a simulator is open: a point in one stream's queue."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False, external: bool = False) -> None:
        from . import active

        self._sim = active()
        self._stream: SimStream | None = None
        self._seq = 0
        self._captured = False
        self.enable_timing = enable_timing
        self.blocking = blocking

    def record(self, stream: SimStream | None = None) -> None:
        """Mark the point after all work queued on ``stream`` (default: current) so far."""
        if stream is not None and not isinstance(stream, SimStream):
            raise TypeError(f"Event.record() expects a torch.cuda.Stream, got {stream!r}")
        sim = self._sim = stream._sim if stream is not None else self._sim
        if sim.closed:  # a stream of a simulator that has closed: all its work has run
            self._stream = None
            return
        stream = stream if stream is not None else sim.current_stream()
        with sim.lock:
            sim.stats.events += 1
            self._stream = stream
            self._seq = stream._last
            self._captured = stream._capture is not None

    def query(self) -> bool:
        if self._captured or self._sim.capturing_any():
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing "
                               "(Event.query() during CUDA graph capture; simulated)")
        if self._stream is None:
            return True
        with self._sim.lock:
            self._sim.maybe_progress()
            if self._stream._done < self._seq:
                return self._sim.poll(self._stream, self._seq)
            return True

    def synchronize(self) -> None:
        if self._stream is None:
            return
        self._sim.host_wait(self._stream, self._seq, "Event.synchronize()", explicit=True)

    def wait(self, stream: SimStream | None = None) -> None:
        stream = stream if stream is not None else self._sim.current_stream()
        stream.wait_event(self)

    def elapsed_time(self, end_event: SimEvent) -> float:
        if not (self.enable_timing and end_event.enable_timing):
            raise ValueError("Both events must be created with argument 'enable_timing=True'")
        if self._stream is None or end_event._stream is None:
            raise RuntimeError("CUDA error: device not ready (elapsed_time of an event that "
                               "was not recorded; simulated)")
        self.synchronize()
        end_event.synchronize()
        return 0.0

    def __repr__(self) -> str:
        where = "unrecorded" if self._stream is None else \
            f"stream {self._stream.stream_id} op {self._seq}"
        return f"<torch.cuda.Event {where} (simulated)>"


def caller_is_pinstage() -> bool:
    """Whether the host wait happening now was made by pinstage code (a host stall inside a
    pinstage call) rather than by the user's own code."""
    frame: Any = sys._getframe(2)
    while frame is not None:
        fn = frame.f_code.co_filename
        if not (fn.startswith(_QUIET) or fn.startswith("<") or "contextlib" in fn):
            return fn.startswith(_PKG) and not fn.startswith(_NOT_PINSTAGE_CALLS)
        frame = frame.f_back
    return False


class _Tls(threading.local):
    running: bool = False


_tls = _Tls()


def run_op(sim: Simulator, op: Op) -> None:
    """Execute one op now (its dependencies are done): check its host reads, run it."""
    label = op.label
    tensors = [r.check(label) for r in op.reads]
    if op.fn is not None:
        if _tls.running:  # a kernel cannot wait for the device
            raise RuntimeError(f"{label}: simulated device work tried to wait for device work")
        _tls.running = True
        try:
            with torch._C.DisableTorchFunction():
                op.fn(tensors)
        finally:
            _tls.running = False
    if op.host_writes:  # later reads of what this wrote can't be checked by content
        for s in sim.all_streams():
            for later in s._queue:
                for r in later.reads:
                    if r.snapshot is not None and any(
                            r.span[0] < w[1] and w[0] < r.span[1] for w in op.host_writes):
                        r.snapshot = None
