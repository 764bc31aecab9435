"""The device seam: one small interface through which every primitive does its device work.

Implementations:

* :class:`CpuBackend` - the target is the host: plain copies, "UVA" is the host tensor itself.
* :class:`GenericBackend` - another torch device type (``meta``, ``xpu``, ``mps``...): plain
  torch copies, no pinned staging.
* ``CudaBackend`` (``_cuda.py``) - CUDA and ROCm through ``torch.cuda``; the only module that
  touches ``torch.cuda``.
* ``SimBackend`` (``testing.py``) - the simulated accelerator.

Primitives never branch on the device type; they ask :func:`get_backend` and use these methods.
"""

from __future__ import annotations

import abc
import contextlib
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._audit import pinstage_fallback
from ._memory import HostRegion, StagingArena, staging_limit

__all__ = ["Backend", "Probe", "CpuBackend", "GenericBackend", "get_backend", "resolve_device"]


@dataclass(frozen=True)
class Probe:
    """Platform facts a backend found for its device (policy is applied later)."""

    accelerator: bool
    can_pin: bool
    uva: bool
    reasons: tuple[str, ...] = ()
    staging_limit: int | None = None  # a platform-imposed default cap (e.g. WSL)


_LIVE: weakref.WeakSet[Backend] = weakref.WeakSet()  # every backend (locks reset after fork)


class Backend(abc.ABC):
    """What a primitive may ask of a device. Copies and launches go on the current stream.

    Every method that orders work is abstract (no silent defaults): a backend that forgets
    fencing fails at construction, not by passing tests. Streams and events are explicit
    handles: ``record_event(stream)`` fences the work queued on ``stream`` only."""

    device: torch.device
    name: str = "base"
    accelerator: bool = True
    # Whether host values pinstage reads later than it was handed them (a staged list's
    # elements, read by apply_write) are checked to be unchanged then: the simulated CUDA's
    # backend does (a changed one raises HazardError); real backends cannot afford to.
    checks_deferred_reads: bool = False

    def __init__(self) -> None:
        self.stalls = 0  # host waits for unfinished device work inside pinstage calls
        self.caps_cache: tuple[Any, Any] | None = None  # (environment key, Capabilities)
        self._arena: StagingArena | None = None
        self._arena_lock = threading.Lock()
        _LIVE.add(self)

    def reset_after_fork(self) -> None:
        """In a forked child: locks another thread of the parent held are new and free."""
        self._arena_lock = threading.Lock()

    # -- facts -------------------------------------------------------------------------------
    @abc.abstractmethod
    def probe(self) -> Probe:
        """Platform facts for this device (cached by the caller's policy layer)."""

    # -- memory ------------------------------------------------------------------------------
    def alloc_pinned(self, nbytes: int, *, in_use: bool = True) -> torch.Tensor:
        """A zero-filled uint8 host tensor of exactly ``nbytes``, pinned for this device."""
        raise RuntimeError(f"{self.name} target has no pinned host memory")

    def is_pinned(self, t: torch.Tensor) -> bool:
        return False

    def is_device_tensor(self, t: torch.Tensor) -> bool:
        """True for tensors that live on this target (never true for host inputs)."""
        return t.device.type == self.device.type and self.accelerator

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    def zeros(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=dtype, device=self.device)

    # -- device work -------------------------------------------------------------------------
    @abc.abstractmethod
    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, label: str = "",
                 pinned: bool = False) -> None:
        """host -> device; asynchronous when ``src`` is pinned and contiguous (``pinned``:
        the caller knows it is, e.g. staging memory, so the backend need not ask)."""

    @abc.abstractmethod
    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, label: str = "") -> None:
        """device -> host; asynchronous when ``dst`` is pinned."""

    def copy_d2d(self, dst: torch.Tensor, src: torch.Tensor, label: str = "") -> None:
        """device -> device (or UVA view -> device), on the stream."""
        dst.copy_(src, non_blocking=True)

    def launch(self, fn: Callable[..., Any], *args: Any, reads: Sequence[torch.Tensor] = (),
               writes: Sequence[torch.Tensor] = (), label: str = "", **kwargs: Any) -> None:
        """Enqueue ``fn(*args, **kwargs)``, a kernel made of torch ops on device tensors.
        ``reads``/``writes`` name memory it touches beyond its tensor arguments (the simulator
        checks reads of host memory; tensor arguments also in ``writes`` are outputs)."""
        fn(*args, **kwargs)

    @abc.abstractmethod
    def current_stream(self) -> Any:
        """A hashable handle of this device's current stream (of the calling thread)."""

    @abc.abstractmethod
    def record_event(self, stream: Any) -> Any:
        """An event recorded on ``stream``, after all work queued on it so far. It fences
        that stream only: work queued on other streams is not covered."""

    @abc.abstractmethod
    def event_done(self, event: Any) -> bool:
        """Whether the work ``event`` fences has completed (never waits)."""

    @abc.abstractmethod
    def wait_event(self, event: Any) -> None:
        """Host waits for ``event``; counted as a stall when the work was not done yet."""

    def uva_view(self, host: torch.Tensor) -> torch.Tensor:
        """A device tensor aliasing pinned ``host`` memory."""
        raise RuntimeError(f"{self.name} target has no UVA views")

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait for all device work pinstage issued on this target."""

    def is_capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph (then staging through
        recycled memory must be refused: a replay would read whatever is there later)."""
        return False

    # -- shared helpers ----------------------------------------------------------------------
    def arena(self) -> StagingArena:
        """This target's pinned staging arena, made on first use."""
        if self._arena is None:
            with self._arena_lock:
                if self._arena is None:
                    limit = staging_limit(self.probe().staging_limit)
                    self._arena = StagingArena(self, limit)
        return self._arena


