"""Pinned host memory, the bottom layers: exact-size regions, accounting, parking, the pool
behind ``np_to_pinned_tensor``, and sizes.

RMM style, each layer small enough to test alone:

* :class:`Counters` - one set of pinned-memory counters (``host_memory_stats()``); every
  region counts in the process-wide :data:`TOTALS` and in its device's counters.
* :class:`HostRegion` - one host allocation of exactly the size asked: its own page-aligned
  private ``mmap`` (rounded to the page) for memory a backend pins (``cudaHostRegister``)
  through callbacks, or 64-byte aligned memory otherwise. Tensors made from it keep it alive.
* :class:`Parking` - where dropped memory (a region, a pool lease) waits: the tensors' NumPy
  base has no ``__del__``; a weak reference's C-level callback queues it when it dies, and the
  device state fences it with events and gives it back only once the device work queued
  before the drop has completed.
* :class:`PinnedPool` - exact-size pinned slabs for ``np_to_pinned_tensor``, reused once the
  device is done with them.

Concurrency: the driver calls and the pool's and arena's structures change under one
process-wide re-entrant lock (:data:`LOCK`, made anew in a forked child by the device state's
fork hook). After ``fork``, memory made before it (:data:`GEN`) is not the child's to free.

Interrupts (``KeyboardInterrupt`` at any point, Ctrl-C or an injected one): every ``with
LOCK.lock:`` here and in the layers above is one line (the lock's own C-level ``__exit__`` then
always runs: a multi-line ``with`` ends with a line of its own, where an interrupt skips it).
The counters are a ledger (:class:`Counters`): an item is counted by one dict store and
uncounted by one idempotent dict pop, so no interrupt can count it twice, uncount it twice or
leave the totals half-changed; a release interrupted midway is simply done again.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import re
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["HostRegion", "Counters", "TOTALS", "NO_DEVICE", "KEYS", "ledger", "count_wait",
           "orphan", "orphan_all", "drain_orphans",
           "Parking", "PinnedPool", "Lease", "parse_size", "align_up", "PAGE", "ALIGN", "LOCK",
           "GEN"]

PAGE = mmap.PAGESIZE
ALIGN = 64  # every staging region starts on a 64-byte boundary (enough for any dtype)
POOL_KEEP_BYTES = 64 * 2**20  # free pinned bytes np_to_pinned_tensor's pool keeps per device
# Pages are faulted in when mapped (Linux), before the driver registers them: registering
# memory whose pages are already present holds the driver's lock for less time.
_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


class _Lock:
    """The process-wide lock, replaceable after fork (``LOCK.reset()``)."""

    __slots__ = ("lock",)

    def __init__(self) -> None:
        self.lock = threading.RLock()

    def reset(self) -> None:
        self.lock = threading.RLock()


LOCK = _Lock()  # every state change of pinned memory happens under LOCK.lock
GEN = [0]  # fork generation: memory made before the last fork is not this process's to free


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


KEYS = itertools.count(1)  # ledger keys: next() is one C-level step
LEASE = 1  # the kind of a ledger entry that is a pool lease (``PinnedPool.leased``)


class _Readout:
    """The counters' read side, shared by a device's ledger and the process totals."""

    __slots__ = ()
    waits: int
    pins: int

    def snapshot(self) -> dict[str, int]:
        raise NotImplementedError

    def _report(self, reserved: int, in_use: int, requested: int, peak: int) -> dict[str, int]:
        return {"reserved_bytes": reserved, "in_use_bytes": in_use,
                "peak_in_use_bytes": max(peak, in_use), "requested_bytes": requested,
                "waits": self.waits, "pins": self.pins}

    @property
    def reserved_bytes(self) -> int:
        return self.snapshot()["reserved_bytes"]

    @property
    def in_use_bytes(self) -> int:
        return self.snapshot()["in_use_bytes"]

    @property
    def requested_bytes(self) -> int:
        return self.snapshot()["requested_bytes"]


class Counters(_Readout):
    """Pinned host memory of one device (``host_memory_stats(device)``), as a ledger of live
    items: a region, a lease or an allocation, by its key, with the bytes it reserves, hands
    out and was asked for. Counting an item is one dict store and uncounting it one dict pop,
    each a single C-level step, so an interrupt anywhere leaves an item counted or not, never
    half; uncounting is idempotent, so a retried release never counts twice. The totals are
    summed when read. (The peak is kept from a running sum, best effort after an interrupt.)"""

    __slots__ = ("_live", "_sum", "peak_in_use_bytes", "waits", "pins", "__weakref__")

    def __init__(self) -> None:
        self.reset()
        _ACCOUNTS.add(self)

    def reset(self) -> None:
        self._live: dict[int, tuple[int, int, int, int]] = {}
        self._sum = 0  # running in-use bytes, for the peak
        self.peak_in_use_bytes = 0
        self.waits = 0
        self.pins = 0

    def add(self, key: int, reserved: int, in_use: int, requested: int, kind: int = 0) -> None:
        """Count item ``key`` (replacing what it counted before)."""
        self._live[key] = (reserved, in_use, requested, kind)
        self._sum += in_use
        if self._sum > self.peak_in_use_bytes:
            self.peak_in_use_bytes = self._sum
        if _TOTAL_SUM[0] + in_use > _TOTAL_PEAK[0]:
            _TOTAL_PEAK[0] = _TOTAL_SUM[0] + in_use
        _TOTAL_SUM[0] += in_use

    def remove(self, key: int) -> bool:
        """Uncount item ``key``; False if it was not counted (already removed)."""
        entry = self._live.pop(key, None)
        if entry is None:
            return False
        self._sum -= entry[1]
        _TOTAL_SUM[0] -= entry[1]
        return True

    def counts(self, key: int) -> bool:
        return key in self._live

    def count(self, kind: int) -> int:
        """How many live items are of ``kind``."""
        return sum(1 for e in list(self._live.values()) if e[3] == kind)

    def sums(self) -> tuple[int, int, int]:
        """(reserved, in use, requested) bytes of the live items, exact."""
        reserved = in_use = requested = 0
        for r, u, q, _ in list(self._live.values()):
            reserved, in_use, requested = reserved + r, in_use + u, requested + q
        self._sum = in_use  # (the running sum, made exact again)
        return reserved, in_use, requested

    def snapshot(self) -> dict[str, int]:
        return self._report(*self.sums(), self.peak_in_use_bytes)


_ACCOUNTS: weakref.WeakSet[Counters] = weakref.WeakSet()  # every device's ledger
_TOTAL_SUM = [0]  # running in-use bytes of the whole process, for its peak
_TOTAL_PEAK = [0]


class _Totals(_Readout):
    """The whole process (``host_memory_stats()``): the sum of every device's ledger and of
    :data:`NO_DEVICE`, read when asked; waits and pins are counted here too."""

    def __init__(self) -> None:
        self.waits = 0
        self.pins = 0

    def reset(self) -> None:
        self.waits = self.pins = 0
        _TOTAL_SUM[0] = _TOTAL_PEAK[0] = 0
        for account in list(_ACCOUNTS):
            account.reset()

    def snapshot(self) -> dict[str, int]:
        reserved = in_use = requested = 0
        for account in list(_ACCOUNTS):
            r, u, q = account.sums()
            reserved, in_use, requested = reserved + r, in_use + u, requested + q
        _TOTAL_SUM[0] = in_use
        return self._report(reserved, in_use, requested, _TOTAL_PEAK[0])


TOTALS = _Totals()
NO_DEVICE = Counters()  # regions made without a device's account


def ledger(account: Counters | None) -> Counters:
    return NO_DEVICE if account is None else account


def count_pin(account: Counters | None) -> None:
    """One more pinning (a statistic: an interrupt may lose one, never a byte)."""
    TOTALS.pins += 1
    ledger(account).pins += 1


def count_wait(account: Counters | None) -> None:
    TOTALS.waits += 1
    ledger(account).waits += 1


class Parking:
    """Pinned memory of one device whose tensors are gone, waiting to be fenced and given back.

    The NumPy base of each allocation's tensors is a handle with no ``__del__``; ``track``
    watches it through a weak reference whose callback is ``dead.append`` itself, so when the
    last tensor dies CPython queues the reference in C, with no Python code an interrupt could
    skip (a ``__del__`` can be interrupted before its first line). The device state takes the
    dead ones, fences them on its streams and calls ``finish()`` on their memory once the
    fences have completed. Closed (``open`` False: the device is gone), memory is given back
    as soon as its handle dies."""

    def __init__(self) -> None:
        self.dead: deque[weakref.ref[Any]] = deque()
        self.live: dict[weakref.ref[Any], Any] = {}  # a handle's reference -> its memory
        self.open = True

    def track(self, handle: Any, memory: Any) -> None:
        """Give ``memory`` back through this parking once ``handle`` is gone."""
        if self.open:
            self.live[weakref.ref(handle, self.dead.append)] = memory  # (one step)
        else:
            orphan(handle, memory)

    def dead_memory(self) -> list[Any]:
        live = self.live
        return [m for m in (live.get(r) for r in list(self.dead)) if m is not None]

    def close(self) -> None:
        """No device any more: its memory goes back with no fence, at the next
        :func:`drain_orphans` once its handle is gone. Takes no lock (it may run from a
        collector)."""
        self.open = False
        for ref, memory in list(self.live.items()):
            handle = ref()
            if handle is None:
                _ORPHANED.append(memory)
            else:
                orphan(handle, memory)
        self.live.clear()
        self.dead.clear()


# Memory with no device to fence on: given back by drain_orphans, from pinstage's own calls
# and never from a collector (a finalizer may run while any lock is held: taking LOCK there
# could deadlock with a thread that holds LOCK and waits for that lock).
_ORPHANED: deque[Any] = deque()  # memory to finish
_ORPHAN_DEAD: deque[weakref.ref[Any]] = deque()  # handles gone (queued in C by the callback)
_ORPHAN_LIVE: dict[weakref.ref[Any], Any] = {}  # handle's reference -> its memory


def orphan(handle: Any, memory: Any) -> None:
    """Finish ``memory`` (no fence needed) once ``handle`` is gone."""
    _ORPHAN_LIVE[weakref.ref(handle, _ORPHAN_DEAD.append)] = memory


def orphan_all(memory: Any) -> None:
    """Finish each of ``memory`` (no fence needed) at the next :func:`drain_orphans`."""
    _ORPHANED.extend(memory)


def drain_orphans() -> None:
    """Finish the orphaned memory whose handles are gone (idempotent steps, one thread at a
    time). Never called from a collector."""
    if _ORPHAN_DEAD or _ORPHANED:
        with LOCK.lock: _drain_orphans_locked()  # noqa: E701 - (one line: see the module doc)


def _drain_orphans_locked() -> None:
    while _ORPHAN_DEAD:
        memory = _ORPHAN_LIVE.pop(_ORPHAN_DEAD[0], None)
        if memory is not None:
            _ORPHANED.append(memory)
        _ORPHAN_DEAD.popleft()
    while _ORPHANED:
        try:
            _ORPHANED[0].finish()
        except Exception:  # noqa: BLE001 - its device is gone: nothing more to do for it
            pass
        _ORPHANED.popleft()


_UNPINNED, _PINNING, _PINNED = 0, 1, 2


class _Pages:
    """The memory behind a :class:`HostRegion`: the mapping, its registration with the driver
    and its ledger entry. It outlives the region's handle until the device is done with it."""

    __slots__ = ("key", "nbytes", "size", "ptr", "requested", "in_use", "pinned", "_mm",
                 "_buf", "_unpin", "_account", "_gen", "done")
    portable = False

    def __init__(self, nbytes: int, page_aligned: bool, unpin: Callable[[int, int], None] | None,
                 requested: int | None, in_use: bool, account: Counters | None) -> None:
        self.key = next(KEYS)  # its entry in its account's ledger
        self.done = False  # finished: unpinned, uncounted, closed
        self.nbytes = int(nbytes)
        self.requested = self.nbytes if requested is None else requested
        self.in_use = in_use
        self._account = account
        self._gen = GEN[0]
        self._unpin = unpin
        self.pinned = _UNPINNED if unpin is None else _PINNED  # (unpin only: pinned already)
        self._mm: mmap.mmap | None = None
        self._buf: np.ndarray | None = None
        if page_aligned:
            self.size = max(PAGE, (self.nbytes + PAGE - 1) // PAGE * PAGE)
            # zero-filled, page-aligned, private (a forked child gets copy-on-write pages),
            # pre-faulted
            self._mm = mmap.mmap(-1, self.size, flags=_MAP_FLAGS)
            view = ctypes.c_char.from_buffer(self._mm)
            self.ptr = ctypes.addressof(view)
            del view  # release the buffer export so the mapping can be closed later
        else:
            self.size = max(ALIGN, align_up(self.nbytes))
            self._buf = np.zeros(self.size + ALIGN, dtype=np.uint8)
            self.ptr = align_up(self._buf.ctypes.data)

    def finish(self) -> None:
        """Unpin, uncount and release now (the device no longer reads this memory).
        Idempotent, and safe to call again after an interrupt: each step happens once."""
        with LOCK.lock: self._finish_locked()  # noqa: E701 - (one line: see the module doc)

    def _finish_locked(self) -> None:
        if self.done:
            return
        if self._gen != GEN[0]:  # memory pinned before a fork is not the child's
            self.pinned, self.done = _UNPINNED, True
            return
        if self.pinned != _UNPINNED and self._unpin is not None:
            if self.pinned == _PINNING:  # interrupted while registering: it may not be
                try:
                    self._unpin(self.ptr, self.size)
                except Exception:  # noqa: BLE001 - (it was not registered after all)
                    pass
                self.pinned = _UNPINNED
            else:
                self.pinned = (self._unpin(self.ptr, self.size), _UNPINNED)[1]
        ledger(self._account).remove(self.key)
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        self._buf = None
        self.done = True


class HostRegion:
    """Host memory of an exact size, optionally pinned through callbacks.

    ``page_aligned`` (for memory a driver will register): its own private ``mmap`` (a forked
    child never writes into the parent's pages), rounded to the page. Otherwise 64-byte
    aligned. ``as_tensor()`` returns a zero-filled uint8 tensor whose NumPy base is this
    object. With ``parking``, when the last tensor (and this object) is gone the memory waits
    there for the device and is unpinned only once the device work queued before has
    completed; without it, it is unpinned at the next pinstage call that collects (the caller
    vouches that no device work reads it). Counted in ``account`` (its device's counters) and
    so in :data:`TOTALS`.

    Interrupt-safe: the memory is tracked (given back when this object dies) before it is
    pinned or counted, so an interrupt anywhere in between leaks nothing.
    """

    def __init__(
        self,
        nbytes: int,
        *,
        pin: Callable[[int, int], None] | None = None,
        unpin: Callable[[int, int], None] | None = None,
        requested: int | None = None,
        in_use: bool = True,
        page_aligned: bool = True,
        account: Counters | None = None,
        parking: Parking | None = None,
    ) -> None:
        pages = self._pages = _Pages(nbytes, page_aligned, unpin, requested, in_use, account)
        self.nbytes, self.size, self.ptr = pages.nbytes, pages.size, pages.ptr
        self.__array_interface__ = {
            "data": (self.ptr, False),
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "version": 3,
        }
        if parking is not None:  # from here on it goes back when this object dies
            parking.track(self, pages)
        else:
            orphan(self, pages)
        if pin is not None:
            count_pin(account)
            pages.pinned = _PINNING
            try:
                pages.pinned = (pin(self.ptr, self.size), _PINNED)[1]
            except BaseException:
                if pages.pinned == _PINNING:  # (the driver refused: nothing is registered)
                    pages.pinned = _UNPINNED
                pages.finish()
                raise
        ledger(account).add(pages.key, self.size, self.size if in_use else 0,
                            pages.requested if in_use else 0)

    def as_tensor(self) -> torch.Tensor:
        return torch.from_numpy(np.asarray(self))

    def finish(self) -> None:
        """Unpin and release now (see ``_Pages.finish``)."""
        self._pages.finish()


class Lease:
    """The NumPy base of the tensor ``np_to_pinned_tensor`` hands out, over a pooled pinned
    slab. No ``__del__``: when the caller's last view dies, the pool's parking notices (see
    :class:`Parking`) and the slab goes back to the pool after the device is done."""

    __slots__ = ("__array_interface__", "__weakref__")

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__array_interface__ = {"data": (ptr, False), "shape": (nbytes,), "typestr": "|u1",
                                    "version": 3}


class _Loan:
    """A slab lent out by a :class:`PinnedPool` (the memory behind a :class:`Lease`)."""

    __slots__ = ("key", "slab", "nbytes", "pool", "_gen")
    portable = True  # handed to the caller, who may copy it to any device

    def __init__(self, slab: torch.Tensor, nbytes: int, pool: PinnedPool) -> None:
        self.key = next(KEYS)  # its entry in the pool's account
        self.slab = slab
        self.nbytes = nbytes
        self.pool = pool
        self._gen = GEN[0]

    def finish(self) -> None:
        """Give the slab back to the pool (idempotent)."""
        if self._gen == GEN[0]:
            self.pool.put(self)


class PinnedPool:
    """Exact-size pinned slabs for ``np_to_pinned_tensor``, reused once the device is done.

    A request takes the smallest free slab that fits without wasting more than its own size
    (or a page); otherwise a new slab is pinned at the size asked (``alloc``). At most
    ``POOL_KEEP_BYTES`` of free slabs are kept."""

    def __init__(self, alloc: Callable[[int], torch.Tensor], account: Counters,
                 parking: Parking) -> None:
        self.alloc = alloc
        self.account = account
        self.parking = parking
        self.free: list[torch.Tensor] = []  # sorted by size
        self.free_bytes = 0

    def take(self, nbytes: int) -> Lease:
        """A lease of ``nbytes``: counted once it is tracked, so an interrupt anywhere loses
        nothing (a slab taken from the free list and not lent is simply freed)."""
        need = align_up(max(nbytes, 1))
        with LOCK.lock: slab = self._pop(need)  # noqa: E701 - one line (see module doc)
        if slab is None:
            slab = self.alloc(need)
        loan = _Loan(slab, nbytes, self)
        lease = Lease(slab.data_ptr(), nbytes)
        self.parking.track(lease, loan)
        with LOCK.lock: self._lend(loan)  # noqa: E701
        return lease

    @property
    def leased(self) -> int:
        """Leases handed out and not back yet."""
        return self.account.count(LEASE)

    def _lend(self, loan: _Loan) -> None:
        self.account.add(loan.key, 0, loan.slab.numel(), loan.nbytes, LEASE)

    def _pop(self, need: int) -> torch.Tensor | None:
        for i, slab in enumerate(self.free):
            size = slab.numel()
            if size >= need:
                if size > max(2 * need, need + PAGE):
                    return None
                slab, self.free_bytes = self.free.pop(i), self.free_bytes - size
                return slab
        return None

    def put(self, loan: _Loan) -> None:
        with LOCK.lock: self._put(loan)  # noqa: E701 - one line (see module doc)

    def _put(self, loan: _Loan) -> None:
        if not self.account.remove(loan.key):
            return  # (back already, or never lent)
        slab = loan.slab
        size = slab.numel()
        if self.free_bytes + size <= POOL_KEEP_BYTES:
            sizes = [s.numel() for s in self.free]
            i = next((k for k, s in enumerate(sizes) if s > size), len(sizes))
            self.free.insert(i, slab)
            self.free_bytes += size  # (a cap: an interrupt between the two only misjudges it)


# --------------------------------------------------------------------------------------------
# Sizes


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
