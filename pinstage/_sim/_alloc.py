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
follow it; a limit (``simulated_accelerator(memory=...)``) makes an allocation that does not
fit, after giving back the free cached blocks, raise ``torch.cuda.OutOfMemoryError``.
"""

from __future__ import annotations

import bisect
import collections
from typing import Any

import torch

__all__ = ["Allocator", "Handle", "cuda_names", "ROUND"]

ROUND = 512  # block sizes are multiples of this, as in PyTorch's allocator
TOTAL = 80 * 2**30  # the device memory reported when no limit is set
# Free cached blocks kept at most (the device's memory is the host's here: a long session of
# varied sizes must not grow without bound); beyond it the largest are given back.
CACHE_KEEP = 256 * 2**20


class _Block:
    __slots__ = ("buf", "graph", "pending", "size", "stream", "views")

    def __init__(self, buf: torch.Tensor, size: int, stream: Any) -> None:
        self.buf, self.size, self.stream = buf, size, stream
        # allocated while a graph was captured: the graph's replays write it, so it is never
        # handed out again (a graph's private pool; its captured work keeps the bytes)
        self.graph = stream.capture is not None
        self.pending: list[tuple[Any, int, dict[int, int]]] = []  # (stream, seq, clock)
        self.views: dict[torch.dtype, torch.Tensor] = {}  # the whole block, per dtype


_ITEMSIZE: dict[torch.dtype, int] = {}


class Handle:
    """Held by every simulated tensor over one block: when the last goes, so does the
    block (to its pool). ``record_stream`` adds the streams it must wait for."""

    __slots__ = ("__weakref__", "alloc", "block", "streams")

    def __init__(self, alloc: Allocator, block: _Block) -> None:
        self.alloc, self.block = alloc, block
        self.streams: list[Any] = []

    def record(self, stream: Any) -> None:
        if stream is not self.block.stream and all(s is not stream for s in self.streams):
            self.streams.append(stream)

    def __del__(self) -> None:
        try:  # (may run anywhere, as the collector frees it: only a thread-safe append here)
            block = self.block
            if self.streams:
                block.pending = [(s, s.last, s.sched.races.snapshot(s)) for s in self.streams]
            self.alloc.freed.append(block)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class Allocator:
    """One simulated device's memory: blocks in use, per-stream pools of free ones."""

    def __init__(self, index: int, limit: int | None) -> None:
        self.index = index
        self.limit = limit
        self.freed: collections.deque[_Block] = collections.deque()
        self.pools: dict[int, list[_Block]] = {}  # stream id -> free blocks, by size
        self.waiting: list[_Block] = []  # freed, held for recorded streams' work
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0
        self.counts = {"allocation": 0, "free": 0, "num_alloc_retries": 0, "num_ooms": 0,
                       "segment": 0, "segment_free": 0}

    # -- freeing -----------------------------------------------------------------------------
    def _collect(self) -> None:
        """Take in what was freed since, and what its recorded streams have finished."""
        freed = self.freed
        while freed:
            block = freed.popleft()
            self.allocated -= block.size
            self.counts["free"] += 1
            if block.graph:
                self.reserved -= block.size
            elif block.pending:
                self.waiting.append(block)
            else:
                self._pool(block)
        if self.waiting:
            still = []
            for block in self.waiting:
                if all(s.done >= seq for s, seq, _ in block.pending):
                    for s, _, clock in block.pending:  # (the allocator saw them complete)
                        s.sched.races.host_join(clock)
                    block.pending = []
                    self._pool(block)
                else:
                    still.append(block)
            self.waiting = still

    def _pool(self, block: _Block) -> None:
        pool = self.pools.setdefault(block.stream.stream_id, [])
        bisect.insort(pool, block, key=_size)
        cached = self.reserved - self.allocated - (
            sum(b.size for b in self.waiting) if self.waiting else 0)
        while cached > CACHE_KEEP:
            biggest = max((p for p in self.pools.values() if p), key=lambda p: p[-1].size)
            gone = biggest.pop()
            self.reserved -= gone.size
            cached -= gone.size
            self.counts["segment_free"] += 1

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: give back every free cached block."""
        self._collect()
        for pool in self.pools.values():
            for block in pool:
                self.reserved -= block.size
                self.counts["segment_free"] += 1
            pool.clear()

    # -- allocating --------------------------------------------------------------------------
    def empty_strided(self, shape: tuple[int, ...], stride: tuple[int, ...],
                      dtype: torch.dtype, stream: Any
                      ) -> tuple[torch.Tensor, Handle | None, bool]:
        """Device memory for a tensor of this layout, allocated on ``stream``: the tensor (a
        view of its block), the block's handle (``None`` for no bytes) and whether the block
        is new (a reused one holds its last owner's bytes, which queued work may still
        read: nothing may write it now)."""
        itemsize = _ITEMSIZE.get(dtype)
        if itemsize is None:
            itemsize = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype, device="cpu").element_size()
        n = 0 if 0 in shape else 1 + sum((d - 1) * s for d, s in zip(shape, stride))
        if n == 0:
            return torch.empty_strided(shape, stride, dtype=dtype, device="cpu"), None, True
        nbytes = n * itemsize
        block, new = self._take(max(ROUND, -(-nbytes // ROUND) * ROUND), stream)
        typed = block.views.get(dtype)
        if typed is None:  # (a block's size is a multiple of every dtype's size)
            typed = block.views[dtype] = block.buf.view(dtype)
        return typed.as_strided(shape, stride), Handle(self, block), new

    def _take(self, size: int, stream: Any) -> tuple[_Block, bool]:
        self._collect()
        pool = self.pools.get(stream.stream_id) if stream.capture is None else None
        if pool:
            for i, block in enumerate(pool):
                if size <= block.size <= 2 * size:
                    del pool[i]
                    stream.sched.races.reused(block.buf)
                    return self._use(block), False
        if self.limit is not None and self.reserved + size > self.limit:
            self.counts["num_alloc_retries"] += 1
            self.empty_cache()
            if self.reserved + size > self.limit:
                self.counts["num_ooms"] += 1
                free = self.limit - self.reserved
                raise torch.cuda.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate {_mib(size)}. GPU {self.index} "
                    f"has a total capacity of {_mib(self.limit)} of which {_mib(free)} is "
                    f"free. Of the allocated memory {_mib(self.allocated)} is allocated by "
                    f"PyTorch, and {_mib(self.reserved - self.allocated)} is reserved by "
                    "PyTorch but unallocated. (simulated: simulated_accelerator(memory=...))")
        block = _Block(torch.empty(size, dtype=torch.uint8, device="cpu"), size, stream)
        self.reserved += size
        self.counts["segment"] += 1
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return self._use(block), True

    def _use(self, block: _Block) -> _Block:
        self.allocated += block.size
        self.counts["allocation"] += 1
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    # -- torch.cuda's view -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        self._collect()
        out: dict[str, Any] = {}
        for key, cur, peak in (("allocated_bytes", self.allocated, self.peak_allocated),
                               ("reserved_bytes", self.reserved, self.peak_reserved),
                               ("active_bytes", self.allocated, self.peak_allocated)):
            for pool in ("all", "small_pool", "large_pool"):
                big = pool == "large_pool"
                share = (cur, peak) if pool == "all" or big else (0, 0)
                out[f"{key}.{pool}.current"] = share[0]
                out[f"{key}.{pool}.peak"] = share[1]
        out.update({f"{k}.all.current" if k in ("allocation", "segment") else k: v
                    for k, v in self.counts.items()})
        out["num_device_alloc"] = self.counts["segment"]
        out["num_device_free"] = self.counts["segment_free"]
        return dict(sorted(out.items()))

    def reset_peak(self) -> None:
        self._collect()
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def mem_get_info(self) -> tuple[int, int]:
        self._collect()
        total = self.limit if self.limit is not None else TOTAL
        return total - self.reserved, total


def _size(block: _Block) -> int:
    return block.size


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def cuda_names(allocators: list[Allocator], index_of: Any) -> dict[str, Any]:
    """The ``torch.cuda`` memory functions over the simulated allocators."""

    def of(device: Any = None) -> Allocator:
        return allocators[index_of(device)]

    def empty_cache() -> None:
        for a in allocators:
            a.empty_cache()

    def reset(device: Any = None) -> None:
        of(device).reset_peak()

    return {
        "memory_allocated": lambda device=None: of(device).stats()["allocated_bytes.all.current"],
        "max_memory_allocated": lambda device=None: of(device).stats()[
            "allocated_bytes.all.peak"],
        "memory_reserved": lambda device=None: of(device).stats()["reserved_bytes.all.current"],
        "max_memory_reserved": lambda device=None: of(device).stats()["reserved_bytes.all.peak"],
        "memory_stats": lambda device=None: of(device).stats(),
        "mem_get_info": lambda device=None: of(device).mem_get_info(),
        "reset_peak_memory_stats": reset,
        "reset_max_memory_allocated": reset,
        "empty_cache": empty_cache,
    }
