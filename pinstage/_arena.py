"""The staging arena: pinned memory every copy stages through, reused only once fenced.

:class:`StagingArena` is a ring of bump-allocated regions over pinned blocks, one arena per
device (its :class:`~pinstage._state.DeviceState` makes it). ``with arena.staging(n) as
region:`` hands out a region the caller fills and enqueues device work to read; on release the
arena fences it with an event on the stream current then (batched per stream) and hands the
bytes out again only once that fence has completed. When full it grows (doubling, within the
limit), waits for the device (lock released), or waits for regions other threads still fill;
it never falls back to pageable memory. ``PINSTAGE_STAGING_LIMIT`` caps it.

Interrupt safety: a :class:`Staging` owns its region from inside the arena's critical section,
and a region whose owner died unreleased (an exception where ``__exit__`` could not run) comes
back through a weak-reference callback, so no exception at any point leaks staging memory.
"""

from __future__ import annotations

import gc
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import torch

from ._device import Backend, Fence
from ._errors import BusyError
from ._host import KEYS, LOCK, Counters, align_up, count_wait, parse_size

__all__ = ["StagingArena", "Region", "Staging", "ArenaHost", "staging_limit",
           "MIN_STAGING_LIMIT", "DEFAULT_STAGING_LIMIT", "check_limit"]

FENCE_EVERY = 8  # released staging regions covered by one event
MIN_STAGING_LIMIT = 4096  # one page: below it a chunked upload cannot make progress
WAIT_SLICE_S = 0.05  # a wait for another thread's region re-checks abandoned regions this often
_get_ident = threading.get_ident


class ArenaHost(Protocol):
    """What an arena needs of its device (the device state provides it)."""

    stats: Counters

    @property
    def backend(self) -> Backend | None:
        """The device's backend (``None`` once it is gone)."""

    def fence(self, stream: Hashable) -> Fence:
        """A fence after the work queued so far on ``stream``."""

    def fence_seen(self, stream: Hashable) -> Fence:
        """A fence on ``stream`` and on every stream pinstage used on this device."""

    def note_stream(self, stream: Hashable) -> None:
        """Remember ``stream`` as one pinstage's memory was read on."""

    def alloc_pinned(self, nbytes: int, *, in_use: bool = True) -> torch.Tensor:
        """A zero-filled uint8 pinned host tensor of ``nbytes``."""

    def wait(self, fence: Fence) -> None:
        """The host waits for ``fence`` (a stall when it was not done)."""


DEFAULT_STAGING_LIMIT = 256 * 2**20


def check_limit(n: int, shown: Any) -> int:
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
    return check_limit(parse_size(raw, "PINSTAGE_STAGING_LIMIT"), raw)



_FILLING, _RELEASED, _FENCED = 0, 1, 2


class Region:
    """Bytes ``start:end`` of a staging block, handed out to one call."""

    __slots__ = ("block", "start", "end", "requested", "fence", "state", "stream", "owner",
                 "claim", "key")

    def __init__(self, block: _Block, start: int, end: int, requested: int, owner: int) -> None:
        self.block = block
        self.start = start
        self.end = end
        self.requested = requested
        self.fence: Fence | None = None  # on ``stream``, after the last device reader
        self.state = _FILLING  # -> _RELEASED (readers enqueued) -> _FENCED (event recorded)
        self.stream: Any = None  # the stream current when it was released
        self.owner = owner  # the thread filling it
        self.claim: _Claim | None = None
        self.key = next(KEYS)  # its entry in the device's ledger while in ``block.live``

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def fenced(self) -> bool:
        return self.state == _FENCED

    def tensor(self, nbytes: int | None = None) -> torch.Tensor:
        """The first ``nbytes`` (default: all requested) as a uint8 tensor."""
        n = self.requested if nbytes is None else nbytes
        return torch.from_numpy(self.block.np[self.start : self.start + n])


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


class _Growth:
    """A thread's claim to grow the arena (weakly held by the arena: it ends with the frame
    that holds it, whatever interrupts that frame)."""

    __slots__ = ("size", "__weakref__")

    def __init__(self, size: int) -> None:
        self.size = size


