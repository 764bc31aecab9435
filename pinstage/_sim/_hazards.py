"""What the simulated device checks about host memory: which ranges are pinned (by torch's
simulated caching allocator or registered by pinstage), the reads queued work makes of host
memory (snapshotted when queued, compared when the work runs), and poison.

A read of memory pinstage registered holds only a description of it (:class:`Registration`),
so unregistering it before the read ran is reported as the use-after-free it would be on a
GPU; torch-pinned blocks (:class:`PinnedBlock`) stay alive while queued reads hold them, as
torch's caching host allocator keeps them on CUDA.
"""

from __future__ import annotations

import bisect
import ctypes
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._errors import HazardError

__all__ = ["HostStats", "PinnedRanges", "Registration", "PinnedBlock", "HostRead", "poison_",
           "host_bytes", "span"]


def poison_(t: torch.Tensor) -> None:
    """Fill ``t`` with an obviously wrong value: NaN for floats, the dtype's minimum for signed
    integers, its maximum for unsigned ones (what a destination holds until the device
    writes it)."""
    if t.numel() == 0:
        return
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    elif torch.iinfo(t.dtype).min == 0:  # unsigned: the minimum (0) would look like data
        t.fill_(torch.iinfo(t.dtype).max)
    else:
        t.fill_(torch.iinfo(t.dtype).min)


def host_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (so NaN == NaN when comparing snapshots)."""
    flat = t.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(torch.uint8) if flat.dtype != torch.bool else flat


def span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range of memory ``t`` may touch."""
    if t.numel() == 0:
        return (t.data_ptr(), t.data_ptr())
    size = t.element_size()
    lo = hi = t.data_ptr()
    for n, st in zip(t.shape, t.stride()):
        if st >= 0:
            hi += (n - 1) * st * size
        else:
            lo += (n - 1) * st * size
    return (lo, hi + size)


class Registration:
    """Host memory pinstage registered with the (simulated) driver. Queued reads hold this,
    not the memory: if it is unregistered before they run, that is a use-after-free."""

    __slots__ = ("alive", "ptr", "size")

    def __init__(self, ptr: int, size: int) -> None:
        self.ptr, self.size, self.alive = ptr, size, True


