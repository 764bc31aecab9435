"""A simulated CUDA: unmodified GPU code runs on the CPU, in stream order, and its async bugs
become deterministic errors.

Layers (FakeTensor's split, plus a clock):

* ``_tensor`` - the device tensor type (a wrapper subclass reporting ``cuda:i`` whose data is
  host memory) and the function mode that catches ``device="cuda"`` factories, pinning and
  ``.to()``;
* ``_sched`` - streams, events and queued operations; hazards;
* ``_api`` - ``torch.cuda`` as the program sees it while the simulator is open (devices,
  streams, events, graphs, the driver calls pinstage makes).

:class:`Simulator` ties them together; :func:`simulated_accelerator` opens one.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._backend import explicit_wait_active
from .._errors import HazardError
from ._sched import (
    MAX_QUEUED,
    Op,
    PinnedBlock,
    Registration,
    SimStream,
    caller_is_pinstage,
    run_op,
)

__all__ = ["MODES", "HazardError", "SimStats", "Simulator", "active", "current",
           "simulated_accelerator"]

MODES = ("eager", "lazy", "random")
POLLS_BEFORE_PROGRESS = 16  # query() calls on unfinished work before the device "catches up"


@dataclass
class SimStats:
    """Counters of simulated device work. ``host_stalls``: host waits for unfinished device
    work inside pinstage calls, and copies from pageable memory (they block the host on a real
    device); ``syncs``: every host wait, explicit ones included."""

    copies: int = 0  # host -> device transfers, pinned or pageable
    pageable_copies: int = 0  # of which from pageable memory (blocking)
    d2h_copies: int = 0
    d2d_copies: int = 0
    launches: int = 0  # device operations (kernels) and sim.launch calls
    host_stalls: int = 0
    syncs: int = 0
    events: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class _Ranges:
    """Live host memory ranges (start -> (end, owner)), for 'is this pointer pinned'."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._items: dict[int, tuple[int, Any]] = {}
        self._lock = threading.RLock()  # a block's __del__ may run inside add() (GC)

    def add(self, start: int, end: int, owner: Any, weak: bool = False) -> None:
        """``weak``: the range lives as long as ``owner`` does (torch-pinned blocks)."""
        ref = weakref.ref(owner) if weak else (lambda: owner)
        with self._lock:
            if start not in self._items:
                bisect.insort(self._starts, start)
            self._items[start] = (end, ref)

    def remove(self, start: int) -> Any:
        with self._lock:
            item = self._items.pop(start, None)
            if item is not None:
                del self._starts[bisect.bisect_left(self._starts, start)]
            return None if item is None else item[1]()

    def find(self, ptr: int) -> Any:
        with self._lock:
            i = bisect.bisect_right(self._starts, ptr) - 1
            if i < 0:
                return None
            end, ref = self._items[self._starts[i]]
            return ref() if ptr < end else None


_ACTIVE: Simulator | None = None


def current() -> Simulator | None:
    """The open simulator, or ``None``."""
    return _ACTIVE


def active() -> Simulator:
    """The open simulator (``RuntimeError`` when none is)."""
    if _ACTIVE is None:
        raise RuntimeError("no simulated accelerator is open (use "
                           "pinstage.testing.simulated_accelerator())")
    return _ACTIVE


class _Tls(threading.local):
    def __init__(self) -> None:
        self.device: dict[int, int] = {}  # simulator id -> current device index
        self.stream: dict[tuple[int, int], SimStream] = {}  # (sim id, index) -> stream


_tls = _Tls()


