"""Pinned host memory: exact-size regions, per-device state and accounting, the staging arena.

Layers, RMM style, each small enough to test alone:

* :class:`HostRegion` - one host allocation of exactly the size asked: its own page-aligned
  private ``mmap`` (rounded to the page) for memory a backend pins (``cudaHostRegister``)
  through callbacks, or 64-byte aligned memory for the simulator. Tensors made from it keep it
  alive. When the last one dies and the region knows its backend, the memory is parked behind
  events and goes back to the system only once the device work queued before has completed.
* :class:`DeviceState` - one per device: its counters (``host_memory_stats(device)``), the
  streams pinstage fenced on, parked frees, the pool behind ``np_to_pinned_tensor``.
* :class:`StagingArena` - a ring of bump-allocated staging regions over pinned blocks. A region
  is reused only after an event recorded on the stream that read it has completed.

Concurrency: every state change happens under one process-wide re-entrant lock (``_LOCK``);
threads wait on conditions, never spin, and never hold the lock while the host waits for the
device. ``__del__`` hooks never take the lock for parked memory: they append to a deque that
the next pinstage call processes. After ``fork`` the child gets fresh locks and empty state.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import mmap
import os
import re
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from ._backend import Backend

__all__ = ["HostRegion", "host_memory_stats", "StagingArena", "Staging", "DeviceState",
           "device_state", "parse_size", "staging_limit", "staging_limit_in_force",
           "MIN_STAGING_LIMIT"]

PAGE = mmap.PAGESIZE
ALIGN = 64  # every staging region starts on a 64-byte boundary (enough for any dtype)
FENCE_EVERY = 8  # released staging regions covered by one event
MIN_STAGING_LIMIT = 4096  # one page: below it a chunked upload cannot make progress
MAX_STREAMS = 8  # streams remembered per device for fencing parked memory
POOL_KEEP_BYTES = 64 * 2**20  # free pinned bytes np_to_pinned_tensor's pool keeps per device
WAIT_SLICE_S = 0.05  # a condition wait re-checks abandoned regions this often

_LOCK = threading.RLock()  # every state change below happens under this lock
_GEN = [0]  # fork generation: memory made before the last fork is not this process's to free
_get_ident = threading.get_ident


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class _Counters:
    """Counters of pinned host memory (callers hold ``_LOCK``)."""

    __slots__ = ("reserved_bytes", "in_use_bytes", "peak_in_use_bytes", "requested_bytes",
                 "waits", "pins")

    def __init__(self) -> None:
        self.reserved_bytes = 0
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0
        self.requested_bytes = 0
        self.waits = 0
        self.pins = 0

    def use(self, n: int, requested: int) -> None:
        self.in_use_bytes += n
        self.requested_bytes += requested
        if self.in_use_bytes > self.peak_in_use_bytes:
            self.peak_in_use_bytes = self.in_use_bytes

    def snapshot(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


TOTALS = _Counters()  # the whole process: every device, and regions that know no device


def _each(state: DeviceState | None) -> tuple[_Counters, ...]:
    return (TOTALS,) if state is None else (TOTALS, state.stats)


# --------------------------------------------------------------------------------------------
# Per-device state


class DeviceState:
    """One device's pinned-memory state: counters, fenced streams, parked frees, the pool.

    Made on first use without probing the device; holds its backend weakly, so a simulator's
    state goes when the simulator does."""

    def __init__(self, backend: Backend) -> None:
        self._backend = weakref.ref(backend)
        self.device = backend.device
        self.stats = _Counters()
        self.streams: dict[Any, None] = {}  # streams pinstage fenced on, oldest first
        self.dead: deque[Any] = deque()  # dropped regions/leases (appended by __del__)
        self.parked: list[tuple[Any, list[Any]]] = []  # (item, events) waiting for the device
        self.arenas: weakref.WeakSet[StagingArena] = weakref.WeakSet()
        self.pool = _PinnedPool(self)
        fin = weakref.finalize(backend, _orphan, self.dead, self.parked)
        fin.atexit = False

    @property
    def backend(self) -> Backend | None:
        return self._backend()

    def note_stream(self, stream: Any) -> None:
        """Remember ``stream`` (caller holds the lock): parked memory is fenced on it too."""
        streams = self.streams
        if stream in streams:
            return
        streams[stream] = None
        if len(streams) > MAX_STREAMS:
            del streams[next(iter(streams))]

    def collect(self) -> None:
        """Fence newly dropped memory; give back what the device has finished reading."""
        if not (self.dead or self.parked):
            return
        backend = self.backend
        finished = []
        with _LOCK:
            while self.dead:
                item = self.dead[0]
                self.parked.append((item, self._fences(backend, item)))
                self.dead.popleft()
            keep = []
            for item, events in self.parked:
                if backend is None or all(backend.event_done(e) for e in events):
                    finished.append(item)
                else:
                    keep.append((item, events))
            self.parked[:] = keep
        for item in finished:
            item.finish()

    def pending(self) -> list[Any]:
        """What is dropped or parked now (to pass to ``release_synced`` after a full sync)."""
        with _LOCK:
            return [*self.dead, *(item for item, _ in self.parked)]

    def release_synced(self, items: list[Any]) -> None:
        """Give back ``items`` at once: the device was synchronized after they were dropped,
        so every reader queued before has completed."""
        ids = {id(i) for i in items}
        with _LOCK:
            kept = [i for i in self.dead if id(i) not in ids]
            self.dead.clear()
            self.dead.extend(kept)
            self.parked[:] = [(i, e) for i, e in self.parked if id(i) not in ids]
        for item in items:
            item.finish()

    def _fences(self, backend: Backend | None, item: Any) -> list[Any]:
        """Events on the stream current when ``item`` was dropped and on every stream seen."""
        if backend is None:
            return []
        streams = dict.fromkeys([item.drop_stream, *self.streams])
        return [backend.record_event(s) for s in streams]

    def drain(self) -> None:
        """Fence released staging regions, take back finished ones, collect parked memory."""
        for arena in list(self.arenas):
            arena.drain()
        self.collect()

    def outstanding(self) -> bool:
        return bool(self.dead or self.parked or self.pool.leased or
                    any(arena.live for arena in list(self.arenas)))

    def reset_after_fork(self) -> None:
        self.stats = _Counters()
        self.streams = {}
        self.dead.clear()
        self.parked.clear()
        self.pool = _PinnedPool(self)


def _orphan(dead: deque[Any], parked: list[tuple[Any, list[Any]]]) -> None:
    """The device's backend is gone (a simulator closed, after running its queue): give back
    what was parked for it."""
    items = [*dead, *(item for item, _ in parked)]
    dead.clear()
    parked.clear()
    for item in items:
        try:
            item.finish()
        except Exception:  # noqa: BLE001 - runs from the collector; never raise there
            pass


_STATES: weakref.WeakKeyDictionary[Any, DeviceState] = weakref.WeakKeyDictionary()
_ARENAS: weakref.WeakSet[StagingArena] = weakref.WeakSet()


def device_state(backend: Backend) -> DeviceState:
    """The staging state of ``backend``'s device (made on first use, one per backend)."""
    state = _STATES.get(backend)
    if state is None:
        with _LOCK:
            state = _STATES.get(backend)
            if state is None:
                state = _STATES[backend] = DeviceState(backend)
    return state


