"""Pinned host memory, the bottom layers: exact-size regions, accounting, parking, the pool
behind ``np_to_pinned_tensor``, and sizes.

RMM style, each layer small enough to test alone:

* :class:`Counters` - one set of pinned-memory counters (``host_memory_stats()``); every
  region counts in the process-wide :data:`TOTALS` and in its device's counters.
* :class:`HostRegion` - one host allocation of exactly the size asked: its own page-aligned
  private ``mmap`` (rounded to the page) for memory a backend pins (``cudaHostRegister``)
  through callbacks, or 64-byte aligned memory otherwise. Tensors made from it keep it alive.
* :class:`Parking` - where a dropped region (or pool lease) waits: its ``__del__`` appends it
  here without a lock; the device state fences it with events and gives it back only once the
  device work queued before the drop has completed.
* :class:`PinnedPool` - exact-size pinned slabs for ``np_to_pinned_tensor``, reused once the
  device is done with them.

Concurrency: every state change happens under one process-wide re-entrant lock (:data:`LOCK`,
made anew in a forked child by the device state's fork hook). After ``fork``, memory made
before it (:data:`GEN`) is not the child's to free.
"""

from __future__ import annotations

import ctypes
import mmap
import re
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["HostRegion", "Counters", "TOTALS", "Parking", "PinnedPool", "Lease", "parse_size",
           "align_up", "PAGE", "ALIGN", "LOCK", "GEN"]

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


class Counters:
    """Counters of pinned host memory (callers hold the lock)."""

    __slots__ = ("reserved_bytes", "in_use_bytes", "peak_in_use_bytes", "requested_bytes",
                 "waits", "pins")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
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


TOTALS = Counters()  # the whole process: every device, and regions that know no device


def _each(account: Counters | None) -> tuple[Counters, ...]:
    return (TOTALS,) if account is None else (TOTALS, account)


class Parking:
    """Dropped pinned memory of one device, waiting to be fenced and given back.

    ``park(item)`` runs from ``__del__`` (no lock: a deque append is atomic); the device state
    takes ``dead`` items, fences them on the stream current at the drop and on every stream
    pinstage used, and calls ``item.finish()`` once those fences have completed.
    ``current_stream``: the device's current stream (weakly held owner: when it is gone,
    nothing is parked and items are freed at once)."""

    def __init__(self, current_stream: Callable[[], Any]) -> None:
        self.dead: deque[Any] = deque()
        self._stream = weakref.WeakMethod(current_stream) if hasattr(current_stream,
                                                                      "__self__") else \
            (lambda: current_stream)
        self.open = True

    def park(self, item: Any) -> bool:
        """Park ``item`` (``False``: the device is gone; the caller frees it now)."""
        if not self.open:
            return False
        fn = self._stream()
        if fn is None:
            return False
        try:
            item.drop_stream = fn()
        except Exception:  # noqa: BLE001 - fenced on the streams pinstage has seen
            item.drop_stream = None
        self.dead.append(item)
        return True


class HostRegion:
    """Host memory of an exact size, optionally pinned through callbacks.

    ``page_aligned`` (for memory a driver will register): its own private ``mmap`` (a forked
    child never writes into the parent's pages), rounded to the page. Otherwise 64-byte
    aligned. ``as_tensor()`` returns a zero-filled uint8 tensor whose NumPy base is this
    object. With ``parking``, when the last tensor dies the memory waits there for the device
    and is unpinned only once the device work queued before has completed; without it, it is
    unpinned at once (the caller vouches that no device work reads it). Counted in
    :data:`TOTALS` and in ``account`` (its device's counters).
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
        account: Counters | None = None,
        parking: Parking | None = None,
    ) -> None:
        self.nbytes = int(nbytes)
        self._alive = False
        self._mm: mmap.mmap | None = None
        self._buf: np.ndarray | None = None
        self._account = account
        self._parking = parking
        self._gen = GEN[0]
        self.drop_stream: Any = None
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
        self._unpin = unpin
        self._on_free = on_free
        self._requested = self.nbytes if requested is None else requested
        self._in_use = in_use
        if pin is not None:
            try:
                pin(self.ptr, self.size)
            except BaseException:
                with LOCK.lock:
                    for c in _each(account):
                        c.pins += 1
                self._close()
                raise
        with LOCK.lock:
            for c in _each(account):
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
            if self._gen == GEN[0]:  # memory pinned before a fork is not the child's
                try:
                    if self._unpin is not None:
                        self._unpin(self.ptr, self.size)
                    if self._on_free is not None:
                        self._on_free(self)
                finally:
                    with LOCK.lock:
                        for c in _each(self._account):
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
            parking = self._parking
            if parking is None or self._gen != GEN[0] or not parking.park(self):
                self.finish()
        except BaseException:  # noqa: BLE001 - interpreter shutdown: the driver may be gone
            pass


class Lease:
    """One hand-out of a pooled pinned slab: the NumPy base of the tensor a caller gets. When
    the caller's last view dies, the slab goes back to the pool after the device is done."""

    __slots__ = ("slab", "nbytes", "pool", "drop_stream", "__array_interface__", "_gen",
                 "__weakref__")
    portable = True  # handed to the caller, who may copy it to any device

    def __init__(self, slab: torch.Tensor, nbytes: int, pool: PinnedPool) -> None:
        self.slab = slab
        self.nbytes = nbytes
        self.pool = pool
        self.drop_stream: Any = None
        self._gen = GEN[0]
        self.__array_interface__ = {"data": (slab.data_ptr(), False), "shape": (nbytes,),
                                    "typestr": "|u1", "version": 3}

    def finish(self) -> None:
        if self._gen == GEN[0]:
            self.pool.put(self)

    def __del__(self) -> None:
        try:
            if self._gen == GEN[0] and not self.pool.parking.park(self):
                self.pool.put(self)  # the device is gone: nothing reads the slab any more
        except BaseException:  # noqa: BLE001 - interpreter shutdown
            pass


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
        self.leased = 0

    def take(self, nbytes: int) -> Lease:
        need = align_up(max(nbytes, 1))
        slab = self._pop(need)
        if slab is None:
            slab = self.alloc(need)
        lease = Lease(slab, nbytes, self)
        with LOCK.lock:
            for c in _each(self.account):
                c.use(slab.numel(), nbytes)
            self.leased += 1
        return lease

    def _pop(self, need: int) -> torch.Tensor | None:
        with LOCK.lock:
            for i, slab in enumerate(self.free):
                size = slab.numel()
                if size >= need:
                    if size > max(2 * need, need + PAGE):
                        return None
                    del self.free[i]
                    self.free_bytes -= size
                    return slab
        return None

    def put(self, lease: Lease) -> None:
        slab = lease.slab
        size = slab.numel()
        with LOCK.lock:
            for c in _each(self.account):
                c.in_use_bytes -= size
                c.requested_bytes -= lease.nbytes
            self.leased -= 1
            if self.free_bytes + size <= POOL_KEEP_BYTES:
                sizes = [s.numel() for s in self.free]
                i = next((k for k, s in enumerate(sizes) if s > size), len(sizes))
                self.free.insert(i, slab)
                self.free_bytes += size


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