class Simulator:
    """A simulated CUDA process state; see :func:`simulated_accelerator`."""

    def __init__(self, mode: str = "lazy", seed: int = 0, pin_memory: bool = True,
                 uva: bool = True, device_count: int = 1) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        if isinstance(device_count, bool) or not isinstance(device_count, int) or \
                device_count < 1:
            raise ValueError(f"device_count must be an int >= 1, got {device_count!r}")
        self.mode = mode
        self.seed = seed
        self.pin_memory = bool(pin_memory)
        self.uva = bool(uva)
        self.device_count = device_count
        self.device = torch.device("cuda", 0)
        self.stats = SimStats()
        self.lock = threading.RLock()
        self.pinned = _Ranges()  # torch-pinned blocks and pinstage registrations
        self.closed = False
        self.sticky_error: str | None = None
        self.sync_debug_mode = 0
        self._rng = np.random.default_rng(seed)
        self._ids = itertools.count(1)
        self._streams: list[SimStream] = []
        self._defaults = [SimStream(_sim=self, _index=i) for i in range(device_count)]
        self._backends: dict[int, Any] = {}
        self._capturing = 0
        self._polls: dict[tuple[int, int], int] = {}

    # -- devices and streams -----------------------------------------------------------------
    def new_stream_id(self) -> int:
        return next(self._ids) - 1

    def device_index(self, device: Any = None) -> int:
        """The index ``device`` names (``None``/``"cuda"``: the current device)."""
        if device is None:
            return self.current_device()
        if isinstance(device, SimStream):
            return device.device_index
        if isinstance(device, int) and not isinstance(device, bool):
            index: int | None = device
        else:
            dev = torch.device(device)
            if dev.type != "cuda":
                raise ValueError(f"expected a cuda device, got {dev}")
            index = dev.index
        if index is None:
            return self.current_device()
        if not 0 <= index < self.device_count:
            raise RuntimeError(f"CUDA error: invalid device ordinal (cuda:{index}; the "
                               f"simulator has {self.device_count} device(s))")
        return index

    def current_device(self) -> int:
        return _tls.device.get(id(self), 0)

    def set_device(self, index: int) -> None:
        _tls.device[id(self)] = self.device_index(index)

    def current_stream(self, device: Any = None) -> SimStream:
        index = self.device_index(device)
        return _tls.stream.get((id(self), index)) or self._defaults[index]

    def default_stream(self, device: Any = None) -> SimStream:
        return self._defaults[self.device_index(device)]

    def set_stream(self, stream: SimStream) -> None:
        _tls.stream[(id(self), stream.device_index)] = stream

    def register_stream(self, stream: SimStream) -> None:
        with self.lock:
            self._streams.append(stream)

    def all_streams(self) -> list[SimStream]:
        return [*self._defaults, *self._streams]

    def backend_for(self, index: int) -> Any:
        """pinstage's CUDA backend for simulated device ``index`` (the real CUDA backend code,
        over the simulated driver)."""
        with self.lock:
            backend = self._backends.get(index)
            if backend is None:
                from .._cuda import CudaBackend
                from ._api import SimDriver

                backend = self._backends[index] = CudaBackend(index, driver=SimDriver(self))
            return backend

    @property
    def backend(self) -> Any:
        """pinstage's backend for ``cuda:0``."""
        return self.backend_for(0)

    # -- host memory -------------------------------------------------------------------------
    def registration_of(self, t: torch.Tensor) -> Registration | None:
        owner = self.pinned.find(t.data_ptr()) if t.numel() else None
        return owner if isinstance(owner, Registration) else None

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.numel() > 0 and self.pinned.find(t.data_ptr()) is not None

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Host memory pinned by torch's (simulated) caching allocator."""
        if not self.pin_memory:
            raise RuntimeError("Cannot access accelerator device when none is available. "
                               "(the simulator was opened with pin_memory=False: pinning "
                               "fails as on a machine that cannot pin)")
        n = int(np.prod(shape, dtype=np.int64))
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        block = PinnedBlock(self, nbytes)
        raw = torch.from_numpy(np.asarray(block))
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return raw.view(dtype).view(shape)

    # -- queue -------------------------------------------------------------------------------
    def check_not_capturing(self, what: str) -> None:
        if self._capturing:
            raise RuntimeError(f"CUDA error: operation not permitted when stream is capturing "
                               f"({what} during CUDA graph capture; simulated)")

    def capturing_any(self) -> bool:
        return self._capturing > 0

    def enqueue(self, stream: SimStream, op: Op, count: str | None = "launches") -> None:
        """Queue ``op`` on ``stream`` (or record it into the graph capturing ``stream``)."""
        if self.closed:
            raise RuntimeError("a simulated CUDA tensor was used after its simulator closed")
        if stream._sim is not self:
            raise RuntimeError(f"{stream!r} belongs to a simulator that has closed; make "
                               "streams inside the simulator that uses them")
        if self.sticky_error is not None:
            err, self.sticky_error = self.sticky_error, None
            raise RuntimeError(f"CUDA error: {err} (a sticky error left by an earlier failed "
                               "driver call that nobody cleared; simulated)")
        with self.lock:
            if count is not None:
                setattr(self.stats, count, getattr(self.stats, count) + 1)
            if stream._capture is not None:
                stream._capture._ops.append(op)
                return
            if len(stream._queue) >= MAX_QUEUED:  # the launch queue is full: the host waits
                self._stall(caller_is_pinstage() and not explicit_wait_active())
                self._run_until(stream, stream._queue[0].seq)
            stream._last += 1
            op.stream, op.seq = stream, stream._last
            stream._queue.append(op)
            if self.mode == "eager":
                self._run_until(stream, op.seq)
            elif self.mode == "random":
                self.maybe_progress()

    def maybe_progress(self) -> None:
        """Random mode: run a random number of ready operations, on random streams."""
        if self.mode != "random":
            return
        with self.lock:
            pending = sum(len(s._queue) for s in self.all_streams())
            if not pending or self._rng.random() < 0.6:
                return  # a device usually runs behind the host: often nothing moves
            steps = int(self._rng.integers(1, pending + 1))
            for _ in range(steps):
                ready = [s for s in self.all_streams() if s._queue and all(
                    d._done >= q for d, q in s._queue[0].deps)]
                if not ready:
                    return
                s = ready[int(self._rng.integers(0, len(ready)))]
                self._run_until(s, s._queue[0].seq)

    def poll(self, stream: SimStream, seq: int) -> bool:
        """A host polling ``query()``: a real device gets there eventually, so after a few
        polls of unfinished work (counted per point), the simulator runs it."""
        key = (id(stream), seq)
        n = self._polls.get(key, 0) + 1
        self._polls[key] = n
        if n < POLLS_BEFORE_PROGRESS:
            return False
        self._polls.pop(key, None)
        self._run_until(stream, seq)
        return True

    def _run_until(self, stream: SimStream, seq: int) -> None:
        while stream._done < seq and stream._queue:
            op = stream._queue[0]
            for dep_stream, dep_seq in op.deps:
                if dep_stream._done < dep_seq:
                    self._run_until(dep_stream, dep_seq)
            if stream._queue and stream._queue[0] is op:
                stream._queue.popleft()
                stream._done = op.seq
                run_op(self, op)

    def _stall(self, in_pinstage: bool) -> None:
        self.stats.syncs += 1
        if in_pinstage:
            self.stats.host_stalls += 1

    def host_wait(self, stream: SimStream, seq: int, what: str, explicit: bool = False,
                  in_pinstage: bool | None = None) -> None:
        """The host waits until ``stream`` has run up to ``seq``."""
        self.check_not_capturing(what)
        with self.lock:
            pending = stream._done < seq
            if in_pinstage is None:
                in_pinstage = caller_is_pinstage() and not explicit_wait_active()
            if pending:
                self._stall(in_pinstage)
            else:
                self.stats.syncs += 1
            self._run_until(stream, seq)

    def synchronize(self, device: Any = None) -> None:
        """Run everything queued (on ``device``, default all devices); not a host stall."""
        self.check_not_capturing("synchronize()")
        with self.lock:
            self.stats.syncs += 1
            index = None if device is None else self.device_index(device)
            streams = [s for s in self.all_streams() if index is None or
                       s.device_index == index]
            while any(s._queue for s in streams):
                for s in streams:
                    self._run_until(s, s._last)

    @property
    def pending(self) -> int:
        """How many queued device operations have not run yet."""
        return sum(len(s._queue) for s in self.all_streams())

    def launch(self, fn: Callable[..., Any], *args: Any,
               writes: tuple[torch.Tensor, ...] | list[torch.Tensor] = (),
               **kwargs: Any) -> None:
        """Queue ``fn(*args, **kwargs)`` as one kernel on the current stream. Device-tensor
        arguments reach ``fn`` as plain tensors over their memory; arguments in host memory
        (UVA views, pinned tensors) are checked for host changes before it runs."""
        from ._tensor import launch as _launch

        _launch(self, fn, args, kwargs, tuple(writes))

    def close(self) -> None:
        """After the final synchronize: give back pinned memory pinstage parked for these
        devices (everything that read it has run), then refuse further use."""
        from .._memory import device_state

        for backend in list(self._backends.values()):
            device_state(backend).collect()
        self.closed = True