def _NO_GROWER() -> _Growth | None:  # noqa: N802 - stands in for a dead weak reference
    return None


class _FenceBatch:
    """Regions released on one stream and not fenced yet."""

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

    def __init__(self, host: ArenaHost, limit: int, initial: int = 1 << 20) -> None:
        self.host = host
        self.limit = check_limit(int(limit), limit)
        self.initial = min(int(initial), self.limit)
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._blocks: list[_Block] = []  # retired blocks first, the current one last
        self._lock = LOCK.lock
        # Threads waiting for regions other threads fill: a condition variable whose waits
        # happen outside the lock (one lock per waiter, released by ``release``), so an
        # interrupt during a wait can never leave the arena lock in a wrong state, as one
        # landing inside ``threading.Condition.wait`` can.
        self._waiters: deque[Any] = deque()
        self._batches: dict[Any, _FenceBatch] = {}  # stream -> released regions not fenced yet
        self._abandoned: deque[_Claim] = deque()
        self._grower: Callable[[], _Growth | None] = _NO_GROWER  # the thread growing it

    @property
    def state(self) -> ArenaHost:
        """The device state this arena belongs to (its counters are ``state.stats``)."""
        return self.host

    @property
    def backend(self) -> Backend:
        backend = self.host.backend
        if backend is None:
            raise RuntimeError("this staging arena's device is gone (its simulator closed)")
        return backend

    @property
    def reserved(self) -> int:
        return sum(b.size for b in self._blocks)

    @property
    def live(self) -> int:
        """Regions handed out and not yet taken back."""
        return sum(len(b.live) for b in self._blocks)

    def forget(self) -> None:
        """The device is gone: uncount every region still handed out (caller holds the lock)."""
        for block in self._blocks:
            for region in list(block.live):
                self.host.stats.remove(region.key)

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
            # (one line: the lock's own __exit__ always runs, whatever interrupts this)
            with self._lock: region, grow, event = self._alloc_step(n, nbytes, holder, me)  # noqa: E501,E701
            if region is not None:
                return region
            # The lock is not held from here on: this thread waits, or pins new memory.
            if grow is not None:
                self._grow(grow)
            elif type(event) is _Wake:  # for another thread to release or grow
                event.lock.acquire(timeout=WAIT_SLICE_S)
            elif event is not None:  # for the device
                self.host.wait(event)

    def _alloc_step(self, n: int, nbytes: int, holder: Staging | None,
                    me: int) -> tuple[Region | None, _Growth | None, Any]:
        """Under the lock: a region, or what to do for one (grow, or wait for what)."""
        if self._abandoned:
            self._release_abandoned()
        region = self._try_alloc(n, nbytes, holder, me)
        if region is None:
            self._reclaim()
            region = self._try_alloc(n, nbytes, holder, me)
        if region is not None:
            if len(self._blocks) > 1:
                self._reclaim()  # give retired blocks back as soon as they drain
            return region, None, None
        size = self._growth(n)
        if size and self._grower() is None:
            grow = _Growth(size)  # this thread grows the arena, outside the lock
            self._grower = weakref.ref(grow)
            return None, grow, None
        if size:  # another thread is growing it: wait for that
            wake = _Wake()
            self._waiters.append(wake.lock)
            return None, None, wake
        return None, None, self._wait_for_room(me)

    def release(self, region: Region) -> None:
        """Mark ``region`` reusable once the device work enqueued so far on the current stream
        has completed (the stream is taken now, so a later stream change is safe).

        Fences are batched per stream: one event covers several released regions (an event
        that completes implies every copy enqueued before it on that stream has), recorded
        every few releases, or at once when the arena needs the space."""
        if region.state != _FILLING:
            return
        stream = self.backend.current_stream()
        with self._lock: self._release_locked(region, stream)  # noqa: E701 - (one line)

    def _release_locked(self, region: Region, stream: Any) -> None:
        if region.state != _FILLING:
            return
        batch = self._batches.get(stream)
        if batch is None:
            batch = self._batches[stream] = _FenceBatch()
        batch.regions.append(region)
        # one statement: released (the owner is done with it: no callback when it dies)
        region.stream, region.state, region.claim = stream, _RELEASED, None
        batch.nbytes += region.end - region.start
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
                fence = self.host.fence_seen(self.backend.current_stream())
                region.fence, region.state, region.claim = fence, _FENCED, None
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
        fence = self.host.fence(stream)
        for r in batch.regions:  # (interrupted midway: the batch stays for the next fence)
            if r.state == _RELEASED:
                r.fence, r.state = fence, _FENCED
        del self._batches[stream]
        self.host.note_stream(stream)

    def _fence_all(self) -> None:
        for stream in list(self._batches):
            self._fence(stream)

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
        self.host.stats.add(region.key, 0, n, requested)  # (one ledger entry: see _host)
        return region

    def _free(self, block: _Block) -> None:
        self.host.stats.remove(block.live[0].key)  # idempotent: an interrupt may repeat it
        block.live.popleft()

    def _reclaim(self) -> None:
        for block in list(self._blocks):
            while block.live:
                r = block.live[0]
                if r.state != _FENCED or r.fence is None or not r.fence.done():
                    break
                self._free(block)
            if not block.live and block is not self._blocks[-1]:
                self._blocks.remove(block)  # retired and drained: its memory goes back

    def _growth(self, n: int) -> int:
        """The size of a new block that would hold ``n`` bytes within the limit, or 0 (caller
        holds the lock)."""
        current = self._blocks[-1].size if self._blocks else 0
        size = min(max(self.initial, current * 2, n), self.limit)
        if size < n:
            return 0
        in_other = sum(b.size for b in self._blocks if b.live)
        return 0 if in_other + size > self.limit else size

    def _grow(self, growth: _Growth) -> None:
        """Pin a new block of ``growth.size`` bytes (pre-faulted and registered outside the
        lock: every other thread's staging goes on meanwhile) and make it the current one.
        One thread grows at a time; one interrupted midway simply leaves the arena as it was
        (its ``_Growth`` dies with its frame, which ends the claim)."""
        try:
            tensor = self.host.alloc_pinned(growth.size, in_use=False)
        except BaseException:
            with self._lock: self._install(None)  # noqa: E701 - (one line)
            raise
        with self._lock: self._install(tensor)  # noqa: E701 - (one line)

    def _install(self, tensor: torch.Tensor | None) -> None:
        """Under the lock: the grown block becomes the current one (if still within the
        limit); waiters try again."""
        self._grower = _NO_GROWER
        if tensor is not None and \
                sum(b.size for b in self._blocks if b.live) + tensor.numel() <= self.limit:
            if self._blocks and not self._blocks[-1].live:
                self._blocks.pop()
            self._blocks.append(_Block(tensor))
        self._notify_all()

    def _wait_for_room(self, me: int) -> Any:
        """What to wait for, with the lock released, until the oldest region may free up
        (caller holds the lock): a device fence, a ``_Wake``, or ``None`` to try again."""
        oldest = next((b.live[0] for b in self._blocks if b.live), None)
        if oldest is None:
            return None
        count_wait(self.host.stats)
        if oldest.state == _FILLING:
            if oldest.owner == me:
                gc.collect()  # an interrupted owner may be garbage in a reference cycle
                if self._abandoned:
                    return None
                raise BusyError(
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
                oldest.fence = self.host.fence(oldest.stream)
                oldest.state = _FENCED
        return oldest.fence

    def drain(self) -> None:
        """Fence what was released and take back the regions whose readers have completed."""
        with self._lock: self._drain_locked()  # noqa: E701 - (one line)

    def _drain_locked(self) -> None:
        if self._abandoned:
            self._release_abandoned()
        self._fence_all()
        self._reclaim()

    def reset_after_fork(self) -> None:
        """In a forked child: drop the parent's blocks (their fillers do not exist here)."""
        self._init_runtime()


