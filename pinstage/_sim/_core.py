"""The open simulator's state: its configuration, its scheduler and host-memory state, and
the process-wide "which simulator is open" (:func:`current`, :func:`active`).

:class:`SimState` is what every module of the simulator reads, through its public attributes:
``sched`` (devices, streams, queues), ``pinned`` (pinned host ranges), ``mode``,
``pin_memory``, ``uva``. The ``Simulator`` users get (``pinstage.testing``) extends it with
what needs the layers above (kernels, pinstage's backends, closing).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ._alloc import Allocator, Handle
from ._hazards import PinnedBlock, PinnedRanges, poison_
from ._sched import MODES, Scheduler, SimStats

__all__ = ["SimState", "current", "active", "set_active"]


class SimState:
    """A simulated CUDA process state; see :func:`pinstage.testing.simulated_accelerator`."""

    def __init__(self, mode: str = "lazy", seed: int = 0, pin_memory: bool = True,
                 uva: bool = True, device_count: int = 1, memory: int | str | None = None
                 ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        if isinstance(device_count, bool) or not isinstance(device_count, int) or \
                device_count < 1:
            raise ValueError(f"device_count must be an int >= 1, got {device_count!r}")
        self.mode = mode
        self.seed = seed
        self.pin_memory = bool(pin_memory)
        self.uva = bool(uva)
        self.device_count = device_count
        self.device = torch.device("cuda", 0)
        self.sched = Scheduler(mode, seed, device_count)
        self.pinned = PinnedRanges()  # torch-pinned blocks and pinstage registrations
        self.sched.races.is_host = self.pinned.is_pinned  # (host races: see _races)
        self.backends: dict[int, Any] = {}  # pinstage's backend per device index
        limit = None
        if memory is not None:
            from .._host import parse_size

            limit = parse_size(memory, "memory")
            if limit <= 0:
                raise ValueError(f"memory must be a positive size, got {memory!r}")
        self.memory = limit
        self.allocators = [Allocator(i, limit) for i in range(device_count)]

    def device_empty(self, shape: Any, stride: Any, dtype: torch.dtype, index: int,
                     poison: bool = True, stream: Any = None) -> tuple[torch.Tensor, Handle | None]:
        """Device memory from the caching allocator of device ``index``, allocated on its
        current stream (``stream``, when the caller has it); a new block is poisoned (outside
        eager mode) as fresh GPU memory is garbage, a reused one keeps its last owner's bytes
        (queued work may read them)."""
        shape = tuple(shape)
        if stride is None:  # contiguous
            stride, step = [], 1
            for d in reversed(shape):
                stride.append(step)
                step *= max(d, 1)
            stride.reverse()
        if stream is None:
            stream = self.sched.current_stream(index)
        # (the lock: factories allocate from the function mode, outside any op's lock, and
        # threads share the allocator's pools)
        with self.sched.lock, torch._C.DisableTorchFunction():
            inner, handle, new = self.allocators[index].empty_strided(
                shape, tuple(stride), dtype, stream)
        if new and poison and self.mode != "eager":
            poison_(inner)
        return inner, handle

    # -- what users and tests read -----------------------------------------------------------
    @property
    def stats(self) -> SimStats:
        """Counters of simulated device work (see :class:`SimStats`)."""
        return self.sched.stats

    @property
    def closed(self) -> bool:
        return self.sched.closed

    @property
    def pending(self) -> int:
        """How many queued device operations have not run yet."""
        return self.sched.pending

    def synchronize(self, device: Any = None) -> None:
        """Run everything queued (on ``device``, default all devices); not a host stall."""
        self.sched.synchronize(device)

    # -- host memory -------------------------------------------------------------------------
    def is_pinned(self, t: torch.Tensor) -> bool:
        return self.pinned.is_pinned(t)

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Host memory pinned by torch's (simulated) caching allocator."""
        if not self.pin_memory:
            raise RuntimeError("Cannot access accelerator device when none is available. "
                               "(the simulator was opened with pin_memory=False: pinning "
                               "fails as on a machine that cannot pin)")
        n = int(np.prod(shape, dtype=np.int64))
        nbytes = n * torch.empty((), dtype=dtype, device="cpu").element_size()
        if nbytes == 0:  # (no block, as PyTorch's host allocator gives none for 0 bytes)
            return torch.empty(shape, dtype=dtype, device="cpu")
        block = PinnedBlock(self.pinned, nbytes)
        raw = torch.from_numpy(np.asarray(block))
        return raw.view(dtype).view(shape)


_ACTIVE: list[SimState] = []


def current() -> SimState | None:
    """The open simulator, or ``None``."""
    return _ACTIVE[-1] if _ACTIVE else None


def active() -> SimState:
    """The open simulator (``RuntimeError`` when none is)."""
    if not _ACTIVE:
        raise RuntimeError("no simulated accelerator is open (use "
                           "pinstage.testing.simulated_accelerator())")
    return _ACTIVE[-1]


def set_active(sim: SimState | None) -> None:
    """Open ``sim`` (or, with ``None``, close the open one) as the process's simulator."""
    if sim is None:
        _ACTIVE.clear()
    else:
        _ACTIVE[:] = [sim]
