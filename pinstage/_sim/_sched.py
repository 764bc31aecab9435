"""The simulated device's scheduler: devices, streams, events, queued operations, and the loop
that runs them, beside the data it runs over.

Each simulated stream is a FIFO of :class:`Op`. Work on one stream runs in order; an op that
waits on an event (``Stream.wait_event``) also needs the other stream to have reached the
event's point. Nothing runs on its own: the host drives execution, at once (``"eager"``), only
when it has to wait (``"lazy"``), or also at seeded random points (``"random"``), which then
explores the orders the events allow.

:class:`Scheduler` is the package-internal API the rest of the simulator uses: the current
device and stream of each thread, ``enqueue``, ``host_wait``, ``synchronize``, captures.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._callsite import in_pinstage_call
from ._hazards import HostRead
from ._races import RaceTracker, site_of
from ._races import entry as race_entry

__all__ = ["Op", "SimStream", "SimEvent", "SimStats", "Scheduler", "MAX_QUEUED", "MODES",
           "in_kernel"]

MODES = ("eager", "lazy", "random")
MAX_QUEUED = 1024  # per stream, like a GPU's launch queue: one more makes the host wait
CAPTURE_MODES = ("global", "thread_local", "relaxed")
BAD_FORK = ("Cannot re-initialize CUDA in forked subprocess. To use CUDA with "
            "multiprocessing, you must use the 'spawn' start method")
SYNC_MESSAGE = "called a synchronizing CUDA operation"
# A spin kernel (torch.cuda._sleep: at least SPIN_MS of simulated time) keeps its stream busy
# in every mode: eager and random mode run it, and what is queued behind it or waits for it,
# only when the host waits for it (or has polled it enough), as a device busy for that long
# would. Short ops run as the mode says.
SPIN_MS = 1.0
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


# The simulated device's clock: every op takes OP_MS of simulated time on its stream, and
# torch.cuda._sleep(cycles) takes cycles / CYCLES_PER_MS, so events' elapsed times are positive
# and ordered as the queued work is (host time plays no part).
OP_MS = 1e-3
CYCLES_PER_MS = 1_000_000  # a 1 GHz clock


_NO_DISPATCH = torch._C._DisableTorchDispatch  # (no __torch_dispatch__: subclass or mode)
_dispatch_modes = torch._C._len_torch_dispatch_stack
# _NO_DISPATCH's work as two switches of this thread's dispatch keys (cheaper to flip than
# the guard is to make): the keys that call a dispatch mode excluded, and whether they are
_exclude = torch._C._dispatch_tls_set_dispatch_key_excluded
_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_PYTHON_KEY = torch._C.DispatchKey.Python
_SNAPSHOT_KEY = torch._C.DispatchKey.PythonTLSSnapshot


_NO_READS: list[torch.Tensor] = []


def _call(op: Op, tensors: list[torch.Tensor]) -> None:
    """Run ``op``'s function on its checked host reads, torch's function modes off (and its
    Python dispatch too, for a plain op, when a dispatch mode would see its host ops)."""
    assert op.fn is not None
    with torch._C.DisableTorchFunction():
        if op.plain and _dispatch_modes():
            with _NO_DISPATCH():
                op.fn(tensors)
        else:
            op.fn(tensors)


class Op:
    """One queued device operation."""

    __slots__ = ("acc", "deps", "fn", "host_writes", "label", "ms", "plain", "reads", "seq",
                 "stream")

    def __init__(self, label: str, fn: Callable[[list[torch.Tensor]], Any] | None,
                 reads: list[HostRead] | None = None,
                 deps: list[tuple[SimStream, int]] | None = None,
                 host_writes: list[tuple[int, int]] | None = None,
                 acc: tuple[str, Any, Any] | None = None, ms: float = OP_MS,
                 plain: bool = False) -> None:
        self.ms = ms  # simulated time it takes on the device (events' elapsed_time)
        # plain: ``fn`` runs torch ops on host tensors only (the simulator's own kernels, not
        # a sim.launch body over device tensors): it runs with torch's Python dispatch off,
        # which the simulator's dispatch mode would otherwise see each of (~5 us apiece) when
        # the op runs outside an op's handler (lazy mode's synchronize, a host wait)
        self.plain = plain
        # acc: (what, tensors read, tensors written) in simulated memory, for the race check
        self.acc = acc
        self.label = label
        self.fn = fn  # called with the checked host reads, in order
        self.reads = reads or []
        self.deps = deps or []
        self.host_writes = host_writes or []
        self.stream: SimStream | None = None
        self.seq = 0


def _plain_kernel(label: str, fn: Callable[[list[torch.Tensor]], Any], stream: SimStream,
                  seq: int) -> Op:
    """``Op(label, fn, plain=True)`` queued at ``seq`` on ``stream``, made in fewer steps (a
    lane's kernel in lazy mode: no host reads or writes, no dependencies, no race check
    left; nothing adds to those lists: an empty tuple each, which could not be added to)."""
    op = _new_op(Op)
    op.ms, op.plain, op.acc, op.label, op.fn = OP_MS, True, None, label, fn
    op.reads = op.deps = op.host_writes = _NOTHING
    op.stream, op.seq = stream, seq
    return op


def _kernel_fn(call: Callable[..., Any], args: Any, out: torch.Tensor | None
               ) -> Callable[[list[torch.Tensor]], Any]:
    """An Op's function for :meth:`Scheduler.kernel`'s ``call(*args[, out=out])``."""
    if out is None:
        return lambda _: call(*args)
    return lambda _: call(*args, out=out)


_new_op = object.__new__
_NOTHING: Any = ()


class EventRecord(Op):
    """An ``external=True`` event recorded during a CUDA graph capture: a node of the graph,
    so each replay records the event again, on the replay's stream (its elapsed times are
    the replay's)."""

    __slots__ = ("event",)

    def __init__(self, event: SimEvent) -> None:
        super().__init__("event record (captured)", None, ms=0.0)
        self.event = event


