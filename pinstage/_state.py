"""One home per device: :class:`DeviceState` owns everything pinstage accumulates for a device.

Backends are stateless strategies (``_device.Backend``); what a device gathers over a process
lives here, one object per backend:

* the probe's result and the capabilities memo (``capabilities()`` reads them);
* the staging arena (made on first use, capped by ``PINSTAGE_STAGING_LIMIT``, read then);
* fences: events taken from a free list, recorded on one stream, and given back only once
  they have completed, so an event a holder still waits for is never recorded again;
* the streams pinstage's memory was read on, and dropped pinned memory parked behind fences;
* the pool behind ``np_to_pinned_tensor``, the device views of staging blocks;
* counters (``host_memory_stats(device)``) and host stalls.

The process has one fork hook (:func:`_after_fork_in_child`: fresh locks, empty state, the
parent's events kept referenced and never used) and one exit hook (:func:`_at_exit`: wait for
the device work that reads pinned memory, then give that memory back). Other parts of pinstage
that keep per-process state register a reset with :func:`on_fork_child`.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch

from ._arena import StagingArena, staging_limit
from ._device import DONE, AllOf, Backend, Event, Fence, Probe
from ._errors import CaptureError
from ._host import GEN, LOCK, TOTALS, Counters, HostRegion, Parking, PinnedPool
from ._registry import forget_resolved, get_backend

__all__ = ["DeviceState", "device_state", "host_memory_stats", "on_fork_child", "all_states",
           "EventFence"]

MAX_STREAMS = 8  # streams remembered per device for fencing parked memory

_STATES: weakref.WeakKeyDictionary[Backend, DeviceState] = weakref.WeakKeyDictionary()
_EVENTS: weakref.WeakSet[Any] = weakref.WeakSet()  # every event made (kept alive after fork)
_GRAVEYARD: list[Any] = []  # a forked child's inherited events: never used, never destroyed
_FORK_RESETS: list[Callable[[], None]] = []


class EventFence(Fence):
    """A fence on one raw event, recorded on one stream: it owns the event until it has seen
    it complete, then gives it back to its device's free list (exactly once: ``list.pop`` is
    atomic), so re-recording never moves a fence someone still holds."""

    __slots__ = ("_state", "_event", "_gen")

    def __init__(self, state: DeviceState, event: Event) -> None:
        self._state = state
        self._event = [event]
        self._gen = GEN[0]

    def done(self) -> bool:
        try:
            event = self._event[0]
        except IndexError:  # seen complete (by this thread or another)
            return True
        if self._gen != GEN[0]:
            return True  # the parent's work: nothing of it runs in this process
        backend = self._state.backend
        if backend is None or backend.event_done(event):
            self._give_back()
            return True
        return False

    def wait_host(self) -> None:
        try:
            event = self._event[0]
        except IndexError:  # seen complete (by this thread or another)
            return
        if self._gen != GEN[0]:
            return
        backend = self._state.backend
        if backend is not None:
            backend.wait_event_host(event)
        self._give_back()

    def _give_back(self) -> None:
        try:
            event = self._event.pop()
        except IndexError:
            return
        self._state.free_events.append(event)

    def __repr__(self) -> str:
        return f"<EventFence {'done' if not self._event else 'pending'}>"


class DeviceState:
    """Everything pinstage holds for one device (see the module docstring).

    Made on first use without probing the device; holds its backend weakly, so a simulator's
    state goes when the simulator does."""

    def __init__(self, backend: Backend) -> None:
        self._backend = weakref.ref(backend)
        self.device = backend.device
        self.asynchronous = bool(backend.asynchronous)
        self.stats = Counters()
        self.stalls = 0  # host waits for unfinished device work inside pinstage calls
        self.caps: tuple[Any, Any] | None = None  # (environment key, Capabilities)
        self.block_views: weakref.WeakKeyDictionary[Any, torch.Tensor] = \
            weakref.WeakKeyDictionary()
        self.extra_arenas: weakref.WeakSet[StagingArena] = weakref.WeakSet()
        self._probe: Probe | None = None  # platform facts: kept across fork
        self._init_runtime(backend)
        fin = weakref.finalize(backend, _orphan, self.parking, self.parked)
        fin.atexit = False

    def _init_runtime(self, backend: Backend) -> None:
        """The parts a forked child makes anew."""
        self._lock = threading.RLock()  # probe and arena creation (the arena reads the probe)
        self._arena: StagingArena | None = None
        self.free_events: list[Any] = []
        self.streams: dict[Any, None] = {}  # streams pinstage fenced on, oldest first
        self.parking = Parking(backend.current_stream)
        self.parked: list[tuple[Any, Fence]] = []  # (item, fence) waiting for the device
        self.pool = PinnedPool(lambda n: self.alloc_pinned(n, in_use=False), self.stats,
                               self.parking)

    @property
    def backend(self) -> Backend | None:
        return self._backend()

    def _live_backend(self) -> Backend:
        backend = self._backend()
        if backend is None:
            raise RuntimeError(f"the backend of {self.device} is gone (its simulator closed)")
        return backend

    # -- facts -------------------------------------------------------------------------------
    def probe(self) -> Probe:
        """The backend's probe, run once."""
        probe = self._probe
        if probe is None:
            with self._lock:
                probe = self._probe
                if probe is None:
                    backend = self._live_backend()
                    probe = self._probe = backend.probe(
                        lambda n: self.alloc_pinned(n, in_use=False))
        return probe

    # -- memory ------------------------------------------------------------------------------
    def alloc_pinned(self, nbytes: int, *, in_use: bool = True) -> torch.Tensor:
        """A zero-filled uint8 host tensor of exactly ``nbytes``, pinned for this device.
        When dropped, it goes back only after the device work queued to read it is done."""
        backend = self._live_backend()
        if backend.asynchronous and backend.capture_underway(list(self.streams)):
            raise CaptureError(
                f"pinned host memory cannot be registered for {self.device} while a CUDA graph "
                "is being captured (in CUDA's default 'global' capture mode that invalidates "
                "the capture): make buffers and pools before capturing")
        self.collect()  # cheap when nothing was dropped: give back what the device is done with
        region = HostRegion(nbytes, pin=backend.register_host, unpin=backend.unregister_host,
                            in_use=in_use, account=self.stats, parking=self.parking)
        return region.as_tensor()

    def capture_underway(self) -> bool:
        """Whether housekeeping must wait: a capture that forbids event records and queries
        may be under way on this device (see ``Backend.capture_underway``)."""
        backend = self.backend
        return backend is not None and backend.asynchronous and \
            backend.capture_underway(list(self.streams))

    def arena(self) -> StagingArena:
        """This device's pinned staging arena, made on first use."""
        arena = self._arena
        if arena is None:
            with self._lock:
                arena = self._arena
                if arena is None:
                    limit = staging_limit(self.probe().staging_limit)
                    arena = self._arena = StagingArena(self, limit)
        return arena

    def arena_if_made(self) -> StagingArena | None:
        return self._arena

    def pinned_copy_memory(self, nbytes: int) -> torch.Tensor:
        """A uint8 host tensor of ``nbytes`` over pinned memory pinstage already holds when it
        can (pinned anew only when no free slab fits); its memory comes back once the tensor
        and every view of it are gone and the device work queued before has completed."""
        import numpy as np

        self.collect()
        lease = self.pool.take(nbytes)
        return torch.from_numpy(np.asarray(lease))

    # -- fences ------------------------------------------------------------------------------
    def fence(self, stream: Hashable) -> Fence:
        """A fence after the work queued so far on ``stream`` (of this device)."""
        if not self.asynchronous:
            return DONE
        backend = self._live_backend()
        try:
            event = self.free_events.pop()
        except IndexError:
            event = backend.new_event()
            try:
                _EVENTS.add(event)
            except TypeError:  # not weak-referenceable: nothing to keep alive after fork
                pass
        try:
            backend.record_event(event, stream)
        except BaseException:
            self.free_events.append(event)
            raise
        return EventFence(self, event)

    def fence_streams(self, streams: Iterable[Hashable]) -> Fence:
        """One fence over several streams."""
        return AllOf([self.fence(s) for s in dict.fromkeys(streams)])

    def fence_seen(self, stream: Hashable) -> Fence:
        """A fence on ``stream`` and on every stream pinstage used on this device."""
        return self.fence_streams([stream, *self.streams])

    def note_stream(self, stream: Hashable) -> None:
        """Remember ``stream`` (caller holds the lock): parked memory is fenced on it too."""
        streams = self.streams
        if stream in streams:
            return
        streams[stream] = None
        if len(streams) > MAX_STREAMS:
            del streams[next(iter(streams))]

    def note_reader(self) -> None:
        """The device is about to read pinstage memory on the current stream (a buffer's
        copy, a UVA view handed out): dropped memory is fenced on that stream too. Cheap when
        the stream is known already."""
        backend = self._backend()
        if backend is None or not self.asynchronous:
            return
        stream = backend.current_stream()
        if stream not in self.streams:
            with LOCK.lock:
                self.note_stream(stream)

    def wait(self, fence: Fence) -> None:
        """The host waits for ``fence``; counted as a stall when the work was not done."""
        if not fence.done():
            self.stalls += 1
            fence.wait_host()

    # -- parked memory -----------------------------------------------------------------------
    def collect(self) -> None:
        """Fence newly dropped memory; give back what the device has finished reading."""
        dead = self.parking.dead
        if not (dead or self.parked) or self.capture_underway():
            return  # (nothing to do, or no event may be recorded or queried now)
        finished = []
        with LOCK.lock:
            while dead:
                item = dead[0]
                self.parked.append((item, self._drop_fence(item)))
                dead.popleft()
            keep = []
            for item, fence in self.parked:
                if fence.done():
                    finished.append(item)
                else:
                    keep.append((item, fence))
            self.parked[:] = keep
        for item in finished:
            item.finish()

    def _drop_fence(self, item: Any) -> Fence:
        """Fences on the stream current when ``item`` was dropped and on every stream seen."""
        if self.backend is None:
            return DONE
        streams = [item.drop_stream] if item.drop_stream is not None else []
        fence = self.fence_streams([*streams, *self.streams])
        if not getattr(item, "portable", False):
            return fence
        others = [fence]  # any device may have read it: fence every other device too
        for state in all_states():
            backend = state.backend
            if state is not self and backend is not None and state.asynchronous and \
                    not state.capture_underway():
                others.append(state.fence_streams([backend.current_stream(), *state.streams]))
        return AllOf(others)

    def pending(self) -> list[Any]:
        """What is dropped or parked now (to pass to ``release_synced`` after a full sync)."""
        with LOCK.lock:
            return [*self.parking.dead, *(item for item, _ in self.parked)]

    def release_synced(self, items: list[Any]) -> None:
        """Give back ``items`` at once: the device was synchronized after they were dropped,
        so every reader queued before has completed."""
        ids = {id(i) for i in items}
        dead = self.parking.dead
        with LOCK.lock:
            kept = [i for i in dead if id(i) not in ids]
            dead.clear()
            dead.extend(kept)
            self.parked[:] = [(i, f) for i, f in self.parked if id(i) not in ids]
        for item in items:
            item.finish()

    def arenas(self) -> list[StagingArena]:
        made = [self._arena] if self._arena is not None else []
        return [*made, *self.extra_arenas]

    def drain(self) -> None:
        """Fence released staging regions, take back finished ones, collect parked memory."""
        if self.capture_underway():
            return  # no event may be recorded or queried now: the next call does it
        for arena in self.arenas():
            arena.drain()
        self.collect()

    def outstanding(self) -> bool:
        return bool(self.parking.dead or self.parked or self.pool.leased or
                    any(arena.live for arena in self.arenas()))

    def reset_after_fork(self) -> None:
        """In a forked child: empty state and fresh locks (the parent's threads are gone)."""
        self.stats.reset()
        self.stalls = 0
        self.block_views = weakref.WeakKeyDictionary()
        for arena in list(self.extra_arenas):
            arena.reset_after_fork()
        backend = self.backend
        if backend is not None:
            self._init_runtime(backend)