class HostStats:
    """``torch.cuda.host_memory_stats()`` of the simulated caching host allocator: its
    blocks (sized up to a power of two, as PyTorch's) are not cached, so a block freed goes
    back to the host at once (``allocations`` and ``active_requests`` are the same blocks, and
    every free is a ``num_host_free``); the times are the host's, in microseconds."""

    _STATS = ("allocations", "allocated_bytes", "active_requests", "active_bytes")

    def __init__(self) -> None:
        self.st = {k: [0, 0, 0, 0] for k in self._STATS}  # [current, peak, allocated, freed]
        self.times = {k: [0, 0, 0, 0] for k in ("host_alloc_time", "host_free_time")}
        self._lock = threading.Lock()  # (frees run wherever the collector does)

    def _change(self, sign: int, nbytes: int, key: str, micros: int) -> None:
        with self._lock:
            for name, n in (("allocations", 1), ("allocated_bytes", nbytes),
                            ("active_requests", 1), ("active_bytes", nbytes)):
                stat = self.st[name]
                stat[0] += sign * n
                if sign > 0:
                    stat[2] += n
                    stat[1] = max(stat[1], stat[0])
                else:
                    stat[3] += n
            total, most, least, count = self.times[key]  # [total, max, min, count]
            self.times[key] = [total + micros, max(most, micros),
                               micros if count == 0 else min(least, micros), count + 1]

    def allocated(self, nbytes: int, micros: int) -> None:
        self._change(1, nbytes, "host_alloc_time", micros)

    def freed(self, nbytes: int, micros: int) -> None:
        self._change(-1, nbytes, "host_free_time", micros)

    def nested(self) -> dict[str, Any]:
        """As ``torch._C._cuda_hostMemoryStats()`` gives them (nested dicts)."""
        with self._lock:
            out: dict[str, Any] = {
                k: dict(zip(("current", "peak", "allocated", "freed"), v, strict=True))
                for k, v in self.st.items()}
            for key, (total, most, least, count) in self.times.items():
                out[key] = {"total": total, "max": most, "min": least, "count": count,
                            "avg": total // count if count else 0}
            out["num_host_alloc"] = self.times["host_alloc_time"][3]
            out["num_host_free"] = self.times["host_free_time"][3]
        return out

    def reset_accumulated(self) -> None:
        with self._lock:  # (the running totals start again from 0, as PyTorch's)
            for stat in self.st.values():
                stat[2], stat[3] = 0, 0
            for key in self.times:
                self.times[key] = [0, 0, 0, 0]

    def reset_peak(self) -> None:
        with self._lock:
            for stat in self.st.values():
                stat[1] = stat[0]


class PinnedRanges:
    """Live pinned host memory ranges (start -> (end, owner)), for 'is this pointer pinned'."""

    def __init__(self) -> None:
        self.stats = HostStats()  # (of the blocks torch pinned)
        self._starts: list[int] = []
        self._items: dict[int, tuple[int, Any]] = {}
        self._lock = threading.RLock()  # a block's __del__ may run inside add() (GC)

    def reset_lock(self) -> None:
        """In a forked child (the parent thread that held it is gone)."""
        self._lock = threading.RLock()

    def add(self, start: int, end: int, owner: Any, weak: bool = False) -> None:
        """``weak``: the range lives as long as ``owner`` does (torch-pinned blocks)."""
        ref = weakref.ref(owner) if weak else (lambda: owner)
        with self._lock:
            if start not in self._items:
                bisect.insort(self._starts, start)
            self._items[start] = (end, ref)

    def remove(self, start: int) -> Any:
        with self._lock:
            item = self._items.pop(start, None)
            if item is not None:
                del self._starts[bisect.bisect_left(self._starts, start)]
            return None if item is None else item[1]()

    def find(self, ptr: int) -> Any:
        with self._lock:
            i = bisect.bisect_right(self._starts, ptr) - 1
            if i < 0:
                return None
            end, ref = self._items[self._starts[i]]
            return ref() if ptr < end else None

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.numel() > 0 and self.find(t.data_ptr()) is not None

    def registration_of(self, t: torch.Tensor) -> Registration | None:
        owner = self.find(t.data_ptr()) if t.numel() else None
        return owner if isinstance(owner, Registration) else None


class PinnedBlock:
    """Host memory that torch's (simulated) caching host allocator pinned: ``pin_memory=True``,
    ``Tensor.pin_memory()``. Queued reads keep it alive, as torch's allocator does on CUDA."""

    def __init__(self, ranges: PinnedRanges, nbytes: int) -> None:
        # (its size rounded up to a power of two, as PyTorch's caching host allocator does)
        self.size = 1 << max(nbytes - 1, 0).bit_length()
        start = time.perf_counter_ns()
        self._buf = np.zeros(self.size + 64, dtype=np.uint8)
        base = self._buf.ctypes.data
        self.ptr = (base + 63) // 64 * 64
        self.nbytes = nbytes
        self._ranges = ranges
        self.__array_interface__ = {"data": (self.ptr, False), "shape": (nbytes,),
                                    "typestr": "|u1", "version": 3}
        ranges.add(self.ptr, self.ptr + max(nbytes, 1), self, weak=True)
        ranges.stats.allocated(self.size, (time.perf_counter_ns() - start) // 1000)

    def __del__(self) -> None:
        try:
            start = time.perf_counter_ns()
            self._ranges.remove(self.ptr)
            del self._buf  # (the host memory goes back here)
            self._ranges.stats.freed(self.size, (time.perf_counter_ns() - start) // 1000)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _from_address(ptr: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over raw host memory (used only while its registration is alive)."""
    buf = (ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr)
    return torch.from_numpy(np.ctypeslib.as_array(buf)[:nbytes])


@dataclass
class HostRead:
    """One read of host memory by queued work, checked when the work runs."""

    what: str
    tensor: torch.Tensor | None  # held (torch-pinned or pageable memory) ...
    reg: Registration | None  # ... or only described (pinstage-registered memory)
    layout: tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype, int] | None
    snapshot: torch.Tensor | None
    span: tuple[int, int]
    frozen: torch.Tensor | None = None  # the values it will read, taken before poisoning

    @classmethod
    def of(cls, ranges: PinnedRanges, t: torch.Tensor, what: str,
           snapshot: bool = True) -> HostRead:
        reg = ranges.registration_of(t)
        sp = span(t)
        snap = host_bytes(t).clone() if snapshot else None
        if reg is None:
            return cls(what, t, None, None, snap, sp)
        layout = (sp[0], tuple(t.shape), tuple(t.stride()), t.dtype,
                  (t.data_ptr() - sp[0]) // max(t.element_size(), 1))
        return cls(what, None, reg, layout, snap, sp)

    def again(self, label: str) -> HostRead:
        """The same read made anew (a graph replay reads its source afresh)."""
        t = self.resolve(label)
        snap = host_bytes(t).clone() if self.snapshot is not None else None
        return HostRead(self.what, self.tensor, self.reg, self.layout, snap, self.span)

    def resolve(self, label: str) -> torch.Tensor:
        """The memory, now; a hazard if pinstage unregistered (freed) it meanwhile."""
        if self.tensor is not None:
            return self.tensor
        reg, layout = self.reg, self.layout
        if reg is None or layout is None:
            raise RuntimeError(f"{label}: a host read holds neither memory nor its description")
        if not reg.alive:
            raise HazardError(
                f"{label}: the {self.what} (pinned host memory at {self.span[0]:#x}, "
                f"{self.span[1] - self.span[0]} bytes, registered by pinstage) was "
                "unregistered/freed before this queued work read it; on a real device the "
                "copy reads freed memory")
        lo, shape, stride, dtype, offset = layout
        raw = _from_address(lo, self.span[1] - lo)
        itemsize = torch.empty((), dtype=dtype, device="cpu").element_size()
        pad = (-raw.numel()) % itemsize
        if pad:
            raw = torch.cat([raw, raw.new_zeros(pad)])
        return raw.view(dtype).as_strided(shape, stride, offset)

    def freeze(self, label: str) -> None:
        """The simulator is about to poison memory this pending read covers (a device-to-host
        destination queued after it): by stream order the read happens first, so keep what
        it will see now (unless the host already changed it: that hazard still raises)."""
        if self.frozen is not None:
            return
        t = self.resolve(label)
        if self.snapshot is None or torch.equal(host_bytes(t), self.snapshot):
            self.frozen = t.clone()

    def check(self, label: str) -> torch.Tensor:
        if self.frozen is not None:
            return self.frozen
        t = self.resolve(label)
        if self.snapshot is not None and not torch.equal(host_bytes(t), self.snapshot):
            raise HazardError(
                f"{label}: the {self.what} (host memory at {self.span[0]:#x}, shape "
                f"{tuple(t.shape)}, {t.dtype}) was changed by the host after the work was "
                "queued and before it ran; on a real device the work would see the new values")
        return t