def host_region_tensor(nbytes: int, *, in_use: bool = True,
                       pin: Callable[[int, int], None] | None = None,
                       unpin: Callable[[int, int], None] | None = None,
                       on_free: Callable[[HostRegion], None] | None = None,
                       page_aligned: bool = True,
                       backend: Backend | None = None) -> torch.Tensor:
    """A zero-filled uint8 tensor over a new :class:`HostRegion` (counted in the stats). With
    ``backend``, the memory goes back only after the device work queued to read it is done."""
    region = HostRegion(nbytes, pin=pin, unpin=unpin, on_free=on_free, in_use=in_use,
                        page_aligned=page_aligned, backend=backend)
    return region.as_tensor()


class _NothingToFence:
    """Streams and events for a backend whose copies finish before they return (the CPU
    target; blocking torch copies on other device types): there is nothing to fence, so every
    event is already complete. Named in each such backend's bases, never a default."""

    def current_stream(self) -> Any:
        return None

    def record_event(self, stream: Any) -> Any:
        return None

    def event_done(self, event: Any) -> bool:
        return True

    def wait_event(self, event: Any) -> None:
        return None


class CpuBackend(_NothingToFence, Backend):
    """The host is the target: everything is finished when the call returns."""

    name = "cpu"
    accelerator = False

    def __init__(self) -> None:
        super().__init__()
        self.device = torch.device("cpu")

    def probe(self) -> Probe:
        return Probe(accelerator=False, can_pin=False, uva=True,
                     reasons=("no accelerator: CPU target (host memory is device memory)",))

    def is_device_tensor(self, t: torch.Tensor) -> bool:
        return False

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, label: str = "",
                 pinned: bool = False) -> None:
        dst.copy_(src)  # host -> host

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, label: str = "") -> None:
        dst.copy_(src)

    def copy_d2d(self, dst: torch.Tensor, src: torch.Tensor, label: str = "") -> None:
        dst.copy_(src)

    def uva_view(self, host: torch.Tensor) -> torch.Tensor:
        return host

    def synchronize(self) -> None:
        return None  # everything is finished when a call returns


class GenericBackend(_NothingToFence, Backend):
    """Another torch device type: plain torch copies, no pinned staging or UVA.

    Copies here are blocking when the device is real; that is the platform's limit and is said
    in ``capabilities().reasons``. ``meta`` stands in for an accelerator in audit tests.
    """

    name = "generic"

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.name = device.type

    def probe(self) -> Probe:
        return Probe(accelerator=True, can_pin=False, uva=False, reasons=(
            f"{self.device.type} device: pinstage stages through pinned memory only on "
            "CUDA/ROCm; copies here are plain torch copies",))

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, label: str = "",
                 pinned: bool = False) -> None:
        with pinstage_fallback():
            dst.copy_(src)  # host -> device, blocking: no pinned staging on this device type

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, label: str = "") -> None:
        with pinstage_fallback():
            dst.copy_(src)  # device -> host, blocking

    def copy_d2d(self, dst: torch.Tensor, src: torch.Tensor, label: str = "") -> None:
        dst.copy_(src)


    def synchronize(self) -> None:
        sync = getattr(getattr(torch, self.device.type, None), "synchronize", None)
        if callable(sync) and self.device.type != "meta":
            sync()


def refuse_capture(backend: Backend, what: str) -> None:
    """``RuntimeError`` while the current stream captures a CUDA graph: ``what`` stages data
    in memory that is reused after the call, so a replayed copy would read stale or foreign
    data."""
    if backend.is_capturing():
        raise RuntimeError(f"{what} cannot be captured in a CUDA graph: it stages data in "
                           "pinned memory that is reused after the call, so a replay would "
                           "read stale data; upload before capturing, or capture copies "
                           "between persistent buffers (CpuGpuBuffer.copy_to_gpu)")


