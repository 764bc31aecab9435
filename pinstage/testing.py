"""A simulated accelerator: every accelerator code path, deterministic, in CPU-only CI.

``simulated_accelerator(mode, seed, pin_memory, uva)`` installs a backend whose device memory
is host memory and whose device work (copies, pinstage kernels, ``sim.launch``) is queued on a
simulated stream. The queue runs at once (``"eager"``), only when the host must wait
(``"lazy"``), or at seeded random points (``"random"``). Each queued read of host memory is
snapshotted when queued; if the host changed that memory before the work ran, the work raises
:class:`HazardError` naming the source. Destinations pinstage allocates hold garbage until the
copy into them runs. Like httpx's mock transport, it ships in the library so users can test
their own engine code with it.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import _backend
from ._backend import Backend, Probe, host_region_tensor
from ._errors import HazardError
from ._memory import HostRegion

__all__ = ["simulated_accelerator", "Simulator", "SimStats", "HazardError", "MODES"]

MODES = ("eager", "lazy", "random")


@dataclass
class SimStats:
    """Counters of simulated device work. ``host_stalls`` counts host waits inside pinstage
    calls and pageable copies (they block the host on a real device), not ``synchronize()``."""

    copies: int = 0  # host -> device transfers, pinned or pageable
    pageable_copies: int = 0  # of which from pageable memory
    d2h_copies: int = 0
    d2d_copies: int = 0
    launches: int = 0
    host_stalls: int = 0
    events: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def _span(t: torch.Tensor) -> tuple[int, int]:
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


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (so NaN == NaN for the hazard check)."""
    flat = t.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(torch.uint8) if flat.dtype != torch.bool else flat


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


@dataclass
class _Read:
    tensor: torch.Tensor
    snapshot: torch.Tensor | None
    what: str


@dataclass
class _Work:
    seq: int
    label: str
    fn: Callable[[], Any]
    reads: list[_Read] = field(default_factory=list)
    writes: list[tuple[int, int]] = field(default_factory=list)


