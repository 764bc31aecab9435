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
from ._host import (
    GEN,
    LOCK,
    TOTALS,
    Counters,
    HostRegion,
    Parking,
    PinnedPool,
    drain_orphans,
    orphan_all,
)
from ._registry import forget_resolved, get_backend

__all__ = ["DeviceState", "device_state", "host_memory_stats", "on_fork_child", "all_states",
           "EventFence"]

MAX_STREAMS = 8  # streams remembered per device for fencing parked memory

_STATES: weakref.WeakKeyDictionary[Backend, DeviceState] = weakref.WeakKeyDictionary()
# Every event made, weakly (plain references: no callback runs when one dies, so nothing an
# interrupt could break), kept alive in a forked child.
_EVENTS: list[weakref.ref[Any]] = []
_GRAVEYARD: list[Any] = []  # a forked child's inherited events: never used, never destroyed
_FORK_RESETS: list[Callable[[], None]] = []


def _note_event(event: Any) -> None:
    if len(_EVENTS) >= 64 and len(_EVENTS) & (len(_EVENTS) - 1) == 0:  # at powers of two
        _EVENTS[:] = [r for r in _EVENTS if r() is not None]
    _EVENTS.append(weakref.ref(event))


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

    def _init_runtime(self, backend: Backend) -> None:
        """The parts a forked child makes anew."""
        self._lock = threading.RLock()  # probe and arena creation (the arena reads the probe)
        self._arena: StagingArena | None = None
        self.free_events: list[Any] = []
        self.streams: dict[Any, None] = {}  # streams pinstage fenced on, oldest first
        self.parking = Parking()
        self.parked: list[tuple[Any, Fence]] = []  # (memory, fence) waiting for the device
        self.pool = PinnedPool(lambda n: self.alloc_pinned(n, in_use=False), self.stats,
                               self.parking)
        fin = weakref.finalize(backend, _orphan, self.parking, self.parked)
        fin.atexit = False

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
            with self._lock: probe = self._probe_locked()  # noqa: E701 - (one line: see _host)
        return probe

    def _probe_locked(self) -> Probe:
        if self._probe is None:
            self._probe = self._live_backend().probe(lambda n: self.alloc_pinned(n, in_use=False))
        return self._probe

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
            with self._lock: arena = self._arena_locked()  # noqa: E701 - (one line)
        return arena

    def _arena_locked(self) -> StagingArena:
        if self._arena is None:
            self._arena = StagingArena(self, staging_limit(self.probe().staging_limit))
        return self._arena

    def arena_if_made(self) -> StagingArena | None:
        return self._arena

    def pinned_copy_memory(self, nbytes: int) -> torch.Tensor:
        """A uint8 host tensor of ``nbytes`` over pinned memory pinstage already holds when it
        can (pinned anew only when no free slab fits); its memory comes back once the tensor
        and every view of it are gone and the device work queued before has completed."""
        import numpy as np

        self.collect()
        self.note_reader()  # (the caller copies it on this stream, most likely: fence there)
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
                _note_event(event)
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
            with LOCK.lock: self.note_stream(stream)  # noqa: E701 - (one line)

    def wait(self, fence: Fence) -> None:
        """The host waits for ``fence``; counted as a stall when the work was not done."""
        if not fence.done():
            self.stalls += 1
            fence.wait_host()

    # -- parked memory -----------------------------------------------------------------------
    def collect(self) -> None:
        """Fence newly dropped memory; give back what the device has finished reading."""
        drain_orphans()  # (memory of devices that are gone: cheap when there is none)
        parking = self.parking
        dead = parking.dead
        if not (dead or self.parked) or self.capture_underway():
            return  # (nothing to do, or no event may be recorded or queried now)
        while dead:
            try:
                first = dead[0]
            except IndexError:  # (its parking closed meanwhile: the device is gone)
                break
            fence = self._drop_fence(parking.live.get(first))
            with LOCK.lock: self._park(fence)  # noqa: E701 - (one line)
        for entry in list(self.parked):
            if entry[1].done():
                entry[0].finish()  # (idempotent: an interrupt before the next line is harmless)
                with LOCK.lock: self._unpark(entry)  # noqa: E701

    def _park(self, fence: Fence) -> None:
        """Move the first dead memory to ``parked``. Each step can be repeated: interrupted
        midway, the memory is parked twice (finishing is idempotent), never lost."""
        dead, live = self.parking.dead, self.parking.live
        if not dead:
            return  # (another thread parked it meanwhile)
        ref = dead[0]
        memory = live.get(ref)
        if memory is not None:
            self.parked.append((memory, fence))
            live.pop(ref, None)  # (a closing parking may have cleared it meanwhile)
        if dead and dead[0] is ref:
            dead.popleft()

    def _unpark(self, entry: tuple[Any, Fence]) -> None:
        if entry in self.parked:
            self.parked.remove(entry)

    def _drop_fence(self, memory: Any) -> Fence:
        """Fences on the current stream and on every stream seen (the drop was noticed after
        it happened: whatever was queued before it is queued before these)."""
        backend = self.backend
        if backend is None or memory is None:
            return DONE
        fence = self.fence_streams([backend.current_stream(), *self.streams])
        if not getattr(memory, "portable", False):
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
        with LOCK.lock: return [*self.parking.dead_memory(), *(m for m, _ in self.parked)]  # noqa: E501,E701

    def release_synced(self, items: list[Any]) -> None:
        """Give back ``items`` at once: the device was synchronized after they were dropped,
        so every reader queued before has completed."""
        for item in items:  # first (finish is idempotent): an interrupt leaves the rest parked
            item.finish()
        ids = {id(i) for i in items}
        with LOCK.lock: self._unpark_all(ids)  # noqa: E701 - (one line)

    def _unpark_all(self, ids: set[int]) -> None:
        dead, live = self.parking.dead, self.parking.live
        for ref in list(dead):
            if id(live.get(ref)) in ids:
                del live[ref]
        kept = [r for r in dead if r in live]
        dead.clear()
        dead.extend(kept)
        self.parked[:] = [(m, f) for m, f in self.parked if id(m) not in ids]

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
    """The device's backend is gone (a simulator closed, after running its queue): what was
    parked for it goes back with no fence, at the next ``drain_orphans``. Takes no lock: it
    may run from a collector, while any lock is held."""
    parking.close()
    orphan_all([memory for memory, _ in list(parked)])
    parked.clear()


