"""A simulated CUDA: unmodified GPU code runs on the CPU, in stream order, and its async bugs
become deterministic errors.

Layers (FakeTensor's split, plus a scheduler), each importing only those above it here:

* ``_hazards`` - pinned host ranges, host reads checked when queued work runs, poison;
* ``_sched`` - devices, streams, events, queued operations and the loop that runs them;
* ``_core`` - the open simulator's state (:class:`SimState`) and which one is open;
* ``_tensor`` - the device tensor type, the Python-level methods, the modes that catch
  ``device="cuda"``, and the registry of aten handlers;
* ``_ops`` - the aten handlers, registered per op, and ``sim.launch``;
* ``_torch_cuda`` - ``torch.cuda`` as the program sees it, and the simulated driver.

This module ties them together: :class:`Simulator` (what users get), its registration as
pinstage's provider of ``cuda`` devices (so pinstage's core never names the simulator), and
:func:`simulated_accelerator`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import _registry, _state
from .._device import Backend
from .._errors import HazardError
from . import _cuda_only, _kernels, _ops, _tensor, _torch_cuda  # noqa: F401 (registers)
from ._core import SimState, active, current, set_active
from ._sched import MODES, SimStats

__all__ = ["MODES", "HazardError", "SimStats", "Simulator", "active", "current",
           "register_kernel", "simulated_accelerator", "tensor_at"]

register_kernel = _kernels.register_kernel
tensor_at = _kernels.tensor_at

_ = _ops  # (imported for its registrations)


class Simulator(SimState):
    """A simulated CUDA process state; see :func:`simulated_accelerator`."""

    def launch(self, fn: Callable[..., Any], *args: Any,
               writes: tuple[torch.Tensor, ...] | list[torch.Tensor] = (),
               **kwargs: Any) -> None:
        """Queue ``fn(*args, **kwargs)`` as one kernel on the current stream. Device-tensor
        arguments reach ``fn`` as plain tensors over their memory; arguments in host memory
        (UVA views, pinned tensors) are checked for host changes before it runs; ``writes``
        names the arguments it writes."""
        _ops.launch(self, fn, args, kwargs, tuple(writes))

    def tensor_at(self, ptr: int, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        """Inside a kernel body: a plain tensor of ``shape``/``dtype`` over the simulated
        device memory at address ``ptr`` (a device tensor's ``data_ptr()`` plus an offset, as
        Triton kernels read from pointer tables)."""
        return _kernels.tensor_at(ptr, shape, dtype)

    def backend_for(self, index: int) -> Backend:
        """pinstage's CUDA backend for simulated device ``index`` (the real CUDA backend code,
        over the simulated driver)."""
        with self.sched.lock:
            backend = self.backends.get(index)
            if backend is None:
                from .._cuda import CudaBackend  # (imported when first used, as pinstage does)

                backend = self.backends[index] = CudaBackend(
                    index, driver=_torch_cuda.SimDriver(self))
            return backend  # type: ignore[no-any-return]

    @property
    def backend(self) -> Backend:
        """pinstage's backend for ``cuda:0``."""
        return self.backend_for(0)

    def close(self) -> None:
        """After the final synchronize: give back the pinned memory pinstage holds for these
        devices (parked, staging arenas, pools: everything that read it has run), then
        refuse further use."""
        try:
            for backend in list(self.backends.values()):
                _state.device_state(backend).collect()
        finally:
            for backend in list(self.backends.values()):
                _state.retire(backend)  # (its queue has run: nothing it holds is read)
            self.sched.closed = True


class _Provider:
    """pinstage's provider of ``cuda`` devices while a simulator is open."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim

    def why_unavailable(self, device_type: str) -> str | None:
        if self.sim.sched.bad_fork:
            return ("this process was forked after the (simulated) CUDA was used in its "
                    "parent, and CUDA cannot be used in such a child (use the 'spawn' start "
                    "method)")
        return None

    def current_device(self) -> torch.device:
        return torch.device("cuda", self.sim.sched.current_device())

    def normalize(self, device: torch.device) -> torch.device:
        return torch.device("cuda", self.sim.sched.device_index(device))

    def backend_for(self, device: torch.device) -> Backend:
        return self.sim.backend_for(self.sim.sched.device_index(device))


class _Facts:
    """What torch on a CPU-only build cannot say about the simulator's tensors."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim

    def is_pinned(self, t: torch.Tensor) -> bool | None:
        if _tensor.is_device(t):
            return False
        return self.sim.is_pinned(t) if t.device.type == "cpu" else None

    def device_of(self, t: torch.Tensor) -> torch.device | None:
        return getattr(t, "_sim_device", None)


def _after_fork_in_child() -> None:
    """A child forked while another thread was inside the simulator: that thread is gone, so
    the locks it held are made anew (its half-run operation is simply not run)."""
    sim = current()
    if sim is not None:
        sim.sched.after_fork_in_child()
        sim.pinned.reset_lock()


_state.on_fork_child(_after_fork_in_child)
_state.on_fork_child(_kernels._reset_after_fork)


@contextlib.contextmanager
def simulated_accelerator(mode: str = "lazy", seed: int = 0, pin_memory: bool = True,
                          uva: bool = True, device_count: int = 1,
                          memory: int | str | None = None) -> Iterator[Simulator]:
    """Open a simulated CUDA with ``device_count`` devices; yields the :class:`Simulator`.

    While open, ``torch.cuda`` answers for the simulated devices, tensors made with
    ``device="cuda"`` live in host memory but report ``cuda``, and every operation on them is
    queued on its stream and run per ``mode``. Device memory comes from a simulated caching
    allocator (``memory``: the device's size, e.g. ``"8GiB"``; over it, allocations raise
    ``torch.cuda.OutOfMemoryError``). On leaving, everything queued runs (a hazard
    raises there at the latest) and ``torch.cuda`` is restored.
    """
    if current() is not None:
        raise RuntimeError("a simulated accelerator is already open (one at a time)")
    sim = Simulator(mode, seed, pin_memory, uva, device_count, memory)
    provider, facts = _Provider(sim), _Facts(sim)
    set_active(sim)
    restore = _torch_cuda.install(sim)
    _registry.push_provider("cuda", provider)
    _registry.push_tensor_facts(facts)
    leave_modes = _tensor.enter_modes(sim)
    _tensor.spread_to_new_threads(sim)
    ok = False
    try:
        yield sim
        ok = True
    finally:
        try:
            if ok:
                sim.synchronize()
            else:
                with contextlib.suppress(HazardError, RuntimeError):
                    sim.synchronize()  # the first error wins
        finally:
            _tensor.stop_spreading()
            try:
                sim.close()
            finally:
                leave_modes()
                restore()
                _registry.pop_tensor_facts(facts)
                _registry.pop_provider("cuda", provider)
                set_active(None)