class _Ranges:
    """Live memory ranges (start -> end), for 'is this pointer inside simulated memory'."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: dict[int, int] = {}
        self._lock = threading.Lock()

    def add(self, start: int, end: int) -> None:
        with self._lock:
            bisect.insort(self._starts, start)
            self._ends[start] = end

    def remove(self, start: int) -> None:
        with self._lock:
            if start in self._ends:
                del self._ends[start]
                i = bisect.bisect_left(self._starts, start)
                del self._starts[i]

    def contains(self, ptr: int) -> bool:
        with self._lock:
            i = bisect.bisect_right(self._starts, ptr) - 1
            return i >= 0 and ptr < self._ends[self._starts[i]]


class _SimEvent:
    __slots__ = ("seq",)

    def __init__(self, seq: int) -> None:
        self.seq = seq


class SimBackend(Backend):
    """The simulator's side of the device seam."""

    name = "simulated"
    accelerator = True

    def __init__(self, sim: Simulator) -> None:
        super().__init__()
        self.sim = sim
        self.device = sim.device
        self.pinned = _Ranges()
        self.devmem = _Ranges()

    def probe(self) -> Probe:
        s = self.sim
        reasons = [f"simulated accelerator ({s.mode} mode, seed {s.seed})"]
        reasons.append("simulated pinned memory available" if s.pin_memory else
                       "simulated without pinned memory (the pageable fallback)")
        if s.uva and not s.pin_memory:
            reasons.append("simulated UVA needs pinned memory, so it is off")
        elif not s.uva:
            reasons.append("simulated without UVA (the non-UVA fallback)")
        return Probe(True, s.pin_memory, s.uva and s.pin_memory, tuple(reasons))

    # -- memory ------------------------------------------------------------------------------
    def _region(self, nbytes: int, ranges: _Ranges, in_use: bool,
                account: bool) -> torch.Tensor:
        def on_free(r: HostRegion) -> None:
            ranges.remove(r.ptr)

        if account:
            t = host_region_tensor(nbytes, in_use=in_use, on_free=on_free, page_aligned=False)
        else:  # device memory: not host memory, not in host_memory_stats
            region = _DeviceRegion(nbytes, on_free)
            t = torch.from_numpy(np.asarray(region))
        ranges.add(t.data_ptr(), t.data_ptr() + max(nbytes, 1))
        return t

    def alloc_pinned(self, nbytes: int, *, in_use: bool = True) -> torch.Tensor:
        if not self.sim.pin_memory:
            raise RuntimeError("the simulated accelerator was made with pin_memory=False")
        return self._region(nbytes, self.pinned, in_use, account=True)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.numel() > 0 and self.pinned.contains(t.data_ptr())

    def is_device_tensor(self, t: torch.Tensor) -> bool:
        return t.numel() > 0 and self.devmem.contains(t.data_ptr())

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        shape = tuple(shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        n = int(np.prod(shape, dtype=np.int64)) * itemsize
        raw = self._region(n, self.devmem, False, account=False)
        raw.copy_(torch.from_numpy(self.sim._rng.integers(0, 256, n, dtype=np.uint8)))
        return raw.view(dtype).view(shape)  # garbage until written

    def zeros(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        t = self.empty(shape, dtype)
        t.zero_()
        return t

    # -- device work -------------------------------------------------------------------------
    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, label: str = "",
                 pinned: bool = False) -> None:
        self.sim.stats.copies += 1  # (the hint is not trusted: the simulator checks for itself)
        what = f"host source of {label or 'a host-to-device copy'}"
        if not (self.is_pinned(src) and src.is_contiguous()):
            # A pageable (or non-contiguous) source blocks the host on a real device: the
            # driver drains the stream, then copies synchronously.
            self.sim.stats.pageable_copies += 1
            self.sim._block_host()
            dst.copy_(src)
            return
        self.sim._enqueue(label or "host-to-device copy", lambda: dst.copy_(src),
                          reads=[(src, what, True)], writes=[dst])

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, label: str = "") -> None:
        self.sim.stats.d2h_copies += 1
        if not self.is_pinned(dst):
            self.sim._block_host()
            dst.copy_(src)
            return
        self.sim._enqueue(label or "device-to-host copy", lambda: dst.copy_(src),
                          reads=[(src, f"source of {label}", False)], writes=[dst])

    def copy_d2d(self, dst: torch.Tensor, src: torch.Tensor, label: str = "") -> None:
        self.sim.stats.d2d_copies += 1
        self.sim._enqueue(label or "device copy", lambda: dst.copy_(src),
                          reads=[(src, f"source of {label or 'a device copy'}", False)],
                          writes=[dst])

    def launch(self, fn: Callable[..., Any], *args: Any, reads: Sequence[torch.Tensor] = (),
               writes: Sequence[torch.Tensor] = (), label: str = "", **kwargs: Any) -> None:
        self.sim.stats.launches += 1
        name = label or getattr(fn, "__name__", "kernel")
        outs = {id(w) for w in writes}
        tensors = list(reads) + [a for a in (*args, *kwargs.values())
                                 if isinstance(a, torch.Tensor) and id(a) not in outs]
        self.sim._enqueue(f"kernel {name}", lambda: fn(*args, **kwargs),
                          reads=[(t, f"input of kernel {name}", False) for t in tensors],
                          writes=list(writes))

    def current_stream(self) -> Any:
        return None  # one simulated stream

    def record_event(self, stream: Any) -> _SimEvent:
        self.sim.stats.events += 1
        return _SimEvent(self.sim._seq)

    def event_done(self, event: Any) -> bool:
        if event is None:
            return True
        self.sim._maybe_progress()
        return bool(self.sim._done >= event.seq)

    def wait_event(self, event: Any) -> None:
        if event is None or self.sim._done >= event.seq:
            return
        self.stalls += 1
        self.sim.stats.host_stalls += 1
        self.sim._run_until(event.seq)

    def uva_view(self, host: torch.Tensor) -> torch.Tensor:
        if not self.is_pinned(host):
            raise ValueError("a UVA view needs pinned host memory; this tensor is pageable")
        return host  # host memory stands in for device memory: the view is the tensor itself

    def synchronize(self) -> None:
        self.sim.synchronize()


