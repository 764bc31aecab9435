"""Pinned host memory: exact-size regions, process-wide accounting and the staging arena.

Layers, RMM style, each small enough to test alone:

* :class:`HostRegion` - one host allocation of exactly the size asked: its own page-aligned
  ``mmap`` (rounded to the page) for memory a backend pins (``cudaHostRegister``) through
  callbacks, or 64-byte aligned memory for the simulator. Tensors made from it keep it alive;
  when the last one dies it is unpinned and released.
* :data:`STATS` - what pinstage holds (``host_memory_stats()``).
* :class:`StagingArena` - a ring of bump-allocated staging regions over pinned blocks. A region
  is reused only after an event recorded after its last device reader has completed.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from ._backend import Backend

__all__ = ["HostRegion", "host_memory_stats", "StagingArena", "parse_size", "staging_limit"]

PAGE = mmap.PAGESIZE
ALIGN = 64  # every staging region starts on a 64-byte boundary (enough for any dtype)
FENCE_EVERY = 8  # released staging regions covered by one event


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class _Stats:
    """Process-wide counters of pinned host memory held by pinstage."""

    def __init__(self) -> None:
        # One re-entrant lock for the counters and every staging arena (arenas update the
        # counters inside their own critical sections: one lock operation, not two).
        self.lock = threading.RLock()
        self.reserved_bytes = 0
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0
        self.requested_bytes = 0
        self.waits = 0

    def reserve(self, n: int) -> None:
        with self.lock:
            self.reserved_bytes += n

    def unreserve(self, n: int) -> None:
        with self.lock:
            self.reserved_bytes -= n

    def use(self, n: int, requested: int) -> None:
        with self.lock:
            self.use_locked(n, requested)

    def unuse(self, n: int, requested: int) -> None:
        with self.lock:
            self.in_use_bytes -= n
            self.requested_bytes -= requested

    def use_locked(self, n: int, requested: int) -> None:
        """``use`` for callers already holding ``lock``."""
        self.in_use_bytes += n
        self.requested_bytes += requested
        if self.in_use_bytes > self.peak_in_use_bytes:
            self.peak_in_use_bytes = self.in_use_bytes

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return {
                "reserved_bytes": self.reserved_bytes,
                "in_use_bytes": self.in_use_bytes,
                "peak_in_use_bytes": self.peak_in_use_bytes,
                "requested_bytes": self.requested_bytes,
                "waits": self.waits,
            }


STATS = _Stats()


_ARENAS: weakref.WeakSet[StagingArena] = weakref.WeakSet()


def host_memory_stats() -> dict[str, int]:
    """The pinned host memory pinstage holds now (bytes), its peak, and staging waits so far.

    Staging regions whose device readers have completed are returned first (no waiting), so
    ``in_use_bytes`` counts only what the device may still read or callers still hold."""
    for arena in list(_ARENAS):
        arena.drain()
    return STATS.snapshot()


class HostRegion:
    """Host memory of an exact size, optionally pinned through callbacks.

    ``page_aligned`` (for memory a driver will register): its own ``mmap``, rounded to the
    page. Otherwise (simulated pinned memory): 64-byte aligned, rounded to 64 bytes.
    ``as_tensor()`` returns a zero-filled uint8 tensor over it; NumPy keeps this object as the
    array's base, so the region lives exactly as long as any tensor or view made from it.
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
    ) -> None:
        self.nbytes = int(nbytes)
        self._mm: mmap.mmap | None = None
        self._buf: np.ndarray | None = None
        if page_aligned:
            self.size = max(PAGE, (self.nbytes + PAGE - 1) // PAGE * PAGE)
            self._mm = mmap.mmap(-1, self.size)  # zero-filled, page-aligned
            view = ctypes.c_char.from_buffer(self._mm)
            self.ptr = ctypes.addressof(view)
            del view  # release the buffer export so the mapping can be closed later
        else:
            self.size = max(ALIGN, align_up(self.nbytes))
            self._buf = np.zeros(self.size + ALIGN, dtype=np.uint8)
            base = self._buf.ctypes.data
            self.ptr = align_up(base)
        self._alive = True
        self._unpin = unpin
        self._on_free = on_free
        self._requested = self.nbytes if requested is None else requested
        self._in_use = in_use
        if pin is not None:
            try:
                pin(self.ptr, self.size)
            except BaseException:
                self._close()
                raise
        STATS.reserve(self.size)
        if in_use:
            STATS.use(self.size, self._requested)
        self.__array_interface__ = {
            "data": (self.ptr, False),
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "version": 3,
        }

    def as_tensor(self) -> torch.Tensor:
        return torch.from_numpy(np.asarray(self))

    def _close(self) -> None:
        self._alive = False
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        self._buf = None

    def __del__(self) -> None:
        if not getattr(self, "_alive", False):
            return
        try:
            if self._unpin is not None:
                self._unpin(self.ptr, self.size)
            if self._on_free is not None:
                self._on_free(self)
        except Exception:  # noqa: BLE001 - interpreter shutdown: the driver may be gone
            pass
        finally:
            STATS.unreserve(self.size)
            if self._in_use:
                STATS.unuse(self.size, self._requested)
            self._close()


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


def staging_limit(default: int | None = None) -> int:
    """The staging cap: ``PINSTAGE_STAGING_LIMIT`` if set, else ``default`` (a platform's cap,
    such as WSL's), else 256 MiB."""
    raw = os.environ.get("PINSTAGE_STAGING_LIMIT")
    if raw is None or raw.strip() == "":
        return default or DEFAULT_STAGING_LIMIT
    return parse_size(raw, "PINSTAGE_STAGING_LIMIT")


# --------------------------------------------------------------------------------------------
# Staging arena


class Region:
    """Bytes ``start:end`` of a staging block, handed out to one call."""

    __slots__ = ("block", "start", "end", "requested", "event", "released", "fenced")

    def __init__(self, block: _Block, start: int, end: int, requested: int) -> None:
        self.block = block
        self.start = start
        self.end = end
        self.requested = requested
        self.event: Any = None  # recorded after the last device reader (see release)
        self.released = False  # the caller has enqueued every device reader
        self.fenced = False  # ``event`` covers those readers

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def tensor(self, nbytes: int | None = None) -> torch.Tensor:
        """The first ``nbytes`` (default: all requested) as a uint8 tensor."""
        n = self.requested if nbytes is None else nbytes
        return torch.from_numpy(self.block.np[self.start : self.start + n])


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


class StagingArena:
    """Pinned staging memory for one device: ring allocation, event-fenced reuse, a byte cap.

    ``alloc(n)`` returns a :class:`Region`; the caller fills it, enqueues the device work that
    reads it, then calls ``release(region)``, which records an event after that work. The
    region's bytes are handed out again only once that event has completed. When the arena is
    full it grows (doubling, within ``limit``) or waits for the oldest region's event; it never
    falls back to pageable memory.
    """

    def __init__(self, backend: Backend, limit: int, initial: int = 1 << 20) -> None:
        self.backend = backend
        self.limit = int(limit)
        self.initial = min(int(initial), self.limit)
        self._blocks: list[_Block] = []  # retired blocks first, the current one last
        self._lock = STATS.lock
        self._unfenced: list[Region] = []  # released, no event recorded after them yet
        self._unfenced_bytes = 0
        self._unfenced_stream: Any = None
        _ARENAS.add(self)

    @property
    def reserved(self) -> int:
        return sum(b.size for b in self._blocks)

    def alloc(self, nbytes: int) -> Region:
        n = align_up(max(int(nbytes), 1))
        if n > self.limit:
            raise ValueError(f"staging request of {nbytes} bytes exceeds the staging limit "
                             f"of {self.limit} bytes; stage it in pieces")
        with self._lock:
            region = self._try_alloc(n, nbytes)  # common case: room ahead in the ring
            while region is None:
                self._reclaim()  # take back what the device has finished reading
                region = self._try_alloc(n, nbytes)
                if region is None and not self._grow(n):
                    self._wait_oldest()
            return region

    def release(self, region: Region) -> None:
        """Mark ``region`` reusable once the device work enqueued so far has completed.

        Fences are batched: one event covers several released regions (an event that completes
        implies every copy enqueued before it has), recorded every few releases, or at once
        when the arena needs the space."""
        if region.released:
            return
        region.released = True
        with self._lock:
            stream = self.backend.current_stream()
            if stream != self._unfenced_stream:  # one event covers one stream only
                self._fence()
                self._unfenced_stream = stream
            self._unfenced.append(region)
            self._unfenced_bytes += region.nbytes
            if len(self._unfenced) >= FENCE_EVERY or \
                    self._unfenced_bytes * 8 >= region.block.size:
                self._fence()

    def _fence(self) -> None:
        if self._unfenced:
            event = self.backend.record_event(self._unfenced_stream)
            for r in self._unfenced:
                r.event = event
                r.fenced = True
            self._unfenced.clear()
            self._unfenced_bytes = 0

    def _try_alloc(self, n: int, requested: int) -> Region | None:
        if not self._blocks:
            return None
        block = self._blocks[-1]
        start = block.try_alloc(n)
        if start is None:
            return None
        region = Region(block, start, start + n, requested)
        block.head = start + n
        block.live.append(region)
        STATS.use_locked(n, requested)
        return region

    def _free(self, block: _Block) -> None:
        region = block.live.popleft()
        STATS.in_use_bytes -= region.nbytes  # under STATS.lock (the arena's lock)
        STATS.requested_bytes -= region.requested

    def _reclaim(self) -> None:
        for block in list(self._blocks):
            while block.live:
                r = block.live[0]
                if not r.fenced or not self.backend.event_done(r.event):
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
        tensor = self.backend.alloc_pinned(size, in_use=False)
        if self._blocks and not self._blocks[-1].live:
            self._blocks.pop()
        self._blocks.append(_Block(tensor))
        return True

    def _wait_oldest(self) -> None:
        for block in self._blocks:
            if block.live:
                r = block.live[0]
                if not r.released:
                    raise RuntimeError(
                        "pinstage staging arena is full of regions still being filled; "
                        "raise PINSTAGE_STAGING_LIMIT")
                if not r.fenced:
                    self._fence()
                STATS.waits += 1
                self.backend.wait_event(r.event)
                return
        raise RuntimeError("pinstage staging arena cannot satisfy the request")  # unreachable

    def drain(self) -> None:
        """Fence what was released and forget the regions whose readers have completed."""
        with self._lock:
            self._fence()
            self._reclaim()