def _orphan(parking: Parking, parked: list[tuple[Any, Fence]]) -> None:
    """The device's backend is gone (a simulator closed, after running its queue): give back
    what was parked for it."""
    parking.open = False
    items = [*parking.dead, *(item for item, _ in parked)]
    parking.dead.clear()
    parked.clear()
    for item in items:
        try:
            item.finish()
        except Exception:  # noqa: BLE001 - runs from the collector; never raise there
            pass


def device_state(backend: Backend) -> DeviceState:
    """The state of ``backend``'s device (made on first use, one per backend)."""
    state = _STATES.get(backend)
    if state is None:
        with LOCK.lock:
            state = _STATES.get(backend)
            if state is None:
                state = _STATES[backend] = DeviceState(backend)
    return state


def retire(backend: Backend) -> None:
    """``backend`` does no more work (a simulator closed, after running everything it
    queued): give back now the pinned memory only its state holds (staging arenas, free pool
    slabs, parked memory; what callers still hold goes when they drop it), and drop the
    state (stop fencing on it). Without this the state, kept by its own pinned memory's unpin
    callbacks, would keep every closed simulator's arena reserved."""
    state = _STATES.pop(backend, None)
    if state is None:
        return
    try:
        state.drain()  # (everything queued has run: each released region comes back)
    finally:
        _orphan(state.parking, state.parked)
    with LOCK.lock:
        state._arena = None
        state.extra_arenas = weakref.WeakSet()
        state.pool.free.clear()
        state.pool.free_bytes = 0