class _GenericType(type):
    """Metaclass of :class:`TorchStream`/:class:`TorchEvent`, which ``torch.Stream`` and
    ``torch.Event`` are while a simulator is open. They are the bases of the simulated stream
    and event, so ``issubclass`` and the MRO hold as they do for ``torch.cuda.Stream``;
    calling one of them goes to its ``maker`` (set by ``_torch_cuda``); ``isinstance`` and
    ``issubclass`` accept torch's own classes too."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if "real" in cls.__dict__:  # the stand-in itself, not SimStream/SimEvent
            return (cls.__dict__["maker"] or cls.__dict__["real"])(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def __instancecheck__(cls, obj: Any) -> bool:
        real = cls.__dict__.get("real")
        return type.__instancecheck__(cls, obj) or (real is not None and isinstance(obj, real))

    def __subclasscheck__(cls, sub: Any) -> bool:
        real = cls.__dict__.get("real")
        return type.__subclasscheck__(cls, sub) or (real is not None and issubclass(sub, real))


class TorchStream(metaclass=_GenericType):
    """``torch.Stream`` while a simulator is open (``torch.Stream("cuda")`` makes a
    simulated stream, other devices torch's own)."""

    real: Any = torch.Stream
    maker: Any = None


class TorchEvent(metaclass=_GenericType):
    """``torch.Event`` while a simulator is open."""

    real: Any = torch.Event
    maker: Any = None


TorchStream.__qualname__ = TorchStream.__name__ = "Stream"
TorchEvent.__qualname__ = TorchEvent.__name__ = "Event"


class SimStream(TorchStream):
    """``torch.cuda.Stream`` while a simulator is open: a FIFO of device work."""

    def __init__(self, sched: Scheduler, index: int, priority: int = 0) -> None:
        self.sched = sched
        self.device_index = index
        self.device = torch.device("cuda", index)
        self.priority = priority
        self.stream_id = sched.new_stream_id()
        self.cuda_stream = 0x5100_0000 + self.stream_id
        self.queue: deque[Op] = deque()
        self.done = 0  # seq of the last op run
        self.last = 0  # seq of the last op queued
        self.capture: Any = None  # the CUDAGraph capturing this stream, if any
        # in a capture: the ops captured on this stream so far, and the capture-time vector
        # clock (stream id -> ops captured there that this stream's next op comes after)
        self.cap_n = 0
        self.cap_clock: dict[int, int] = {}
        self.t = 0.0  # simulated time (ms) at which the work queued so far ends

    # -- torch.cuda.Stream API -----------------------------------------------------------------
    def wait_event(self, event: SimEvent) -> None:
        """Work queued on this stream from now on waits for ``event``'s point."""
        if event.stream is None:
            return
        if event.cap is not None and event.stream.capture is not None:
            # an event of a capture: this stream joins it (CUDA's fork: its work from now on
            # is captured into the same graph, not run), ordered after the event's point
            self.sched.fork_capture(self, event.stream.capture)
            mine = self.cap_clock
            for k, v in event.cap.items():
                if k != self.stream_id and mine.get(k, 0) < v:
                    mine[k] = v
        self.t = max(self.t, event.t)
        self.sched.races.join(self, event.clock)
        self.sched.enqueue(self, Op(f"wait for an event of stream {event.stream.stream_id}",
                                    None, deps=[(event.stream, event.seq)]), None)

    def wait_stream(self, stream: SimStream) -> None:
        """Work queued on this stream from now on waits for all work queued on ``stream``."""
        ev = SimEvent(self.sched)
        ev.record(stream)
        self.wait_event(ev)

    def record_event(self, event: SimEvent | None = None) -> SimEvent:
        event = event or SimEvent(self.sched)
        event.record(self)
        return event

    def query(self) -> bool:
        sched = self.sched
        sched.check_not_capturing("Stream.query()")
        with sched.lock:
            sched.maybe_progress()
            if self.done < self.last and not sched.poll(self, self.last):
                return False
            sched.races.host_waited(self, self.last)
            return True

    def synchronize(self) -> None:
        self.sched.host_wait(self, self.last, "Stream.synchronize()")

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return hash((self.device_index, self.stream_id))

    def __repr__(self) -> str:
        return (f"<torch.cuda.Stream device={self.device} cuda_stream={self.cuda_stream:#x} "
                "(simulated)>")

    def __enter__(self) -> SimStream:
        self.sched.enter_stream(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.sched.exit_stream()


class SimEvent(TorchEvent):
    """``torch.cuda.Event`` while a simulator is open: a point in one stream's queue."""

    def __init__(self, sched: Scheduler, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False, external: bool = False) -> None:
        self.sched = sched
        self.stream: SimStream | None = None
        self.seq = 0
        self.captured = False
        self.clock: dict[int, int] | None = None  # the stream's vector clock when recorded
        self.cap: dict[int, int] | None = None  # its capture-time clock, recorded in a capture
        self.enable_timing = enable_timing
        self.blocking = blocking
        self.external = bool(external)  # recorded in a graph: again at each replay
        self.t = 0.0  # simulated time of its point

    def record(self, stream: SimStream | None = None) -> None:
        """Mark the point after all work queued on ``stream`` (default: current) so far."""
        if stream is not None and not isinstance(stream, SimStream):
            raise TypeError(f"Event.record() expects a torch.cuda.Stream, got {stream!r}")
        sched = self.sched = stream.sched if stream is not None else self.sched
        if sched.closed:  # a stream of a simulator that has closed: all its work has run
            self.stream = None
            return
        stream = stream if stream is not None else sched.current_stream()
        with sched.lock:
            sched.stats.events += 1
            self.stream = stream
            self.seq = stream.last
            self.t = stream.t
            self.captured = stream.capture is not None
            self.clock = sched.races.snapshot(stream)
            if self.captured:
                self.cap = dict(stream.cap_clock)
                self.cap[stream.stream_id] = stream.cap_n
            else:
                self.cap = None
            if self.captured and self.external:  # (a node of the graph: see EventRecord)
                stream.capture.ops.append(EventRecord(self))

    def query(self) -> bool:
        sched = self.sched
        if self.captured:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing "
                               "(Event.query() of an event recorded during CUDA graph capture; "
                               "simulated)")
        sched.check_not_capturing("Event.query()")
        stream = self.stream
        if stream is None:
            return True
        with sched.lock:
            sched.maybe_progress()
            if stream.done < self.seq and not sched.poll(stream, self.seq):
                return False
            sched.races.host_join(self.clock)
            return True

    def synchronize(self) -> None:
        if self.stream is None:
            return
        # (torch's sync debug mode does not see event synchronizations)
        self.sched.host_wait(self.stream, self.seq, "Event.synchronize()", sync_debug=False)
        self.sched.races.host_join(self.clock)

    def wait(self, stream: SimStream | None = None) -> None:
        stream = stream if stream is not None else self.sched.current_stream()
        stream.wait_event(self)

    def elapsed_time(self, end_event: SimEvent) -> float:
        if not (self.enable_timing and end_event.enable_timing):
            raise ValueError("Both events must be created with argument 'enable_timing=True'")
        if self.stream is None or end_event.stream is None:
            raise ValueError("Both events must be recorded before calculating elapsed time.")
        if self.stream.device_index != end_event.stream.device_index:
            raise RuntimeError("Both events must be recorded on the same device to calculate "
                               "elapsed time (simulated)")
        self.synchronize()
        end_event.synchronize()
        return end_event.t - self.t

    def __repr__(self) -> str:
        where = "unrecorded" if self.stream is None else \
            f"stream {self.stream.stream_id} op {self.seq}"
        return f"<torch.cuda.Event {where} (simulated)>"


class _Tls(threading.local):
    def __init__(self) -> None:
        self.device: dict[int, int] = {}  # scheduler id -> current device index
        self.stream: dict[tuple[int, int], SimStream] = {}  # (sched id, index) -> stream
        self.ctx: list[tuple[int, SimStream]] = []  # `with stream:` stack
        self.running = False  # inside an op's body (a kernel cannot wait for the device)


_tls = _Tls()


def in_kernel() -> bool:
    """Whether this thread is running a simulated op's body now (its torch calls are the
    kernel's, not the host's)."""
    return _tls.running


class Scheduler:
    """The simulated devices' streams and queues, and the loop that runs them."""

    def __init__(self, mode: str, seed: int, device_count: int) -> None:
        self.mode = mode
        self.device_count = device_count
        self.stats = SimStats()
        self.lock = threading.RLock()
        self.closed = False
        self.sticky_error: str | None = None  # a failed driver call's error, until cleared
        self.sync_debug_mode = 0  # torch.cuda.set_sync_debug_mode: 0 off, 1 warn, 2 error
        self.used = False  # CUDA "initialised": a forked child is then in a bad fork
        self.bad_fork = False
        self.rng = np.random.default_rng(seed)
        self._ids = itertools.count(1)
        self._streams: list[SimStream] = []
        self._defaults = [SimStream(self, i) for i in range(device_count)]
        self._keys = [(id(self), i) for i in range(device_count)]  # (its keys in _tls.stream)
        for default in self._defaults:
            default.cuda_stream = 0  # as CUDA's legacy default stream
        self._captures: dict[int, tuple[int, str]] = {}  # id(graph) -> (thread, mode)
        self._invalidated: dict[int, str] = {}  # id(graph) -> what invalidated its capture
        self._forks: dict[int, list[SimStream]] = {}  # id(graph) -> the streams it captures
        self._polls: dict[tuple[int, int], int] = {}
        self.races = RaceTracker()  # vector clocks and accesses: races found when queued

    def reset_lock(self) -> None:
        """In a forked child: the thread that held the lock is gone."""
        self.lock = threading.RLock()

    def after_fork_in_child(self) -> None:
        """A child forked after the simulated CUDA was used is in a bad fork, as with CUDA:
        every CUDA call there raises (its parent's queues are not the child's)."""
        self.reset_lock()
        if self.used:
            self.bad_fork = True

    def check_usable(self) -> None:
        """``RuntimeError`` as torch raises it in a forked child of a CUDA process."""
        if self.bad_fork:
            raise RuntimeError(BAD_FORK)

    # -- devices and streams -----------------------------------------------------------------
    def new_stream_id(self) -> int:
        return next(self._ids) - 1

    def device_index(self, device: Any = None) -> int:
        """The index ``device`` names (``None``/``"cuda"``: the current device)."""
        if device is None:
            return self.current_device()
        if type(device) is int and 0 <= device < self.device_count:  # (the common case)
            return device
        if type(device) is torch.device and device.type == "cuda":  # (a tensor's device)
            i = device.index
            if i is not None and 0 <= i < self.device_count:
                return i
        if isinstance(device, SimStream):
            return device.device_index
        idx = getattr(device, "idx", None)  # (a torch.cuda.device / device_of context)
        if isinstance(idx, int):
            device = idx
        if isinstance(device, int) and not isinstance(device, bool):
            index: int | None = device
        else:
            dev = torch.device(device)
            if dev.type != "cuda":
                raise ValueError(f"Expected a cuda device, but got: {dev}")
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
        if self.bad_fork:
            raise RuntimeError(BAD_FORK)
        self.used = True
        index = self.device_index(device)
        return _tls.stream.get((id(self), index)) or self._defaults[index]

    def default_stream(self, device: Any = None) -> SimStream:
        return self._defaults[self.device_index(device)]

    def set_stream(self, stream: SimStream) -> None:
        _tls.stream[(id(self), stream.device_index)] = stream

    def new_stream(self, device: Any = None, priority: int = 0) -> SimStream:
        self.check_usable()
        self.used = True
        stream = SimStream(self, self.device_index(device), priority)
        with self.lock:
            self._streams.append(stream)
        return stream

    def all_streams(self) -> list[SimStream]:
        return [*self._defaults, *self._streams]

    def enter_stream(self, stream: SimStream) -> None:
        """``with torch.cuda.stream(s)``: ``s`` and its device are current inside."""
        _tls.ctx.append((self.current_device(), self.current_stream(stream.device_index)))
        self.set_device(stream.device_index)
        self.set_stream(stream)

    def exit_stream(self) -> None:
        device, prev = _tls.ctx.pop()
        self.set_stream(prev)
        self.set_device(device)

    # -- captures ----------------------------------------------------------------------------
    def begin_capture(self, stream: SimStream, graph: Any, mode: str = "global") -> None:
        if mode not in CAPTURE_MODES:
            raise RuntimeError(f"Unknown capture error mode. Expected `global`, "
                               f"`thread_local`, or `relaxed`, got `{mode}`")
        with self.lock:
            stream.capture = graph
            stream.cap_n, stream.cap_clock = 0, {}
            self._captures[id(graph)] = (threading.get_ident(), mode)
            self._forks[id(graph)] = [stream]

    def fork_capture(self, stream: SimStream, graph: Any) -> None:
        """``stream`` waited for an event of ``graph``'s capture: it is captured too."""
        if stream.capture is graph:
            return
        with self.lock:
            if stream.capture is None:
                stream.capture = graph
                stream.cap_n, stream.cap_clock = 0, {}
                self._forks.setdefault(id(graph), []).append(stream)

    def end_capture(self, stream: SimStream, graph: Any) -> None:
        unjoined = []
        with self.lock:
            if stream.capture is graph:
                for s in self._forks.pop(id(graph), [stream]):
                    if s.capture is graph:
                        s.capture = None
                    if s is not stream and stream.cap_clock.get(s.stream_id, 0) < s.cap_n:
                        unjoined.append(s)
                stream.capture = None
                self._captures.pop(id(graph), None)
            why = self._invalidated.pop(id(graph), None)
        if unjoined:  # (CUDA's check: a forked stream's work must be joined back)
            names = ", ".join(f"stream {s.stream_id}" for s in unjoined)
            raise RuntimeError(
                "CUDA error: capturing stream has unjoined work (cudaErrorStreamCaptureUnjoined:"
                f" {names} joined the capture by waiting for it, and the capturing stream "
                "never waited for their last work, e.g. with wait_stream; simulated)")
        if why is not None:
            raise RuntimeError("CUDA error: operation failed due to a previous error during "
                               f"capture (cudaErrorStreamCaptureInvalidated: {why}; simulated)")

    def prohibits_unsafe(self) -> bool:
        """Whether "potentially unsafe" calls (event queries and synchronizations, stream
        synchronizations, host-memory registration) are prohibited in the calling thread, by
        CUDA's rule: a capture in ``global`` mode by any thread, or a non-``relaxed`` capture
        by this thread."""
        if not self._captures:
            return False
        me = threading.get_ident()
        return any(mode == "global" or (thread == me and mode == "thread_local")
                   for thread, mode in list(self._captures.values()))

    def check_not_capturing(self, what: str) -> None:
        """``RuntimeError`` for a "potentially unsafe" call now; as on CUDA, it also
        invalidates the captures that prohibited it (their ``capture_end`` raises)."""
        if self.prohibits_unsafe():
            me = threading.get_ident()
            for key, (thread, mode) in list(self._captures.items()):
                if mode == "global" or (thread == me and mode == "thread_local"):
                    self._invalidated.setdefault(key, f"{what} from another thread" if
                                                 thread != me else what)
            raise RuntimeError(f"CUDA error: operation not permitted when stream is capturing "
                               f"({what} during CUDA graph capture; simulated)")

    def capturing_any(self) -> bool:
        return bool(self._captures)

    # -- torch.cuda.set_sync_debug_mode --------------------------------------------------------
    def sync_debug(self, what: str) -> None:
        """A synchronizing operation under ``set_sync_debug_mode``: warn or raise, as torch
        does (``Event.synchronize()`` and ``torch.cuda.synchronize()`` are not flagged)."""
        mode = self.sync_debug_mode
        if mode == 1:
            warnings.warn(f"{SYNC_MESSAGE} ({what}; simulated)", UserWarning, stacklevel=4)
        elif mode >= 2:
            raise RuntimeError(f"{SYNC_MESSAGE} ({what}; simulated)")

    # -- queue -------------------------------------------------------------------------------
    def enqueue(self, stream: SimStream, op: Op, count: str | None = "launches") -> None:
        """Queue ``op`` on ``stream`` (or record it into the graph capturing ``stream``)."""
        if self.closed:
            raise RuntimeError("a simulated CUDA tensor was used after its simulator closed")
        if self.bad_fork:
            raise RuntimeError(BAD_FORK)
        self.used = True
        if _tls.running:  # inside a kernel's body: part of that kernel, run now
            self._run_inline(op)
            return
        if stream.sched is not self:
            raise RuntimeError(f"{stream!r} belongs to a simulator that has closed; make "
                               "streams inside the simulator that uses them")
        if self.sticky_error is not None:
            err, self.sticky_error = self.sticky_error, None
            raise RuntimeError(f"CUDA error: {err} (a sticky error left by an earlier failed "
                               "driver call that nobody cleared; simulated)")
        with self.lock:
            if op.acc is not None and stream.capture is None:  # (a graph checks at replay)
                what, reads, writes = op.acc
                self.races.access(stream, stream.last + 1, what, reads, writes)
            if count is not None:
                setattr(self.stats, count, getattr(self.stats, count) + 1)
            if stream.capture is not None:
                stream.cap_n += 1
                stream.capture.ops.append(op)
                return
            if len(stream.queue) >= MAX_QUEUED:  # the launch queue is full: the host waits
                self._stall(in_pinstage_call())
                self.run_until(stream, stream.queue[0].seq)
            if self.mode == "eager" and not stream.queue and op.ms < SPIN_MS and (
                    not op.deps or all(d.done >= q for d, q in op.deps)):
                # (the common case: nothing queued ahead and nothing to wait for, so the op
                # runs now, without the round trip through the queue)
                stream.last += 1
                op.stream, op.seq = stream, stream.last
                stream.t += op.ms
                try:
                    self._run_op(op)
                except Exception:  # (an error it raises retires it, as in run_until)
                    stream.done = op.seq
                    raise
                except BaseException:  # (interrupted: still queued, to run at the next wait)
                    stream.queue.append(op)
                    raise
                stream.done = op.seq
                return
            stream.last += 1
            op.stream, op.seq = stream, stream.last
            stream.t += op.ms
            stream.queue.append(op)
            if self.mode == "eager":
                if op.ms < SPIN_MS and len(stream.queue) == 1 and \
                        all(d.done >= q for d, q in op.deps):
                    self.run_until(stream, op.seq)  # (else: behind a spin kernel, queued)
            elif self.mode == "random":
                self.maybe_progress()

    def shortcut_stream(self, index: int) -> SimStream | None:
        """The current stream of device ``index``, if a shortcut of the general path (a lane,
        a basic assignment's fill) may queue on it now: eager or lazy mode, the simulator
        open and not forked, not in a kernel's body nor learning a call, ``index`` one of its
        devices, the stream not capturing; else ``None``."""
        if self.mode == "random" or self.closed or self.bad_fork or _tls.running or \
                race_entry.learn is not None or index >= self.device_count:
            return None
        stream = _tls.stream.get(self._keys[index]) or self._defaults[index]
        # (set_stream takes a stream of another simulator: the general path raises for it)
        return None if stream.capture is not None or stream.sched is not self else stream

    def kernel(self, stream: SimStream, label: str, call: Callable[..., Any], args: Any,
               out: torch.Tensor | None, what: str, reads: Sequence[torch.Tensor],
               writes: Sequence[torch.Tensor], count: str = "launches",
               frame: Any = None) -> None:
        """:meth:`enqueue` of a plain kernel of the direct path (``_ops._Lane``: no host reads
        or writes, no dependencies): ``call(*args)``, or ``call(*args, out=out)``, on host
        tensors, which reads ``reads`` and writes ``writes`` (``what``, for the race checker).
        Its caller holds :attr:`lock` and has checked what enqueue checks first (the
        simulator open and not forked, not inside a kernel's body, ``stream``, one of this
        scheduler's, not capturing): race-checked and, in eager mode with nothing queued
        ahead, run now (no Op made unless it must stay queued), in lazy mode queued.
        ``frame``: the caller's (the race checker's user line is found from there), if not
        ``race_entry.frame``."""
        mode = self.mode
        queue = stream.queue
        if (queue if mode == "eager" else mode != "lazy" or len(queue) >= MAX_QUEUED) or \
                self.sticky_error is not None:
            prev = race_entry.frame
            if frame is not None:
                race_entry.frame = frame
            try:
                self.enqueue(stream, Op(label, _kernel_fn(call, args, out), [], host_writes=[],
                                        acc=(what, reads, writes), plain=True), count)
            finally:
                race_entry.frame = prev
            return
        self.used = True
        races = self.races
        seq = stream.last + 1
        if races.enabled:  # (RaceTracker._access: its shortcut first)
            site = site_of(frame or race_entry.frame or sys._getframe(1))
            if not races._solo(stream, seq, what, reads, writes, site):
                races._general(stream, stream.stream_id, seq, what, reads, writes, site, True)
        if count == "launches":
            self.stats.launches += 1
        else:
            setattr(self.stats, count, getattr(self.stats, count) + 1)
        stream.last = seq
        stream.t += OP_MS
        if mode == "lazy":  # (queued, to run when the host waits)
            queue.append(_plain_kernel(label, _kernel_fn(call, args, out), stream, seq))
            return
        # (no _tls.running: a lane's kernel is torch's own op on host tensors, run with the
        # Python dispatch keys off, as _NO_DISPATCH would, and each back as it was after)
        # (an interrupt is delivered after a call returns: each switch is made inside the
        # try and each restored in a finally of its own, so none is left off; the kernel is
        # done as soon as it has run, before the switches back)
        python_on = not _excluded(_PYTHON_KEY)
        snapshot_on = not _excluded(_SNAPSHOT_KEY)
        try:
            if python_on:
                _exclude(_PYTHON_KEY, True)
            if snapshot_on:
                _exclude(_SNAPSHOT_KEY, True)
            if out is None:
                call(*args)
            else:
                call(*args, out=out)
            stream.done = seq
        except Exception:  # (an error it raises retires it, as in run_until)
            stream.done = seq
            raise
        except BaseException:  # (interrupted before it ran: still queued, to run at the
            if stream.done < seq:  # next wait)
                queue.append(_plain_kernel(label, _kernel_fn(call, args, out), stream, seq))
            raise
        finally:
            try:
                if python_on:
                    _exclude(_PYTHON_KEY, False)
            finally:
                if snapshot_on:
                    _exclude(_SNAPSHOT_KEY, False)

    def maybe_progress(self) -> None:
        """Random mode: run a random number of ready operations, on random streams."""
        if self.mode != "random":
            return
        with self.lock:
            streams = self.all_streams()
            pending = sum(len(s.queue) for s in streams)
            if not pending or self.rng.random() < 0.6:
                return  # a device usually runs behind the host: often nothing moves
            steps = int(self.rng.integers(1, pending + 1))
            for _ in range(steps):
                ready = [s for s in streams if s.queue and s.queue[0].ms < SPIN_MS and all(
                    d.done >= q for d, q in s.queue[0].deps)]
                if not ready:
                    return
                s = ready[int(self.rng.integers(0, len(ready)))]
                self.run_until(s, s.queue[0].seq)

    def poll(self, stream: SimStream, seq: int) -> bool:
        """A host polling ``query()``: a real device gets there eventually, so after a few
        polls of unfinished work (counted per point), the simulator runs it."""
        key = (id(stream), seq)
        n = self._polls.get(key, 0) + 1
        self._polls[key] = n
        if n < POLLS_BEFORE_PROGRESS:
            return False
        self._polls.pop(key, None)
        self.run_until(stream, seq)
        return True

    def run_until(self, stream: SimStream, seq: int) -> None:
        """Run ``stream``'s queue up to ``seq`` (and what it waits for on other streams)."""
        while stream.done < seq and stream.queue:
            op = stream.queue[0]
            if op.plain and not op.deps and not op.reads and not op.host_writes and \
                    op.fn is not None and not _tls.running:
                self._run_kernels(stream, seq)
                continue
            for dep_stream, dep_seq in op.deps:
                if dep_stream.done < dep_seq:
                    self.run_until(dep_stream, dep_seq)
            if stream.queue and stream.queue[0] is op:
                # Retired once it has run: a host wait interrupted while it runs (Ctrl-C)
                # leaves it queued, to run (again, from its start) at the next wait, as the
                # device would have run it anyway. An error it raises retires it.
                try:
                    self._run_op(op)
                except Exception:
                    stream.done = (stream.queue.popleft(), op.seq)[1]
                    raise
                stream.done = (stream.queue.popleft(), op.seq)[1]

    def _run_kernels(self, stream: SimStream, seq: int) -> None:
        """:meth:`run_until` of the plain kernels at the head of ``stream``'s queue (no host
        reads or writes, no dependencies: what :meth:`_run_op` would do for each, its torch
        modes turned off once for them all)."""
        queue = stream.queue
        _tls.running = True
        try:
            with torch._C.DisableTorchFunction(), \
                    _NO_DISPATCH() if _dispatch_modes() else contextlib.nullcontext():
                while stream.done < seq and queue:
                    op = queue[0]
                    fn = op.fn
                    if not op.plain or op.deps or op.reads or op.host_writes or fn is None:
                        return
                    try:
                        fn(_NO_READS)
                    except Exception:  # (retired, as in run_until; interrupted: still queued)
                        stream.done = (queue.popleft(), op.seq)[1]
                        raise
                    stream.done = (queue.popleft(), op.seq)[1]
        finally:
            _tls.running = False

    def _run_inline(self, op: Op) -> None:
        """An op queued by a kernel's body while it runs: part of that kernel (its accesses
        are the kernel's), so it runs now, in place."""
        if op.fn is not None:
            _call(op, [r.check(op.label) for r in op.reads])

    def _run_op(self, op: Op) -> None:
        """Execute one op now (its dependencies are done): check its host reads, run it."""
        label = op.label
        tensors = [r.check(label) for r in op.reads]
        if op.fn is not None:
            if _tls.running:  # a kernel cannot wait for the device
                raise RuntimeError(f"{label}: simulated device work tried to wait for device "
                                   "work")
            _tls.running = True
            try:
                _call(op, tensors)
            finally:
                _tls.running = False
        if op.host_writes:  # later reads of what this wrote can't be checked by content
            for s in self.all_streams():
                for later in s.queue:
                    for r in later.reads:
                        if r.snapshot is not None and any(
                                r.span[0] < w[1] and w[0] < r.span[1] for w in op.host_writes):
                            r.snapshot = None

    def _stall(self, in_pinstage: bool) -> None:
        self.stats.syncs += 1
        if in_pinstage:
            self.stats.host_stalls += 1

    def host_wait(self, stream: SimStream, seq: int, what: str, sync_debug: bool = True,
                  in_pinstage: bool | None = None) -> None:
        """The host waits until ``stream`` has run up to ``seq``; ``sync_debug``: torch's
        sync debug mode flags this kind of wait."""
        if _tls.running:  # a kernel's body reading device memory: it is current there
            return
        self.check_usable()
        self.check_not_capturing(what)
        if sync_debug and self.sync_debug_mode:
            self.sync_debug(what)
        with self.lock:
            pending = stream.done < seq
            if in_pinstage is None:
                in_pinstage = in_pinstage_call()
            if pending:
                self._stall(in_pinstage)
            else:
                self.stats.syncs += 1
            self.run_until(stream, seq)
            self.races.host_waited(stream, seq)

    def synchronize(self, device: Any = None) -> None:
        """Run everything queued (on ``device``, default all devices); not a host stall."""
        self.check_usable()
        self.check_not_capturing("synchronize()")
        with self.lock:
            self.stats.syncs += 1
            index = None if device is None else self.device_index(device)
            streams = [s for s in self.all_streams() if index is None or
                       s.device_index == index]
            while any(s.queue for s in streams):
                for s in streams:
                    self.run_until(s, s.last)
            for s in streams:
                self.races.host_waited(s, s.last)

    @property
    def pending(self) -> int:
        """How many queued device operations have not run yet."""
        return sum(len(s.queue) for s in self.all_streams())

    def pending_reads(self) -> list[tuple[Op, HostRead]]:
        """Every queued op's host reads (for poisoning a destination they cover)."""
        return [(op, r) for s in self.all_streams() for op in s.queue for r in op.reads]