def _after_fork_in_child() -> None:
    """A child forked while another thread was inside the simulator: that thread is gone, so
    the locks it held are made anew (its half-run operation is simply not run)."""
    sim = _ACTIVE
    if sim is not None:
        sim.lock = threading.RLock()
        sim.pinned._lock = threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _set_active(sim: Simulator | None) -> None:
    global _ACTIVE
    _ACTIVE = sim


@contextlib.contextmanager
def simulated_accelerator(mode: str = "lazy", seed: int = 0, pin_memory: bool = True,
                          uva: bool = True, device_count: int = 1) -> Iterator[Simulator]:
    """Open a simulated CUDA with ``device_count`` devices; yields the :class:`Simulator`.

    While open, ``torch.cuda`` answers for the simulated devices, tensors made with
    ``device="cuda"`` live in host memory but report ``cuda``, and every operation on them is
    queued on its stream and run per ``mode``. On leaving, everything queued runs (a hazard
    raises there at the latest) and ``torch.cuda`` is restored.
    """
    from . import _api, _tensor

    if _ACTIVE is not None:
        raise RuntimeError("a simulated accelerator is already open (one at a time)")
    from .. import _backend

    sim = Simulator(mode, seed, pin_memory, uva, device_count)
    _set_active(sim)
    restore = _api.install(sim)
    _backend.SIM_STACK.append(sim)
    leave_modes = _tensor.enter_modes(sim)
    _tensor.spread_to_new_threads(sim)
    ok = False
    try:
        yield sim
        ok = True
    finally:
        try:
            if ok:
                sim.synchronize()
            else:
                with contextlib.suppress(HazardError, RuntimeError):
                    sim.synchronize()  # the first error wins
        finally:
            _tensor.stop_spreading()
            try:
                sim.close()
            finally:
                leave_modes()
                restore()
                _backend.SIM_STACK.remove(sim)
                _set_active(None)
