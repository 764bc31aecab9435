"""The simulated device's caching allocator: device memory freed on the host (its last
tensor gone) goes back to a pool of the stream it was allocated on, as PyTorch's allocator
does, and the next allocation on that stream of a size it fits reuses it.

Reuse is where a missing ``record_stream`` bites: work queued on another stream may still
read or write the memory when the new owner writes it. The race detector sees that (the
memory's accesses survive the free, as the bytes do), and names the reuse in its message.
``Tensor.record_stream(s)`` holds the memory back until the work queued on ``s`` by the time
it was freed has completed (checked when an allocation looks, as PyTorch's allocator queries
its events), and the host then knows that work done.

``memory_allocated``/``memory_reserved``/``max_memory_*``/``mem_get_info``/``memory_stats``
(per pool: a block up to 1 MiB is small-pool) and ``memory_snapshot``/``MemPool.snapshot()``
(each block a segment of one block: blocks are never split) follow it; a limit
(``simulated_accelerator(memory=...)``, or the share of it
``set_per_process_memory_fraction`` allows) makes an allocation that does not fit, after
giving back the free cached blocks, raise ``torch.cuda.OutOfMemoryError``.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import itertools
import math
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["Allocator", "Handle", "c_names", "cuda_names", "new_pool_id", "pool_id_of",
           "ROUND", "SMALL"]

_SPAN = "_pinstage_sim_span"  # (_races' attribute of a tensor's span)
ROUND = 512  # block sizes are multiples of this, as in PyTorch's allocator
TOTAL = 80 * 2**30  # the device memory reported when no limit is set
SMALL = 2**20  # blocks up to this size are the small pool's (PyTorch's kSmallSize), the rest large
# Free cached blocks kept at most (the device's memory is the host's here: a long session of
# varied sizes must not grow without bound); beyond it the largest are given back.
CACHE_KEEP = 256 * 2**20


class _Block:
    __slots__ = ("buf", "cap_pending", "kind", "layouts", "pending", "pool", "region",
                 "requested", "size", "stream", "views")

    def __init__(self, buf: torch.Tensor, size: int, stream: Any, pool: Any = None) -> None:
        self.buf, self.size, self.stream = buf, size, stream
        self.kind = "small_pool" if size <= SMALL else "large_pool"
        self.requested = 0  # the bytes its current allocation asked for (0 while inactive)
        # the private pool it belongs to (allocated while a graph was captured, or under
        # use_mem_pool): freed, it goes back there, for allocations into that pool only (a
        # graph's replays still write it), and to the device once the pool's users are gone
        self.pool = pool
        self.pending: list[tuple[Any, int, dict[int, int]]] = []  # (stream, seq, clock)
        # freed during a capture with recorded streams: (stream, ops captured there by
        # then) each; held while any capture is underway, as PyTorch does (see _collect)
        self.cap_pending: list[tuple[Any, int]] | None = None
        self.views: dict[torch.dtype, torch.Tensor] = {}  # the whole block, per dtype
        # the tensors it was last handed out as, by their layout's number (_layout): the next
        # owner of that layout gets the same one (making a view is most of an allocation's
        # cost)
        self.layouts: dict[int, torch.Tensor] = {}
        self.region: Any = None  # what the race tracker knows of its memory (its _region)


_ITEMSIZE: dict[torch.dtype, int] = {}


class Handle:
    """Held by every simulated tensor over one block: when the last goes, so does the
    block (to its pool). ``record_stream`` adds the streams it must wait for."""

    __slots__ = ("__weakref__", "alloc", "block", "streams")

    def __init__(self, alloc: Allocator, block: _Block) -> None:
        self.alloc, self.block = alloc, block
        self.streams: tuple[Any, ...] = ()  # (most tensors never see record_stream)

    def record(self, stream: Any) -> None:
        if stream is not self.block.stream and all(s is not stream for s in self.streams):
            self.streams = (*self.streams, stream)

    def __del__(self) -> None:
        try:  # (may run anywhere, as the collector frees it: only a thread-safe append here)
            block = self.block
            if self.streams:
                block.pending = [(s, s.last, s.sched.races.snapshot(s)) for s in self.streams]
                if self.streams[0].sched.capturing_any():  # (their captured work: _collect)
                    block.cap_pending = [(s, s.cap_n) for s in self.streams]
            self.alloc.freed.append(block)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


# PyTorch's per-pool statistics (``memory_stats()``'s "<name>.<all|small_pool|large_pool>.
# <current|peak|allocated|freed>"): a block is one segment here, never split, so the
# inactive_split ones stay 0
_STATS = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
          "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
_KINDS = ("all", "small_pool", "large_pool")


class Allocator:
    """One simulated device's memory: blocks in use, per-stream pools of free ones. A block
    is one segment (one cudaMalloc of PyTorch's), small-pool up to :data:`SMALL` bytes."""

    def __init__(self, index: int, limit: int | None) -> None:
        self.index = index
        self.limit = limit
        self.fraction = 1.0  # set_per_process_memory_fraction's share of the device's memory
        self.freed: collections.deque[_Block] = collections.deque()
        self.pools: dict[int, list[_Block]] = {}  # stream id -> free blocks, by size
        self.waiting: list[_Block] = []  # freed, held for recorded streams' work
        self.live: dict[int, _Block] = {}  # id -> block allocated (a tensor holds it)
        # "<stat>.<kind>" -> [current, peak, allocated, freed]
        self.st: dict[str, list[int]] = {f"{n}.{k}": [0, 0, 0, 0] for n in _STATS
                                         for k in _KINDS}
        self.counts = {"num_alloc_retries": 0, "num_ooms": 0, "num_sync_all_streams": 0}
        # private pools (graphs', MemPools'): id -> free blocks by size, id -> users (graphs
        # captured into it, live MemPool objects, open use_mem_pool blocks)
        self.private: dict[Any, list[_Block]] = {}
        self.users: dict[Any, int] = {}
        self.unused: collections.deque[Any] = collections.deque()  # users gone (from __del__)
        self.routes: dict[int, list[Any]] = {}  # thread id -> use_mem_pool ids, innermost last
        self.capture_reuse = False  # PyTorch's graph_capture_record_stream_reuse setting
        # per pool kind, the stat lists (of the kind and of "all") each event moves, found
        # once: every allocation and free moves ten of them
        st = self.st

        def lists(kind: str, *names: str) -> tuple[list[int], ...]:
            return tuple(st[f"{n}.{k}"] for n in names for k in (kind, "all"))

        self._rows = {kind: (lists(kind, "allocation", "active"),
                             lists(kind, "allocated_bytes", "active_bytes"),
                             lists(kind, "requested_bytes"), lists(kind, "allocation"),
                             lists(kind, "allocated_bytes"), lists(kind, "active"),
                             lists(kind, "active_bytes"), lists(kind, "segment"),
                             lists(kind, "reserved_bytes"))
                      for kind in _KINDS[1:]}
        self._allocated = st["allocated_bytes.all"]
        self._reserved = st["reserved_bytes.all"]
        # per pool kind: [blocks, bytes, requested bytes] of the recycles (_recycle) not yet
        # in the running totals (allocated, freed) of the counts, bytes and requested bytes
        self._cycled = {kind: [0, 0, 0] for kind in _KINDS[1:]}

    def _fold(self) -> None:
        """Add the recycles counted in :attr:`_cycled` to the running totals."""
        for kind, (n, nbytes, req) in self._cycled.items():
            if n:
                rows = self._rows[kind]
                for stats, k in ((rows[_COUNTS], n), (rows[_BYTES], nbytes),
                                 (rows[_REQUESTED], req)):
                    for stat in stats:
                        stat[2] += k
                        stat[3] += k
                self._cycled[kind] = [0, 0, 0]

    # -- statistics --------------------------------------------------------------------------
    @property
    def allocated(self) -> int:
        return self._allocated[0]

    @property
    def reserved(self) -> int:
        return self._reserved[0]

    def _new_segment(self, block: _Block) -> None:
        rows = self._rows[block.kind]
        _up(rows[_SEGMENT], 1)
        _up(rows[_RESERVED], block.size)

    def _release(self, block: _Block) -> None:
        """``block`` goes back to the device (cudaFree)."""
        rows = self._rows[block.kind]
        _down(rows[_SEGMENT], 1)
        _down(rows[_RESERVED], block.size)

    def _inactive(self, block: _Block) -> None:
        """A freed block no work is pending on: no longer active."""
        rows = self._rows[block.kind]
        _down(rows[_ACTIVE], 1)
        _down(rows[_ACTIVE_BYTES], block.size)
        _down(rows[_REQUESTED], block.requested)
        block.requested = 0

    # -- freeing -----------------------------------------------------------------------------
    def _collect(self, stream: Any = None) -> None:
        """Take in what was freed since, and what its recorded streams have finished (for
        an allocation on ``stream``, if given)."""
        while self.unused:
            self.release_pool(self.unused.popleft())
        freed = self.freed
        while freed:
            block = freed.popleft()
            self.live.pop(id(block), None)
            rows = self._rows[block.kind]
            _down(rows[_ALLOCATION], 1)
            _down(rows[_ALLOCATED], block.size)
            if block.pending:  # (still active, as PyTorch's until its events complete)
                self.waiting.append(block)
            else:
                self._inactive(block)
                self._pool(block)
        if self.waiting:
            still = []
            for block in self.waiting:
                if block.cap_pending is not None and not self._captured_done(block, stream):
                    still.append(block)
                    continue
                if all(s.done >= seq for s, seq, _ in block.pending):
                    for s, _, clock in block.pending:  # (the allocator saw them complete)
                        s.sched.races.host_join(clock)
                    block.pending = []
                    self._inactive(block)
                    self._pool(block)
                else:
                    still.append(block)
            self.waiting = still

    def _captured_done(self, block: _Block, stream: Any) -> bool:
        """Whether a block freed during a capture may be handed out again: PyTorch holds it
        until no capture is underway; with ``graph_capture_record_stream_reuse:True``, also
        once the allocating stream's captured work is ordered after each recorded stream's
        work up to the free (CUDA's graph edges: wait_stream/wait_event in the capture)."""
        pending = block.cap_pending
        if not pending or not pending[0][0].sched.capturing_any():
            block.cap_pending = None
            return True
        if not self.capture_reuse or stream is None or stream.capture is None:
            return False
        clock = stream.cap_clock
        if all(s is stream or clock.get(s.stream_id, 0) >= n for s, n in pending):
            block.cap_pending = None
            return True
        return False

    def _pool(self, block: _Block) -> None:
        if block.pool is not None:
            private = self.private.get(block.pool) if self.users.get(block.pool) else None
            if private is None:  # its pool has no users left: back to the device
                self._release(block)
            else:
                bisect.insort(private, block, key=_size)
            return
        pool = self.pools.setdefault(block.stream.stream_id, [])
        bisect.insort(pool, block, key=_size)
        cached = self.reserved - self.allocated - (
            sum(b.size for b in self.waiting) if self.waiting else 0)
        while cached > CACHE_KEEP:
            biggest = max((p for p in self.pools.values() if p), key=lambda p: p[-1].size)
            gone = biggest.pop()
            self._release(gone)
            cached -= gone.size

    # -- private pools ---------------------------------------------------------------------
    def use_pool(self, pool: Any) -> None:
        """One more user of private pool ``pool`` (a graph capturing into it, a MemPool)."""
        self.users[pool] = self.users.get(pool, 0) + 1
        self.private.setdefault(pool, [])

    def release_pool(self, pool: Any) -> None:
        """One user fewer: the last one gone, the pool's free blocks go back to the device
        (blocks still in use follow when they are freed)."""
        n = self.users.get(pool, 0) - 1
        if n > 0:
            self.users[pool] = n
            return
        self.users.pop(pool, None)
        for block in self.private.pop(pool, []):
            self._release(block)

    def route(self, pool: Any | None) -> None:
        """``use_mem_pool``: this thread's allocations go to ``pool`` (``None``: the
        innermost route ends)."""
        import threading

        me = threading.get_ident()
        if pool is not None:
            self.routes.setdefault(me, []).append(pool)
            return
        stack = self.routes.get(me)
        if stack:
            stack.pop()
            if not stack:
                del self.routes[me]

    def _private_of(self, stream: Any) -> Any:
        """The private pool an allocation on ``stream`` goes to now, if any."""
        graph = stream.capture
        if graph is not None:
            return getattr(graph, "_pool_id", None) or (0, id(graph))
        if self.routes:
            import threading

            stack = self.routes.get(threading.get_ident())
            if stack:
                return stack[-1]
        return None

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: give back every free cached block (a private
        pool's are kept while it has users, as PyTorch does). As PyTorch's, it first waits
        on the host for the recorded streams' work that freed blocks are still held for, so
        those go back too (one ``num_sync_all_streams``); not while a capture is underway."""
        self._collect()
        self.counts["num_sync_all_streams"] += 1
        for block in list(self.waiting):
            for s, seq, _ in block.pending:
                if s.done < seq and not s.sched.capturing_any():
                    s.sched.host_wait(s, seq, "torch.cuda.empty_cache() (a freed block's "
                                      "recorded streams)", sync_debug=False)
        self._collect()
        for pool in self.pools.values():
            for block in pool:
                self._release(block)
            pool.clear()

    # -- allocating --------------------------------------------------------------------------
    def empty_strided(self, shape: tuple[int, ...], stride: tuple[int, ...],
                      dtype: torch.dtype, stream: Any, layout: Any = None
                      ) -> tuple[torch.Tensor, Handle | None, bool]:
        """Device memory for a tensor of this layout (``layout``: its :func:`layout_of`, if
        the caller keeps it), allocated on ``stream``: the tensor (a view of its block), the
        block's handle (``None`` for no bytes) and whether the block is new (a reused one
        holds its last owner's bytes, which queued work may still read: nothing may write it
        now)."""
        if layout is None:
            layout = _LAYOUTS.get((shape, stride, dtype)) or _layout(shape, stride, dtype)
        nbytes, size, numel, key = layout
        if nbytes == 0:
            return torch.empty_strided(shape, stride, dtype=dtype, device="cpu"), None, True
        block = self._recycle(size, stream, nbytes)
        if block is not None:
            new = False
        else:
            block, new = self._take(size, stream, nbytes)
        races = stream.sched.races
        held = block.region
        if held is None or held[0] is not races:
            held = block.region = races._region(block.buf)
        view = block.layouts.get(key)
        if view is not None:  # (its last owner is gone; nothing changes a host tensor's
            return view, Handle(self, block), new  # metadata in place: see _ops._inplace_view)
        # (not an inference tensor: the block is handed out again after inference mode ends)
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False):
                view = _view_of(block, shape, stride, dtype)
        else:
            view = _view_of(block, shape, stride, dtype)
        ptr = view.data_ptr()  # (the race tracker's span of it, known here: see _races._span)
        if view.is_contiguous():  # (else _races works out its strided span)
            setattr(view, _SPAN, (ptr, numel, ptr, ptr + nbytes, held, None, shape, dtype))
        if len(block.layouts) >= 8:
            block.layouts.clear()
        block.layouts[key] = view
        return view, Handle(self, block), new

    def _take(self, size: int, stream: Any, requested: int) -> tuple[_Block, bool]:
        """A block of ``size`` bytes for ``stream`` (where :meth:`_recycle` has none): a
        free one from its pool, else a new segment; and whether it is new."""
        self._collect(stream)
        private = self._private_of(stream) if stream.capture is not None or self.routes \
            else None
        if private is not None:
            pool = self.private.get(private)
            if pool is None:  # (an allocation into a pool nothing holds: a user for it)
                self.use_pool(private)
                pool = self.private[private]
                self.unused.append(private)  # (released once this block is back)
        else:
            pool = self.pools.get(stream.stream_id)
        if pool:
            small = size <= SMALL  # (PyTorch's small and large pools are apart)
            for i, block in enumerate(pool):
                if size <= block.size <= 2 * size and (block.size <= SMALL) == small:
                    del pool[i]
                    held = block.region
                    if held is not None and held[0] is stream.sched.races:
                        held[3] += 1  # (the tracker's reused(), its region known)
                    else:
                        stream.sched.races.reused(block.buf)
                    return self._use(block, requested), False
        if size >= _ONE_EB:
            self.counts["num_ooms"] += 1
            raise torch.cuda.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate more than 1EB memory.")
        limit = self.allowed()
        if self.reserved + size > limit:
            self.counts["num_alloc_retries"] += 1
            self.empty_cache()
            if self.reserved + size > limit:
                self.counts["num_ooms"] += 1
                total = self.capacity()
                free = max(0, total - self.reserved)
                how = "simulated_accelerator(memory=...)" if self.limit is not None else \
                    "the simulated device's default memory; simulated_accelerator(memory=...)"
                share = "" if limit == total else (
                    f" This process may reserve {_bytes_text(limit)} of it "
                    f"(set_per_process_memory_fraction({self.fraction})).")
                raise torch.cuda.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate {_bytes_text(size)}. GPU {self.index} "
                    f"has a total capacity of {_bytes_text(total)} of which {_bytes_text(free)} is "
                    f"free.{share} Of the allocated memory {_bytes_text(self.allocated)} is "
                    f"allocated by PyTorch, and {_bytes_text(self.reserved - self.allocated)} is "
                    f"reserved by PyTorch but unallocated. (simulated: {how} sets the capacity)")
        block = _Block(torch.empty(size, dtype=torch.uint8, device="cpu"), size, stream,
                       private)
        self._new_segment(block)
        return self._use(block, requested), True

    def _recycle(self, size: int, stream: Any, requested: int) -> _Block | None:
        """The common allocation (a loop's temporaries): the only block freed since the last
        allocation is the one :meth:`_collect` then :meth:`_take`'s search would hand out
        (nothing else waiting or pooled comes first, the pool's trim keeps it): that block,
        with the same statistics, without pooling it; else ``None``."""
        freed = self.freed
        if len(freed) != 1 or self.unused or self.waiting or self.routes or \
                stream.capture is not None:
            return None
        block = freed[0]
        bs = block.size
        small = size <= SMALL
        if block.pending or block.pool is not None or block.stream is not stream or \
                not size <= bs <= 2 * size or (bs <= SMALL) != small:
            return None
        pool = self.pools.get(stream.stream_id)
        if pool:  # (sorted by size: one that fits before it would be taken instead)
            for b in pool:
                if b.size > bs:
                    break
                if size <= b.size and (b.size <= SMALL) == small:
                    return None
        if self._reserved[0] - (self._allocated[0] - bs) > CACHE_KEEP:  # (_pool would trim)
            return None
        freed.popleft()
        live = self.live
        live.pop(id(block), None)
        old = block.requested
        if old == requested:  # (freed, inactive, allocated and active again: only the running
            cycled = self._cycled[block.kind]  # totals move, counted here until read)
            cycled[0] += 1
            cycled[1] += bs
            cycled[2] += requested
        else:
            rows = self._rows[block.kind]
            for stat in rows[_COUNTS]:
                stat[2] += 1
                stat[3] += 1
            for stat in rows[_BYTES]:
                stat[2] += bs
                stat[3] += bs
            for stat in rows[_REQUESTED]:
                cur = stat[0] = stat[0] - old + requested
                stat[2] += requested
                stat[3] += old
                if cur > stat[1]:
                    stat[1] = cur
            block.requested = requested
        held = block.region
        races = stream.sched.races
        if held is not None and held[0] is races:
            held[3] += 1
        else:
            races.reused(block.buf)
        live[id(block)] = block
        return block

    def _use(self, block: _Block, requested: int) -> _Block:
        rows = self._rows[block.kind]
        _up(rows[_COUNTS], 1)  # allocation, active
        _up(rows[_BYTES], block.size)  # allocated_bytes, active_bytes
        _up(rows[_REQUESTED], requested)
        block.requested = requested
        self.live[id(block)] = block
        return block

    def capacity(self) -> int:
        """The device's memory: the simulator's limit, else :data:`TOTAL`."""
        return TOTAL if self.limit is None else self.limit

    def allowed(self) -> int:
        """The most this process may reserve: the device's memory times the fraction
        ``set_per_process_memory_fraction`` set (PyTorch's allowed maximum)."""
        cap = self.capacity()
        return cap if self.fraction >= 1.0 else int(cap * self.fraction)

    # -- torch.cuda's view -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        self._collect()
        self._fold()
        out: dict[str, Any] = {}
        for key, (cur, peak, made, gone) in self.st.items():
            out[f"{key}.current"] = cur
            out[f"{key}.peak"] = peak
            out[f"{key}.allocated"] = made
            out[f"{key}.freed"] = gone
        out.update(self.counts)
        segments = self.st["segment.all"]
        out["num_device_alloc"] = segments[2]  # (a segment is one cudaMalloc, and cudaFree)
        out["num_device_free"] = segments[3]
        return dict(sorted(out.items()))

    def blocks_in_use(self) -> int:
        return self.st["allocation.all"][0]

    def reset_accumulated(self) -> None:
        """``reset_accumulated_memory_stats``: the running totals (allocated, freed) start
        again from 0, as PyTorch's reset_accumulated_stat does (current and peak stay)."""
        self._collect()
        self._fold()
        for stat in self.st.values():
            stat[2], stat[3] = 0, 0
        for key in self.counts:
            self.counts[key] = 0

    def reset_peak(self) -> None:
        self._collect()
        for stat in self.st.values():
            stat[1] = stat[0]

    def mem_get_info(self) -> tuple[int, int]:
        self._collect()
        total = self.capacity()
        return total - self.reserved, total

    def segments(self, pool: Any = None) -> list[dict[str, Any]]:
        """``memory_snapshot()``'s segments of this device (of private pool ``pool`` only,
        if given), by address: each block is a segment of one block."""
        self._collect()
        blocks = [(b, "active_allocated") for b in self.live.values()]
        blocks += [(b, "active_pending_free") for b in self.waiting]
        for free in (*self.pools.values(), *self.private.values()):
            blocks += [(b, "inactive") for b in free]
        out = []
        for block, state in blocks:
            owner = block.pool if block.pool is not None else (0, 0)
            if pool is not None and owner != pool:
                continue
            address = block.buf.data_ptr()
            size, requested = block.size, block.requested
            active = state != "inactive"
            out.append({
                "device": self.index, "address": address, "total_size": size,
                "allocated_size": size if state == "active_allocated" else 0,
                "active_size": size if active else 0, "requested_size": requested,
                "stream": block.stream.cuda_stream,
                "segment_type": "small" if block.kind == "small_pool" else "large",
                "segment_pool_id": owner, "is_expandable": False, "frames": [],
                "blocks": [{"address": address, "size": size, "requested_size": requested,
                            "state": state, "frames": []}]})
        out.sort(key=lambda seg: seg["address"])
        return out


_uids = itertools.count(1)


def new_pool_id() -> tuple[int, int]:
    """A fresh private-pool id, as ``graph_pool_handle()`` gives (an opaque pair of ints)."""
    return (0, next(_uids))


def pool_id_of(pool: Any) -> tuple[int, int]:
    """A pool argument (``graph_pool_handle()``, ``g.pool()``, a MemPool or its ``id``) as an
    id; ``TypeError`` naming anything else."""
    pool = getattr(pool, "id", pool)
    if isinstance(pool, tuple) and len(pool) == 2 and all(isinstance(x, int) for x in pool):
        return pool
    raise TypeError(f"a memory pool must be a MemPool, graph_pool_handle() or "
                    f"CUDAGraph.pool(), got {pool!r}")


def _size(block: _Block) -> int:
    return block.size


# Allocator._rows' entries: the stat lists an allocation moves up (counts, bytes, requested
# bytes), and those a free, an inactive block and a segment move
_COUNTS, _BYTES, _REQUESTED, _ALLOCATION, _ALLOCATED, _ACTIVE, _ACTIVE_BYTES, _SEGMENT, \
    _RESERVED = range(9)


def _up(stats: tuple[list[int], ...], n: int) -> None:
    """Stats ([current, peak, allocated, freed] each) grow by ``n``."""
    for stat in stats:
        cur = stat[0] + n
        stat[0] = cur
        stat[2] += n
        if cur > stat[1]:
            stat[1] = cur


def _down(stats: tuple[list[int], ...], n: int) -> None:
    """Stats shrink by ``n``."""
    for stat in stats:
        stat[0] -= n
        stat[3] += n


def _view_of(block: _Block, shape: tuple[int, ...], stride: tuple[int, ...],
             dtype: torch.dtype) -> torch.Tensor:
    typed = block.views.get(dtype)
    if typed is None:  # (a block's size is a multiple of every dtype's size)
        typed = block.views[dtype] = block.buf.view(dtype)
    return typed.as_strided(shape, stride)


# (shape, stride, dtype) -> (bytes it spans, the block size it takes, elements, a number
# of its own: a block's key for the tensor it was last of this layout)
_LAYOUTS: dict[tuple[Any, Any, torch.dtype], tuple[int, int, int, int]] = {}
_LAYOUT_NUMBERS = itertools.count()


def layout_of(shape: tuple[int, ...], stride: tuple[int, ...],
              dtype: torch.dtype) -> tuple[int, int, int, int]:
    """What :meth:`Allocator.empty_strided` needs of this layout (a caller that allocates
    it again and again keeps it)."""
    return _LAYOUTS.get((shape, stride, dtype)) or _layout(shape, stride, dtype)


def _layout(shape: tuple[int, ...], stride: tuple[int, ...],
            dtype: torch.dtype) -> tuple[int, int, int, int]:
    itemsize = _ITEMSIZE.get(dtype)
    if itemsize is None:
        itemsize = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype, device="cpu").element_size()
    n = 0 if 0 in shape else 1 + sum((d - 1) * s for d, s in zip(shape, stride))
    nbytes = n * itemsize
    layout = (nbytes, max(ROUND, -(-nbytes // ROUND) * ROUND), math.prod(shape),
              next(_LAYOUT_NUMBERS))
    if len(_LAYOUTS) > 4096:
        _LAYOUTS.clear()
    _LAYOUTS[(shape, stride, dtype)] = layout
    return layout


_ONE_EB = 2**60  # CUDA's caching allocator refuses any single request from here on


def _bytes_text(n: int) -> str:
    """A byte count as CUDA's out-of-memory message writes it (bytes, KiB, MiB or GiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"


def cuda_names(allocators: list[Allocator], index_of: Any) -> dict[str, Any]:
    """The ``torch.cuda`` memory functions over the simulated allocators."""

    def of(device: Any = None) -> Allocator:
        return allocators[index_of(device)]

    def empty_cache() -> None:
        for a in allocators:
            a.empty_cache()

    def reset(device: Any = None) -> None:
        of(device).reset_peak()

    class MemPool:
        """``torch.cuda.MemPool`` while simulated: a private pool of device memory; inside
        ``use_mem_pool(pool)`` this thread's allocations come from it (memory freed there
        goes back to it, for its own allocations only), and graphs may capture into it
        (``torch.cuda.graph(g, pool=pool.id)``). Custom allocators are not simulated."""

        def __init__(self, allocator: Any = None, use_on_oom: bool = False,
                     no_split: bool = False) -> None:
            if allocator is not None:
                raise NotImplementedError("the simulated CUDA has no pluggable allocators: "
                                          "MemPool(allocator=...) is not supported")
            self._id = (next(_uids), 0)
            self._allocators = list(allocators)
            for a in self._allocators:
                a.use_pool(self._id)

        @property
        def id(self) -> tuple[int, int]:
            return self._id

        @property
        def allocator(self) -> None:
            return None

        def use_count(self) -> int:
            return of(None).users.get(self._id, 0)

        def snapshot(self, include_traces: bool = True) -> list[dict[str, Any]]:
            """This pool's segments, as ``memory_snapshot(pool.id)`` gives them."""
            return [seg for a in allocators for seg in a.segments(self._id)]

        def __del__(self) -> None:
            try:  # (may run anywhere, as the collector frees it: only a deque append)
                for a in self._allocators:
                    a.unused.append(self._id)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass

    @contextlib.contextmanager
    def use_mem_pool(pool: Any, device: Any = None) -> Iterator[None]:
        if not isinstance(pool, MemPool):
            raise TypeError(f"use_mem_pool() expects a torch.cuda.MemPool, got {pool!r}")
        a = of(device)
        a.use_pool(pool.id)
        a.route(pool.id)
        try:
            yield
        finally:
            a.route(None)
            a.release_pool(pool.id)

    return {
        "MemPool": MemPool,
        "use_mem_pool": use_mem_pool,
        "graph_pool_handle": new_pool_id,
        "memory_allocated": lambda device=None: of(device).stats()["allocated_bytes.all.current"],
        "max_memory_allocated": lambda device=None: of(device).stats()[
            "allocated_bytes.all.peak"],
        "memory_reserved": lambda device=None: of(device).stats()["reserved_bytes.all.current"],
        "max_memory_reserved": lambda device=None: of(device).stats()["reserved_bytes.all.peak"],
        "memory_stats": lambda device=None: of(device).stats(),
        "mem_get_info": lambda device=None: of(device).mem_get_info(),
        "reset_peak_memory_stats": reset,
        "reset_max_memory_allocated": reset,
        "reset_accumulated_memory_stats": lambda device=None: of(device).reset_accumulated(),
        "empty_cache": empty_cache,
    }


def c_names(allocators: list[Allocator], index_of: Any) -> dict[str, Any]:
    """The ``torch._C`` entry points of the allocator that ``torch.cuda.memory``'s Python
    functions call: ``memory_snapshot``/``_snapshot`` (``_cuda_memorySnapshot``) and the
    per-process memory fraction (``_cuda_setMemoryFraction``/``_cuda_getMemoryFraction``)."""

    def snapshot(arg: Any = None) -> dict[str, Any]:
        # (None: every pool; (a, b, include_traces): pool (a, b), (0, 0) meaning every one)
        pool = None
        if arg is not None:
            pool = (int(arg[0]), int(arg[1]))
            if pool == (0, 0):
                pool = None
        return {"segments": [seg for a in allocators for seg in a.segments(pool)],
                "device_traces": [[] for _ in allocators]}  # (no history is recorded)

    def set_fraction(fraction: float, device: Any = None) -> None:
        allocators[index_of(device)].fraction = float(fraction)

    return {
        "_cuda_memorySnapshot": snapshot,
        "_cuda_setMemoryFraction": set_fraction,
        "_cuda_getMemoryFraction": lambda device=None: allocators[index_of(device)].fraction,
    }