class _Explicit(threading.local):
    depth = 0


_explicit = _Explicit()


@contextlib.contextmanager
def explicit_wait() -> Iterator[None]:
    """Marks host waits pinstage makes because the user asked for one (``synchronize()``):
    not host stalls (the simulator counts them in ``syncs`` only)."""
    _explicit.depth += 1
    try:
        yield
    finally:
        _explicit.depth -= 1


def explicit_wait_active() -> bool:
    return _explicit.depth > 0


_CPU = CpuBackend()
_GENERIC: dict[torch.device, GenericBackend] = {}
_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    for backend in list(_LIVE):
        backend.reset_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)

# The simulator installs itself here (pinstage.testing); a stack so contexts can nest.
SIM_STACK: list[Any] = []


# Accelerator backends plug in here by device type: a loader returning an object with
# ``available()``, ``current_device()`` and ``backend_for(device)``. The seam imports no
# concrete backend; ``pinstage/__init__.py`` registers CUDA's loader (which imports ``_cuda``
# only when a CUDA device is first asked about, so importing pinstage touches no driver).
_PROVIDERS: dict[str, Callable[[], Any]] = {}


def register_provider(device_type: str, loader: Callable[[], Any]) -> None:
    """Make ``loader()`` the provider of backends for ``device_type`` devices."""
    _PROVIDERS[device_type] = loader


class _NoProvider:
    """No backend is registered for a device type: it is never available."""

    @staticmethod
    def available() -> bool:
        return False

    @staticmethod
    def current_device() -> torch.device:
        raise RuntimeError("no accelerator backend is registered")

    @staticmethod
    def backend_for(device: torch.device) -> Backend:
        raise RuntimeError(f"no pinstage backend is registered for {device.type} devices")


def _cuda_module() -> Any:
    loader = _PROVIDERS.get("cuda")
    return loader() if loader is not None else _NoProvider


def resolve_device(device: Any = None) -> torch.device:
    """The target for ``device`` (``None``: the current accelerator - a simulated one inside
    ``simulated_accelerator`` - else the CPU), with its index."""
    if device is None:
        cuda = _cuda_module()
        if cuda.available():
            return cuda.current_device()
        return torch.device("cpu")
    if isinstance(device, torch.dtype):
        raise TypeError(f"device must be a device, got the dtype {device}: pinstage's order is "
                        "async_tensor_h2d(data, device, dtype, out) (vLLM's older one put "
                        "dtype second); pass them by keyword")
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"device must be a torch.device, a string or an int, got {device!r}")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device {device!r} is not a device: {exc}") from None
    if dev.type == "cuda":
        cuda = _cuda_module()
        if not cuda.available():
            raise RuntimeError(f"device {device!r} was asked for, but CUDA is not available in "
                               "this process (CPU-only build of torch, or no GPU visible)")
        if dev.index is None:
            dev = cuda.current_device()
    elif dev.type not in ("cpu", "meta") and not _available(dev):
        raise RuntimeError(f"device {device!r} was asked for, but torch reports no "
                           f"{dev.type} device in this process")
    return dev


def _available(dev: torch.device) -> bool:
    """Whether torch has a usable device of ``dev``'s type (xpu, mps, ...)."""
    if dev.type == "mps":
        return bool(torch.backends.mps.is_available())
    check = getattr(getattr(torch, dev.type, None), "is_available", None)
    return bool(check()) if callable(check) else True


_RESOLVED: dict[Any, Backend] = {}  # device argument -> backend, when no simulator is active


def get_backend(device: Any = None) -> Backend:
    """The backend that serves ``device`` (see :func:`resolve_device`)."""
    if SIM_STACK:  # torch.cuda is the simulator's: resolve afresh (nothing cached across it)
        return _get_backend(device)
    if device is not None and type(device) in (str, torch.device):
        hit = _RESOLVED.get(device)
        if hit is not None:
            return hit
        backend = _get_backend(device)
        if len(_RESOLVED) < 64 and not (backend.device.type == "cuda" and
                                        torch.device(device).index is None):
            _RESOLVED[device] = backend  # "cuda" without index follows the current device
        return backend
    return _get_backend(device)


def _get_backend(device: Any) -> Backend:
    dev = resolve_device(device)
    if dev.type == "cpu":
        return _CPU
    if dev.type == "cuda":
        return _cuda_module().backend_for(dev)  # type: ignore[no-any-return]
    with _lock:
        if dev not in _GENERIC:
            _GENERIC[dev] = GenericBackend(dev)
        return _GENERIC[dev]