def host_memory_stats(device: Any = None) -> dict[str, int]:
    """Pinned host memory pinstage holds (bytes), its peak, staging waits and pins so far:
    for the whole process, or with ``device`` for that device's staging and buffers.

    Memory whose device readers have completed is given back first (no waiting), so
    ``in_use_bytes`` counts only what the device may still read or callers still hold."""
    if device is None:
        for state in list(_STATES.values()):
            try:
                state.drain()
            except Exception:  # noqa: BLE001 - a device unusable now (a closed simulator's
                pass  # CUDA stand-in): its parked memory stays parked; the totals still count
        with _LOCK:
            return TOTALS.snapshot()
    from ._backend import get_backend

    state = device_state(get_backend(device))
    state.drain()
    with _LOCK:
        return state.stats.snapshot()


# --------------------------------------------------------------------------------------------
# Exact-size host regions


class HostRegion:
    """Host memory of an exact size, optionally pinned through callbacks.

    ``page_aligned`` (for memory a driver will register): its own private ``mmap`` (a forked
    child never writes into the parent's pages), rounded to the page. Otherwise (simulated
    pinned memory): 64-byte aligned. ``as_tensor()`` returns a zero-filled uint8 tensor whose
    NumPy base is this object. With ``backend``, when the last tensor dies the memory is parked
    behind events on the device's streams and unpinned only after they complete; without it,
    it is unpinned at once (the caller vouches that no device work reads it).
    """

    def __init__(
        self,
        nbytes: int,
        *,
        pin: Callable[[int, int], None] | None = None,
        unpin: Callable[[int, int], None] | None = None,
        on_free: Callable[[HostRegion], None] | None = None,
        requested: int | None = None,
        in_use: bool = True,
        page_aligned: bool = True,
        backend: Backend | None = None,
    ) -> None:
        self.nbytes = int(nbytes)
        self._alive = False
        self._mm: mmap.mmap | None = None
        self._buf: np.ndarray | None = None
        self._state = device_state(backend) if backend is not None else None
        self._gen = _GEN[0]
        self.drop_stream: Any = None
        if page_aligned:
            self.size = max(PAGE, (self.nbytes + PAGE - 1) // PAGE * PAGE)
            # zero-filled, page-aligned, private: a forked child gets copy-on-write pages
            self._mm = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            view = ctypes.c_char.from_buffer(self._mm)
            self.ptr = ctypes.addressof(view)
            del view  # release the buffer export so the mapping can be closed later
        else:
            self.size = max(ALIGN, align_up(self.nbytes))
            self._buf = np.zeros(self.size + ALIGN, dtype=np.uint8)
            base = self._buf.ctypes.data
            self.ptr = align_up(base)
        self._unpin = unpin
        self._on_free = on_free
        self._requested = self.nbytes if requested is None else requested
        self._in_use = in_use
        if pin is not None:
            try:
                pin(self.ptr, self.size)
            except BaseException:
                with _LOCK:
                    for c in _each(self._state):
                        c.pins += 1
                self._close()
                raise
        with _LOCK:
            for c in _each(self._state):
                c.pins += 1
                c.reserved_bytes += self.size
                if in_use:
                    c.use(self.size, self._requested)
            self._alive = True
        self.__array_interface__ = {
            "data": (self.ptr, False),
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "version": 3,
        }

    def as_tensor(self) -> torch.Tensor:
        return torch.from_numpy(np.asarray(self))

    def _close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        self._buf = None

    def finish(self) -> None:
        """Unpin and release now (the device no longer reads this memory)."""
        if not self._alive:
            return
        self._alive = False
        try:
            if self._gen == _GEN[0]:  # memory pinned before a fork is not the child's
                try:
                    if self._unpin is not None:
                        self._unpin(self.ptr, self.size)
                    if self._on_free is not None:
                        self._on_free(self)
                finally:
                    with _LOCK:
                        for c in _each(self._state):
                            c.reserved_bytes -= self.size
                            if self._in_use:
                                c.in_use_bytes -= self.size
                                c.requested_bytes -= self._requested
        finally:
            self._close()

    def __del__(self) -> None:
        try:
            if not self._alive:
                return
            state = self._state
            backend = state.backend if state is not None else None
            if state is None or backend is None or self._gen != _GEN[0]:
                self.finish()
                return
            try:
                self.drop_stream = backend.current_stream()
            except Exception:  # noqa: BLE001 - fenced on the streams pinstage has seen
                self.drop_stream = None
            state.dead.append(self)  # no lock here: the next pinstage call fences and frees it
        except BaseException:  # noqa: BLE001 - interpreter shutdown: the driver may be gone
            pass


# --------------------------------------------------------------------------------------------
# np_to_pinned_tensor's pool


class _Lease:
    """One hand-out of a pooled pinned slab: the NumPy base of the tensor a caller gets. When
    the caller's last view dies, the slab goes back to the pool after the device is done."""

    __slots__ = ("slab", "nbytes", "pool", "drop_stream", "__array_interface__", "_gen",
                 "__weakref__")

    def __init__(self, slab: torch.Tensor, nbytes: int, pool: _PinnedPool) -> None:
        self.slab = slab
        self.nbytes = nbytes
        self.pool = pool
        self.drop_stream: Any = None
        self._gen = _GEN[0]
        self.__array_interface__ = {"data": (slab.data_ptr(), False), "shape": (nbytes,),
                                    "typestr": "|u1", "version": 3}

    def finish(self) -> None:
        if self._gen == _GEN[0]:
            self.pool.put(self)

    def __del__(self) -> None:
        try:
            state = self.pool.state
            backend = state.backend
            if backend is None or self._gen != _GEN[0]:
                return
            try:
                self.drop_stream = backend.current_stream()
            except Exception:  # noqa: BLE001 - fenced on the streams pinstage has seen
                self.drop_stream = None
            state.dead.append(self)
        except BaseException:  # noqa: BLE001 - interpreter shutdown
            pass


class _PinnedPool:
    """Exact-size pinned slabs for ``np_to_pinned_tensor``, reused once the device is done.

    A request takes the smallest free slab that fits without wasting more than its own size
    (or a page); otherwise a new slab is pinned at the size asked. At most ``POOL_KEEP_BYTES``
    of free slabs are kept."""

    def __init__(self, state: DeviceState) -> None:
        self.state = state
        self.free: list[torch.Tensor] = []  # sorted by size
        self.free_bytes = 0
        self.leased = 0

    def take(self, backend: Backend, nbytes: int) -> _Lease:
        need = align_up(max(nbytes, 1))
        self.state.collect()
        slab = self._pop(need)
        if slab is None:
            slab = backend.alloc_pinned(need, in_use=False)
        lease = _Lease(slab, nbytes, self)
        with _LOCK:
            for c in _each(self.state):
                c.use(slab.numel(), nbytes)
            self.leased += 1
        return lease

    def _pop(self, need: int) -> torch.Tensor | None:
        with _LOCK:
            for i, slab in enumerate(self.free):
                size = slab.numel()
                if size >= need:
                    if size > max(2 * need, need + PAGE):
                        return None
                    del self.free[i]
                    self.free_bytes -= size
                    return slab
        return None

    def put(self, lease: _Lease) -> None:
        slab = lease.slab
        size = slab.numel()
        with _LOCK:
            for c in _each(self.state):
                c.in_use_bytes -= size
                c.requested_bytes -= lease.nbytes
            self.leased -= 1
            if self.free_bytes + size <= POOL_KEEP_BYTES:
                sizes = [s.numel() for s in self.free]
                i = next((k for k, s in enumerate(sizes) if s > size), len(sizes))
                self.free.insert(i, slab)
                self.free_bytes += size


def pinned_copy_memory(backend: Backend, nbytes: int) -> torch.Tensor:
    """A uint8 host tensor of ``nbytes`` over pinned memory pinstage already holds when it can
    (pinned anew only when no free slab fits); its memory comes back once the tensor and every
    view of it are gone and the device work queued before that has completed."""
    lease = device_state(backend).pool.take(backend, nbytes)
    return torch.from_numpy(np.asarray(lease))


# --------------------------------------------------------------------------------------------
# Sizes and the staging limit


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "ki": 2**10,
          "m": 10**6, "mb": 10**6, "mib": 2**20, "mi": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "gi": 2**30,
          "t": 10**12, "tb": 10**12, "tib": 2**40, "ti": 2**40}