class _DeviceRegion:
    """Simulated device memory (host memory that is not counted as pinned host memory)."""

    def __init__(self, nbytes: int, on_free: Callable[[Any], None]) -> None:
        self._buf = np.empty(max(nbytes, 1), dtype=np.uint8)
        self.ptr = self._buf.ctypes.data
        self._on_free = on_free
        self.__array_interface__ = {"data": (self.ptr, False), "shape": (nbytes,),
                                    "typestr": "|u1", "version": 3}

    def __del__(self) -> None:
        self._on_free(self)


class Simulator:
    """A simulated accelerator; see :func:`simulated_accelerator`."""

    def __init__(self, mode: str = "lazy", seed: int = 0, pin_memory: bool = True,
                 uva: bool = True) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        self.mode = mode
        self.seed = seed
        self.pin_memory = bool(pin_memory)
        self.uva = bool(uva)
        self.device = torch.device("cpu")
        self.stats = SimStats()
        self._rng = np.random.default_rng(seed)
        self._queue: deque[_Work] = deque()
        self._seq = 0  # sequence number of the last queued work
        self._done = 0  # sequence number of the last finished work
        self._running = False
        self.backend = SimBackend(self)

    @property
    def pending(self) -> int:
        """How many queued device operations have not run yet."""
        return len(self._queue)

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Queue ``fn(*args, **kwargs)`` as a kernel on the simulated stream. Tensor arguments
        in pinned host memory (UVA views) are checked for host changes before it runs."""
        self.backend.launch(fn, *args, **kwargs)

    def synchronize(self) -> None:
        """Run everything queued (not counted as a host stall)."""
        self._run_until(self._seq)

    # -- internals ---------------------------------------------------------------------------
    def _enqueue(self, label: str, fn: Callable[[], Any],
                 reads: Sequence[tuple[torch.Tensor, str, bool]],
                 writes: Sequence[torch.Tensor]) -> None:
        checked = []
        for t, what, always in reads:
            host = always or self.backend.is_pinned(t)
            checked.append(_Read(t, _bytes(t).clone() if host else None, what))
        self._seq += 1
        self._queue.append(_Work(self._seq, label, fn, checked, [_span(w) for w in writes]))
        if self.mode == "eager":
            self._run_until(self._seq)
        else:
            self._maybe_progress()

    def _maybe_progress(self) -> None:
        if self.mode == "random" and self._queue and not self._running:
            k = int(self._rng.integers(0, len(self._queue) + 1))
            if k:
                self._run_until(self._queue[k - 1].seq)

    def _block_host(self) -> None:
        """A blocking operation: drain the stream first (counted as a host stall)."""
        self.stats.host_stalls += 1
        self.backend.stalls += 1
        self._run_until(self._seq)

    def _run_until(self, seq: int) -> None:
        if self._running:
            return
        self._running = True
        try:
            while self._queue and self._queue[0].seq <= seq:
                work = self._queue.popleft()
                self._done = work.seq
                for r in work.reads:
                    if r.snapshot is not None and not torch.equal(_bytes(r.tensor), r.snapshot):
                        raise HazardError(
                            f"{work.label}: the {r.what} (host memory at "
                            f"{r.tensor.data_ptr():#x}, shape {tuple(r.tensor.shape)}, "
                            f"{r.tensor.dtype}) was changed by the host after the work was "
                            "queued and before it ran; on a real device the copy would read "
                            "the new values")
                work.fn()
                if work.writes:  # later reads of what this wrote can't be checked by content
                    for later in self._queue:
                        for r in later.reads:
                            if r.snapshot is not None and any(
                                    _overlap(_span(r.tensor), w) for w in work.writes):
                                r.snapshot = None
        finally:
            self._running = False


@contextlib.contextmanager
def simulated_accelerator(mode: str = "lazy", seed: int = 0, pin_memory: bool = True,
                          uva: bool = True) -> Iterator[Simulator]:
    """Make pinstage target a simulated accelerator inside the ``with`` block.

    ``device=None`` and ``sim.device`` address it; leaving the block runs what is queued (a
    hazard raises there at the latest).
    """
    sim = Simulator(mode, seed, pin_memory, uva)
    _backend.SIM_STACK.append(sim)
    try:
        yield sim
    except BaseException:
        try:
            sim.synchronize()
        except HazardError:
            pass  # the first error wins
        raise
    else:
        sim.synchronize()
    finally:
        _backend.SIM_STACK.remove(sim)