def all_states() -> list[DeviceState]:
    return list(_STATES.values())


def host_memory_stats(device: Any = None) -> dict[str, int]:
    """Pinned host memory pinstage holds (bytes), its peak, staging waits and pins so far:
    for the whole process, or with ``device`` for that device's staging and buffers.

    Memory whose device readers have completed is given back first (no waiting), so
    ``in_use_bytes`` counts only what the device may still read or callers still hold.
    Not the same keys as ``torch.cuda.host_memory_stats()``, which reports PyTorch's own
    caching host allocator (pinstage's memory is not in it, and it is not in pinstage's)."""
    if device is None:
        for state in all_states():
            try:
                state.drain()
            except Exception:  # noqa: BLE001 - a device unusable now (a closed simulator's
                pass  # CUDA stand-in): its parked memory stays parked; the totals still count
        with LOCK.lock:
            return TOTALS.snapshot()
    state = device_state(get_backend(device))
    state.drain()
    with LOCK.lock:
        return state.stats.snapshot()


# --------------------------------------------------------------------------------------------
# Process lifetime: fork and exit


def on_fork_child(reset: Callable[[], None]) -> None:
    """Run ``reset`` in a forked child, after pinstage's own state is made anew."""
    _FORK_RESETS.append(reset)


def _after_fork_in_child() -> None:
    """Fresh locks and empty per-process state: the threads that held them are not here. The
    parent's events stay referenced and unused (destroying one would call the driver in a
    child that must not touch the parent's CUDA context)."""
    LOCK.reset()
    GEN[0] += 1
    TOTALS.reset()
    forget_resolved()
    _GRAVEYARD.extend(list(_EVENTS))
    for state in all_states():
        state.reset_after_fork()
    for reset in list(_FORK_RESETS):
        try:
            reset()
        except Exception:  # noqa: BLE001 - a reset must not break the child
            pass


def _at_exit() -> None:
    """Wait for the device work that reads pinned memory, then give that memory back."""
    for state in all_states():
        try:
            backend = state.backend
            if backend is None or not state.outstanding():
                continue
            pending = state.pending()
            backend.synchronize()
            state.release_synced(pending)
            state.drain()
        except BaseException:  # noqa: BLE001 - at exit the device may already be gone
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_at_exit)