def parse_size(value: int | str, what: str = "size") -> int:
    """Bytes from an int or a string such as ``"64MiB"``, ``"1.5GB"``, ``"4096"``."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int or a string like '64MiB', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = (m.group(2) or "").lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"{what} {value!r} is not a size: expected bytes or e.g. '64MiB'")
        n = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise TypeError(f"{what} must be an int or a string like '64MiB', "
                        f"got {type(value).__name__}")
    if n <= 0:
        raise ValueError(f"{what} must be positive, got {value!r}")
    return n


DEFAULT_STAGING_LIMIT = 256 * 2**20


def _check_limit(n: int, shown: Any) -> int:
    if n < MIN_STAGING_LIMIT:
        raise ValueError(f"PINSTAGE_STAGING_LIMIT={shown!r} is below the minimum staging limit "
                         f"of {MIN_STAGING_LIMIT} bytes (4KiB): uploads could not be staged")
    return n


def staging_limit(default: int | None = None) -> int:
    """The staging cap: ``PINSTAGE_STAGING_LIMIT`` if set, else ``default`` (a platform's cap,
    such as WSL's), else 256 MiB. A value below ``MIN_STAGING_LIMIT`` raises ``ValueError``."""
    raw = os.environ.get("PINSTAGE_STAGING_LIMIT")
    if raw is None or raw.strip() == "":
        return default or DEFAULT_STAGING_LIMIT
    return _check_limit(parse_size(raw, "PINSTAGE_STAGING_LIMIT"), raw)


def staging_limit_in_force(device: Any = None) -> int | None:
    """The staging cap ``device``'s arena uses (read once, at its first use; made now if it
    was not used yet), or ``None`` where pinned staging is off. For ``pinstage doctor``."""
    from ._backend import get_backend
    from ._capabilities import capabilities_for

    backend = get_backend(device)
    if not capabilities_for(backend).pin_memory:
        return None
    return backend.arena().limit


# --------------------------------------------------------------------------------------------
# Staging arena

_FILLING, _RELEASED, _FENCED = 0, 1, 2


class Region:
    """Bytes ``start:end`` of a staging block, handed out to one call."""

    __slots__ = ("block", "start", "end", "requested", "event", "state", "stream", "owner",
                 "claim", "counted")

    def __init__(self, block: _Block, start: int, end: int, requested: int, owner: int) -> None:
        self.block = block
        self.start = start
        self.end = end
        self.requested = requested
        self.event: Any = None  # recorded on ``stream`` after the last device reader
        self.state = _FILLING  # -> _RELEASED (readers enqueued) -> _FENCED (event recorded)
        self.stream: Any = None  # the stream current when it was released
        self.owner = owner  # the thread filling it
        self.claim: _Claim | None = None
        self.counted = False  # in the counters (and in ``block.live``)

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def released(self) -> bool:
        return self.state != _FILLING

    @property
    def fenced(self) -> bool:
        return self.state == _FENCED

    def tensor(self, nbytes: int | None = None) -> torch.Tensor:
        """The first ``nbytes`` (default: all requested) as a uint8 tensor."""
        n = self.requested if nbytes is None else nbytes
        return torch.from_numpy(self.block.np[self.start : self.start + n])


class _AllOf(tuple):  # type: ignore[type-arg]
    """Several events (one per stream) that together fence one region."""


class _Claim(weakref.ref):  # type: ignore[type-arg]
    """A weak reference from a region to the ``Staging`` that owns it: if the owner dies with
    the region unreleased (an interrupt skipped ``__exit__``), the arena gets the claim back
    through a C-level callback (no Python frame an interrupt could skip) and releases it."""

    __slots__ = ("region",)
    region: Region


class Staging:
    """``with arena.staging(n) as region:`` - a region released on leaving, whatever happens.

    Interrupt-safe: ownership is taken inside the arena's critical section; an exception
    (``KeyboardInterrupt`` included) raised anywhere, even where ``__exit__`` cannot run,
    leaves the region to be released when this object dies."""

    __slots__ = ("arena", "nbytes", "region", "__weakref__")

    def __init__(self, arena: StagingArena, nbytes: int) -> None:
        self.arena = arena
        self.nbytes = nbytes
        self.region: Region | None = None

    def __enter__(self) -> Region:
        try:
            return self.arena._alloc(self.nbytes, self)
        except BaseException:
            if self.region is not None:
                self.arena.release(self.region)
            raise

    def __exit__(self, *exc: Any) -> None:
        region = self.region
        if region is not None:
            self.arena.release(region)


class _Wake:
    """One waiter of the arena's condition: its lock is released by the next ``release``."""

    __slots__ = ("lock",)

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()


class _Block:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.np = tensor.numpy()
        self.size = tensor.numel()
        self.head = 0  # next free byte
        self.live: deque[Region] = deque()  # regions in allocation order

    def tail(self) -> int:
        return self.live[0].start if self.live else self.head

    def try_alloc(self, n: int) -> int | None:
        if not self.live:
            self.head = 0
            return 0 if n <= self.size else None
        tail = self.tail()
        if self.head >= tail:  # free space: [head, size) and [0, tail)
            if self.head + n <= self.size:
                return self.head
            if n < tail:
                return 0
            return None
        if self.head + n < tail:  # free space: [head, tail)
            return self.head
        return None


class _Batch:
    __slots__ = ("regions", "nbytes")

    def __init__(self) -> None:
        self.regions: list[Region] = []
        self.nbytes = 0


class StagingArena:
    """Pinned staging memory for one device: ring allocation, event-fenced reuse, a byte cap.

    ``with arena.staging(n) as region:`` (or ``alloc(n)`` ... ``release(region)``): the caller
    fills the region and enqueues the device work that reads it; on release the arena records
    an event on the stream current then (batched per stream) and hands the bytes out again only
    once that event has completed. When full it grows (doubling, within ``limit``), waits for
    the device (lock released), or waits on a condition for regions other threads still fill;
    it never falls back to pageable memory.
    """

    def __init__(self, backend: Backend, limit: int, initial: int = 1 << 20) -> None:
        self.backend = backend
        self.limit = _check_limit(int(limit), limit)
        self.initial = min(int(initial), self.limit)
        self.state = device_state(backend)
        self._init_runtime()
        self.state.arenas.add(self)
        _ARENAS.add(self)

    def _init_runtime(self) -> None:
        self._blocks: list[_Block] = []  # retired blocks first, the current one last
        self._lock = _LOCK
        # Threads waiting for regions other threads fill: a condition variable whose waits
        # happen outside the lock (one lock per waiter, released by ``release``), so an
        # interrupt during a wait can never leave the arena lock in a wrong state, as one
        # landing inside ``threading.Condition.wait`` can.
        self._waiters: deque[Any] = deque()
        self._batches: dict[Any, _Batch] = {}  # stream -> released regions not fenced yet
        self._abandoned: deque[_Claim] = deque()

    @property
    def reserved(self) -> int:
        return sum(b.size for b in self._blocks)

    @property
    def live(self) -> int:
        """Regions handed out and not yet taken back."""
        return sum(len(b.live) for b in self._blocks)

    def staging(self, nbytes: int) -> Staging:
        """An interrupt-safe region of ``nbytes``: ``with arena.staging(n) as region:``."""
        return Staging(self, nbytes)

    def alloc(self, nbytes: int) -> Region:
        """A region of ``nbytes`` the caller must ``release``; prefer ``staging()``, which
        cannot leak it when an exception lands between the two."""
        return self._alloc(nbytes, None)

    def _alloc(self, nbytes: int, holder: Staging | None) -> Region:
        n = align_up(max(int(nbytes), 1))
        if n > self.limit:
            raise ValueError(f"staging request of {nbytes} bytes exceeds the staging limit "
                             f"of {self.limit} bytes; stage it in pieces")
        me = _get_ident()
        while True:
            with self._lock:
                if self._abandoned:
                    self._release_abandoned()
                region = self._try_alloc(n, nbytes, holder, me)
                if region is None:
                    self._reclaim()
                    region = self._try_alloc(n, nbytes, holder, me)
                    if region is None and self._grow(n):
                        region = self._try_alloc(n, nbytes, holder, me)
                if region is not None:
                    return region
                event = self._wait_for_room(me)
            # The lock is not held while this thread waits.
            if type(event) is _Wake:  # for another thread to release what it fills
                event.lock.acquire(timeout=WAIT_SLICE_S)
            elif type(event) is _AllOf:  # for the device, on several streams
                for e in event:
                    self.backend.wait_event(e)
            elif event is not None:  # for the device
                self.backend.wait_event(event)

    def release(self, region: Region) -> None:
        """Mark ``region`` reusable once the device work enqueued so far on the current stream
        has completed (the stream is taken now, so a later stream change is safe).

        Fences are batched per stream: one event covers several released regions (an event
        that completes implies every copy enqueued before it on that stream has), recorded
        every few releases, or at once when the arena needs the space."""
        if region.state != _FILLING:
            return
        stream = self.backend.current_stream()
        with self._lock:
            self._release_locked(region, stream)

    def _release_locked(self, region: Region, stream: Any) -> None:
        if region.state != _FILLING:
            return
        region.stream = stream
        batch = self._batches.get(stream)
        if batch is None:
            batch = self._batches[stream] = _Batch()
        batch.regions.append(region)
        batch.nbytes += region.end - region.start
        region.state = _RELEASED
        region.claim = None  # the owner is done with it: no callback when the owner dies
        if len(batch.regions) >= FENCE_EVERY or batch.nbytes * 8 >= region.block.size:
            self._fence(stream)
        if self._waiters:
            self._notify_all()

    def _release_abandoned(self) -> None:
        """Release regions whose owner died without releasing them (caller holds the lock)."""
        while self._abandoned:
            claim = self._abandoned[0]  # popped once handled (an interrupt here retries it)
            region = getattr(claim, "region", None)
            if region is not None and region.state == _FILLING:
                # Its filler may have queued a reader on any stream: fence on all those seen.
                streams = dict.fromkeys([self.backend.current_stream(), *self.state.streams])
                region.event = _AllOf(self.backend.record_event(s) for s in streams)
                region.state = _FENCED
                region.claim = None
            self._abandoned.popleft()
        if self._waiters:
            self._notify_all()

    def _notify_all(self) -> None:
        waiters = self._waiters
        while waiters:
            waiters.popleft().release()

    def _fence(self, stream: Any) -> None:
        batch = self._batches.get(stream)
        if batch is None:
            return
        event = self.backend.record_event(stream)
        for r in batch.regions:  # (interrupted midway: the batch stays for the next fence)
            if r.state == _RELEASED:
                r.event = event
                r.state = _FENCED
        del self._batches[stream]
        self.state.note_stream(stream)

    def _fence_all(self) -> None:
        for stream in list(self._batches):
            self._fence(stream)

    def _done(self, event: Any) -> bool:
        if type(event) is _AllOf:
            return all(self.backend.event_done(e) for e in event)
        return self.backend.event_done(event)

    def _try_alloc(self, n: int, requested: int, holder: Staging | None,
                   me: int) -> Region | None:
        if not self._blocks:
            return None
        block = self._blocks[-1]
        start = block.try_alloc(n)
        if start is None:
            return None
        region = Region(block, start, start + n, requested, me)
        if holder is not None:
            # Ownership first: from here on an interrupt is undone by the holder.
            holder.region = region
            claim = _Claim(holder, self._abandoned.append)
            claim.region = region
            region.claim = claim
        block.head = start + n
        block.live.append(region)
        # Straight-line code from here (no call, no loop: nowhere an interrupt is delivered),
        # so the counters change together with ``counted``.
        t = TOTALS
        d = self.state.stats
        t.in_use_bytes += n
        t.requested_bytes += requested
        if t.in_use_bytes > t.peak_in_use_bytes:
            t.peak_in_use_bytes = t.in_use_bytes
        d.in_use_bytes += n
        d.requested_bytes += requested
        if d.in_use_bytes > d.peak_in_use_bytes:
            d.peak_in_use_bytes = d.in_use_bytes
        region.counted = True
        return region

    def _free(self, block: _Block) -> None:
        region = block.live[0]
        if region.counted:  # straight-line down to the popleft (see _try_alloc)
            region.counted = False
            n = region.end - region.start
            t = TOTALS
            d = self.state.stats
            t.in_use_bytes -= n
            t.requested_bytes -= region.requested
            d.in_use_bytes -= n
            d.requested_bytes -= region.requested
        block.live.popleft()

    def _reclaim(self) -> None:
        for block in list(self._blocks):
            while block.live:
                r = block.live[0]
                if r.state != _FENCED or not self._done(r.event):
                    break
                self._free(block)
            if not block.live and block is not self._blocks[-1]:
                self._blocks.remove(block)  # retired and drained: its memory goes back

    def _grow(self, n: int) -> bool:
        current = self._blocks[-1].size if self._blocks else 0
        size = max(self.initial, current * 2, n)
        size = min(size, self.limit)
        if size < n:
            return False
        in_other = sum(b.size for b in self._blocks if b.live)
        if in_other + size > self.limit:
            return False
        # Pinning under the lock: growth happens a few times per process, and an interrupt
        # here leaves nothing half-done (an unused new block is simply dropped).
        tensor = self.backend.alloc_pinned(size, in_use=False)
        if self._blocks and not self._blocks[-1].live:
            self._blocks.pop()
        self._blocks.append(_Block(tensor))
        return True

    def _wait_for_room(self, me: int) -> Any:
        """What to wait for, with the lock released, until the oldest region may free up
        (caller holds the lock): a device event, a ``_Wake``, or ``None`` to try again."""
        oldest = next((b.live[0] for b in self._blocks if b.live), None)
        if oldest is None:
            return None
        for c in (TOTALS, self.state.stats):
            c.waits += 1
        if oldest.state == _FILLING:
            if oldest.owner == me:
                gc.collect()  # an interrupted owner may be garbage in a reference cycle
                if self._abandoned:
                    return None
                raise RuntimeError(
                    "this thread holds a staging region it has not released and the staging "
                    "arena is full behind it (a region held across another staging request, "
                    "or alloc() without release()); release it first or raise "
                    "PINSTAGE_STAGING_LIMIT")
            # Another thread is filling it: wait for its release (which wakes every waiter),
            # re-checking now and then for regions whose owner was interrupted.
            wake = _Wake()
            self._waiters.append(wake.lock)
            return wake
        if oldest.state == _RELEASED:
            self._fence(oldest.stream)  # recorded on the stream that read it
            if oldest.state == _RELEASED:  # in no batch (a fence was interrupted): its own
                oldest.event = self.backend.record_event(oldest.stream)
                oldest.state = _FENCED
        return oldest.event

    def drain(self) -> None:
        """Fence what was released and take back the regions whose readers have completed."""
        with self._lock:
            if self._abandoned:
                self._release_abandoned()
            self._fence_all()
            self._reclaim()

    def reset_after_fork(self) -> None:
        """In a forked child: drop the parent's blocks (their fillers do not exist here)."""
        self._init_runtime()


def iter_states() -> Iterator[DeviceState]:
    return iter(list(_STATES.values()))


# --------------------------------------------------------------------------------------------
# Process lifetime: fork and exit


def _after_fork_child() -> None:
    """Fresh locks and empty per-process state: the threads that held them are not here."""
    global _LOCK
    _LOCK = threading.RLock()
    _GEN[0] += 1
    for name in _Counters.__slots__:
        setattr(TOTALS, name, 0)
    for arena in list(_ARENAS):
        arena.reset_after_fork()
    for state in list(_STATES.values()):
        state.reset_after_fork()


def _at_exit() -> None:
    """Wait for the device work that reads pinned memory, then give that memory back."""
    for state in list(_STATES.values()):
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
    os.register_at_fork(after_in_child=_after_fork_child)
atexit.register(_at_exit)