def device_state(backend: Backend) -> DeviceState:
    """The state of ``backend``'s device (made on first use, one per backend)."""
    state = _STATES.get(backend)
    if state is None:
        with LOCK.lock: state = _STATES.get(backend) or _STATES.setdefault(backend, DeviceState(backend))  # noqa: E501,E701
    return state


def retire(backend: Backend) -> None:
    """``backend`` does no more work (a simulator closed, after running everything it
    queued): give back now the pinned memory only its state holds (staging arenas, free pool
    slabs, parked memory; what callers still hold goes when they drop it), and drop the
    state (later sessions never fence on it). Without this the state, kept by its own pinned
    memory's unpin callbacks, would keep every closed simulator's arena reserved."""
    state = _STATES.pop(backend, None)
    if state is not None:
        try:
            state.drain()  # (everything queued has run: each released region comes back)
        finally:
            _orphan(state.parking, state.parked)
            with LOCK.lock: _drop_held(state)  # noqa: E701 - (one line: see _host)
    drain_orphans()


def _drop_held(state: DeviceState) -> None:
    """What only ``state`` holds goes (its device is gone): the arenas' regions are uncounted
    (no device will read them) and the arenas and free pool slabs dropped (their memory is
    orphaned, given back by ``drain_orphans``)."""
    for arena in state.arenas():
        arena.forget()
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
    drain_orphans()
    if device is None:
        for state in all_states():
            try:
                state.drain()
            except Exception:  # noqa: BLE001 - a device unusable now (a closed simulator's
                pass  # CUDA stand-in): its parked memory stays parked; the totals still count
        with LOCK.lock: return TOTALS.snapshot()  # noqa: E701
    state = device_state(get_backend(device))
    state.drain()
    with LOCK.lock: return state.stats.snapshot()  # noqa: E701


# --------------------------------------------------------------------------------------------
# Process lifetime: fork and exit


def on_fork_child(reset: Callable[[], None]) -> None:
    """Run ``reset`` in a forked child, after pinstage's own state is made anew."""
    _FORK_RESETS.append(reset)


# Objects whose locks a forked child replaces: a table whose apply ran in a parent thread at the
# moment of the fork would otherwise hold its lock for good in the child (that thread is not
# there). Weak: registering keeps nothing alive.
_LOCKED: weakref.WeakKeyDictionary[Any, tuple[str, ...]] = weakref.WeakKeyDictionary()


def renew_locks_after_fork(obj: Any, *names: str) -> None:
    """In a forked child, give ``obj`` fresh locks in the attributes ``names`` (unheld, of the
    same kind), whatever the parent's threads were doing with them at the fork."""
    _LOCKED[obj] = names


def _renew_locks() -> None:
    for obj, names in list(_LOCKED.items()):
        for name in names:
            old = getattr(obj, name, None)
            if old is not None:
                setattr(obj, name, threading.RLock() if _is_rlock(old) else threading.Lock())


def _is_rlock(lock: Any) -> bool:
    return type(lock) is type(threading.RLock())


def _after_fork_in_child() -> None:
    """Fresh locks and empty per-process state: the threads that held them are not here. The
    parent's events stay referenced and unused (destroying one would call the driver in a
    child that must not touch the parent's CUDA context)."""
    LOCK.reset()
    GEN[0] += 1
    TOTALS.reset()
    forget_resolved()
    _GRAVEYARD.extend(e for e in (r() for r in list(_EVENTS)) if e is not None)
    for state in all_states():
        state.reset_after_fork()
    _renew_locks()
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
    try:
        drain_orphans()
    except BaseException:  # noqa: BLE001 - (as above)
        pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_at_exit)
