"""``torch.cuda`` as a program sees it while a simulator is open, and the simulated driver
pinstage's CUDA backend talks to: the one module of stand-ins.

``install(sim)`` swaps these names into ``torch.cuda`` (and returns a function that puts the
originals back): devices, streams, events, synchronisation, CUDA graphs and ``cudart()``.
Code that looks them up when it runs (``torch.cuda.Event()``) gets the simulated ones.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from .._errors import DriverError, HazardError
from ._alloc import c_names as _alloc_c_names
from ._alloc import cuda_names, new_pool_id, pool_id_of
from ._core import SimState, active, current
from ._cuda_api import PRIORITY_RANGE, CudaRt, clamp_priority, error_string
from ._cuda_api import names as _api_names
from ._hazards import Registration
from ._rng import Generator as _SimTorchGenerator
from ._rng import cuda_names as _rng_cuda_names
from ._rng import forget as _rng_forget
from ._rng import install as _rng_install
from ._rng import replay_bases, replay_fn
from ._sched import CYCLES_PER_MS, EventRecord, Op, SimEvent, SimStream, TorchEvent, TorchStream
from ._tensor import SimTensor
from ._tensor import record_stream as _tensor_record_stream

__all__ = ["SimDriver", "SimGraph", "install"]


def _sim() -> SimState:
    return active()


class _device:
    """``torch.cuda.device(i)``: makes ``i`` the current device inside the block."""

    def __init__(self, device: Any) -> None:
        sim = _sim()
        if device is None or (isinstance(device, int) and device < 0):
            self.idx = -1
        else:
            self.idx = sim.sched.device_index(device)
        self.prev_idx = -1

    def __enter__(self) -> None:
        if self.idx >= 0:
            sched = _sim().sched
            self.prev_idx = sched.current_device()
            sched.set_device(self.idx)

    def __exit__(self, *exc: Any) -> None:
        if self.idx >= 0 and self.prev_idx >= 0:
            _sim().sched.set_device(self.prev_idx)


class _device_of(_device):
    def __init__(self, obj: Any) -> None:
        super().__init__(obj.get_device() if getattr(obj, "is_cuda", False) else -1)


class StreamContext:
    """``torch.cuda.stream(s)``: ``s`` is the current stream (and its device the current
    device) inside the block; ``None`` does nothing."""

    def __init__(self, stream: SimStream | None) -> None:
        self.stream = stream

    def __enter__(self) -> None:
        if self.stream is not None:
            self.stream.sched.enter_stream(self.stream)
            _tell_user_set_stream(self.stream)

    def __exit__(self, *exc: Any) -> None:
        if self.stream is not None:
            sched = self.stream.sched
            sched.exit_stream()
            _tell_user_set_stream(sched.current_stream(self.stream.device_index))


def _tell_user_set_stream(stream: SimStream) -> None:
    """As ``torch.cuda.stream`` does on CUDA, a stream context goes through
    ``torch.cuda.set_stream``: a patch user code installed there (vLLM tracks its current
    stream so) sees every change of stream."""
    fn = getattr(torch.cuda, "set_stream", None)
    if fn is not None and not _is_torch_own(fn):
        fn(stream)


def _new_stream(device: Any = None, priority: int = 0, **kwargs: Any) -> SimStream:
    sched = _sim().sched
    if kwargs.get("stream_id") is not None:  # torch.cuda.Stream(stream_id=..., ...): that one
        index = kwargs.get("device_index")
        return _find_stream(sched, int(kwargs["stream_id"]),
                            sched.device_index(device if index is None else int(index)))
    return sched.new_stream(device, clamp_priority(priority))


class _StreamType(type):
    """So that ``isinstance(s, torch.cuda.Stream)`` holds for simulated streams."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, SimStream)

    def __subclasscheck__(cls, sub: Any) -> bool:
        return type.__subclasscheck__(cls, sub) or issubclass(sub, SimStream)

    def __call__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> Any:
        return _new_stream(device, priority, **kwargs)


class Stream(metaclass=_StreamType):
    """``torch.cuda.Stream`` while simulated (constructing one makes a :class:`SimStream`)."""

    device_type = 1  # c10's DeviceType of CUDA

    @staticmethod
    def priority_range() -> tuple[int, int]:
        """(least, greatest) stream priority; lower numbers are higher priorities."""
        return PRIORITY_RANGE


class _EventType(type):
    """So that ``isinstance(e, torch.cuda.Event)`` holds for simulated events."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, SimEvent)

    def __subclasscheck__(cls, sub: Any) -> bool:
        return type.__subclasscheck__(cls, sub) or issubclass(sub, SimEvent)

    def __call__(cls, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False, external: bool = False, **kwargs: Any) -> Any:
        return SimEvent(_sim().sched, enable_timing, blocking, interprocess, external)


class Event(metaclass=_EventType):
    """``torch.cuda.Event`` while simulated (constructing one makes a :class:`SimEvent`)."""


class SimGraph:
    """``torch.cuda.CUDAGraph``: capture records device work without running it; ``replay()``
    queues it again on the current stream (host reads are checked afresh each replay)."""

    def __init__(self, keep_graph: bool = False) -> None:
        self._sim = _sim()
        self.ops: list[Op] = []
        self._captured = False
        self._stream: SimStream | None = None
        self._keep_graph = bool(keep_graph)
        self._instantiated = False
        self._failed = False

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        sched = self._sim.sched
        stream = sched.current_stream()
        if stream is sched.default_stream(stream.device_index):
            raise RuntimeError("CUDA graphs must be captured on a non-default stream. "
                               "(However, after capture, it's ok to replay them on the "
                               "default stream.)")
        pool_id = pool_id_of(pool) if pool is not None else new_pool_id()
        sched.begin_capture(stream, self, capture_error_mode)
        self._release_pool()
        self.ops = []
        _rng_forget(self)
        self._ended = self._instantiated = False
        self._captured = True
        self._stream = stream
        # the graph's memory: a private pool, shared with the graphs given the same id
        self._pool_id = pool_id
        self._pool_owner = self._sim.allocators[stream.device_index]
        self._pool_owner.use_pool(pool_id)

    def _release_pool(self) -> None:
        owner = self.__dict__.pop("_pool_owner", None)
        if owner is not None:
            owner.unused.append(self._pool_id)  # (taken in at the next allocation)

    def __del__(self) -> None:
        try:
            self._release_pool()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def capture_end(self) -> None:
        if self._stream is not None:
            self._sim.sched.end_capture(self._stream, self)
            self._ended = True
            if not self.ops and not getattr(self, "_failed", False):
                warnings.warn("The CUDA Graph is empty: no device work was queued "
                              "on the capture stream while capturing (was it sent to "
                              "another stream or device?) (simulated)", UserWarning,
                              stacklevel=2)
            if not self._keep_graph:
                self._instantiated = True

    def instantiate(self) -> None:
        """Make the captured graph replayable: ``capture_end`` does it unless the graph was
        made with ``keep_graph=True``, in which case ``replay`` does it the first time."""
        if not self._keep_graph:
            raise RuntimeError("instantiate() is intended to be called by the user only when "
                               "keep_graph=true (capture_end instantiated this graph)")
        if not getattr(self, "_ended", False):
            raise RuntimeError("CUDAGraph.instantiate() needs a finished capture: call "
                               "capture_end() first")
        self._instantiated = True

    def raw_cuda_graph(self) -> int:
        if not self._keep_graph:
            raise RuntimeError("You cannot access the raw cudaGraph_t instance unless "
                               "CUDAGraph was initialized with keep_graph=true")
        raise NotImplementedError("the simulated CUDA records device work, not a cudaGraph_t: "
                                  "there is no raw graph to hand to CUDA's own API")

    def replay(self) -> None:
        if not self._captured:
            raise RuntimeError("CUDAGraph.replay() before a capture")
        if not self._instantiated:
            self.instantiate()
        sched = self._sim.sched
        stream = sched.current_stream()
        with sched.lock:
            bases = replay_bases(self)  # this replay's random offsets
            for op in self.ops:
                if isinstance(op, EventRecord):
                    op.event.record(stream)
                    continue
                reads = [r.again(op.label) for r in op.reads]
                fn = replay_fn(self, op, bases)
                sched.enqueue(stream, Op(f"{op.label} (graph replay)", fn, reads,
                                         host_writes=op.host_writes, ms=op.ms, plain=op.plain,
                                         acc=op.acc and (f"{op.acc[0]} (graph replay)",
                                                         *op.acc[1:])), None)

    def reset(self) -> None:
        self._ended = self._instantiated = False
        self.ops = []
        _rng_forget(self)
        self._release_pool()
        self._captured = False

    def pool(self) -> tuple[int, int]:
        """The id of this graph's memory pool, for another capture to share it."""
        pool_id = self.__dict__.get("_pool_id")
        if pool_id is None:
            raise RuntimeError("Called CUDAGraph.pool() without a preceding capture_begin()")
        return pool_id  # type: ignore[no-any-return]

    def register_generator_state(self, generator: Any) -> None:
        """Accepted: every simulated generator a captured kernel uses is followed at replay
        (CUDA needs non-default generators registered)."""
        return None

    def enable_debug_mode(self) -> None:
        return None

    def debug_dump(self, path: str) -> None:
        return None


class graph:
    """``torch.cuda.graph(g)``: capture the block's device work into ``g``."""

    default_capture_stream: SimStream | None = None

    def __init__(self, cuda_graph: SimGraph, pool: Any = None, stream: SimStream | None = None,
                 capture_error_mode: str = "global") -> None:
        self.cuda_graph = cuda_graph
        self.capture_stream = stream if stream is not None else _new_stream()
        self.stream_ctx = StreamContext(self.capture_stream)
        self.pool = pool
        self.capture_error_mode = capture_error_mode

    def __enter__(self) -> None:
        _sim().synchronize()
        self.stream_ctx.__enter__()
        self.cuda_graph.capture_begin(self.pool, self.capture_error_mode)

    def __exit__(self, *exc: Any) -> None:
        graph = self.cuda_graph
        graph._failed = exc[0] is not None  # (a block that raised: no empty-graph warning)
        try:
            graph.capture_end()
        finally:
            graph._failed = False
        self.stream_ctx.__exit__(*exc)


class AcceleratorGraph(SimGraph):
    """``torch.accelerator.Graph``: a :class:`SimGraph` that keeps its pool and capture mode
    from construction and captures the current stream as a context manager."""

    def __init__(self, keep_graph: bool = False, *, pool: Any = None,
                 capture_error_mode: str = "default") -> None:
        super().__init__(keep_graph)
        self.graph_pool = pool
        self.capture_error_mode = capture_error_mode

    def capture_begin(self, pool: Any = None, capture_error_mode: str | None = None) -> None:
        mode = capture_error_mode or self.capture_error_mode
        super().capture_begin(self.graph_pool if pool is None else pool,
                              "global" if mode == "default" else mode)

    def __enter__(self) -> None:
        _sim().synchronize()
        self.capture_begin()

    def __exit__(self, *exc: Any) -> None:
        self._failed = exc[0] is not None  # (a block that raised: no empty-graph warning)
        try:
            self.capture_end()
        finally:
            self._failed = False


class _Cudart:
    """``torch.cuda.cudart()``: the few runtime calls engine code makes directly."""

    def __init__(self, sim: SimState) -> None:
        self._sim = sim
        self.raw = CudaRt(sim)

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        return SimDriver(self._sim).register(ptr, size)

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        return SimDriver(self._sim).unregister(ptr)

    def cudaGetErrorString(self, err: int) -> str:  # noqa: N802
        return error_string(err)

    def cudaStreamCreate(self, ptr: int) -> int:  # noqa: N802
        return self.raw.cudaStreamCreate(ptr)

    def cudaStreamDestroy(self, stream: int) -> int:  # noqa: N802
        return self.raw.cudaStreamDestroy(stream)

    def cudaProfilerStart(self) -> int:  # noqa: N802
        return 0

    def cudaProfilerStop(self) -> int:  # noqa: N802
        return 0


class SimDriver:
    """What pinstage's CUDA backend asks of the driver, simulated: registering host memory
    (``cudaHostRegister``), unregistering it, and a device view of it (UVA)."""

    # the backend above checks host values it reads late (a staged list's elements) for
    # changes, as queued copies' sources are checked: a changed one raises HazardError
    checks_deferred_reads = True

    def __init__(self, sim: SimState) -> None:
        self.sim = sim

    def register(self, ptr: int, size: int) -> int:
        """``cudaHostRegister``: 0, or 801 (not supported) when the simulator cannot pin; a
        failure leaves its error set, as the runtime does, until ``clear_error()``."""
        sim = self.sim
        sim.sched.check_usable()
        if sim.sched.prohibits_unsafe():  # and on CUDA the capture is invalidated
            try:
                sim.sched.check_not_capturing("cudaHostRegister")
            except RuntimeError:
                pass
            sim.sched.sticky_error = ("cudaErrorStreamCaptureUnsupported: operation not "
                                      "permitted when stream is capturing")
            return 900
        if not sim.pin_memory:
            sim.sched.sticky_error = "cudaErrorNotSupported: cudaHostRegister failed"
            return 801
        sim.pinned.add(ptr, ptr + max(size, 1), Registration(ptr, size))
        return 0

    def clear_error(self) -> None:
        """``cudaGetLastError()``: takes back the error a failed call left behind."""
        self.sim.sched.sticky_error = None

    def unregister(self, ptr: int) -> int:
        """``cudaHostUnregister``: 0, or 713 (not registered) for memory never registered."""
        owner = self.sim.pinned.remove(ptr)
        if isinstance(owner, Registration):
            owner.alive = False
            return 0
        self.sim.sched.sticky_error = "cudaErrorHostMemoryNotRegistered"
        return 713

    def uva_view(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        sim = self.sim
        if not sim.uva:
            raise DriverError("mapping pinned host memory into the device's address space "
                              "is not supported (the simulator was opened with uva=False)", 801)
        owner = sim.pinned.find(host.data_ptr()) if host.numel() else None
        if host.numel() and owner is None:
            raise ValueError("a UVA view needs pinned host memory; this tensor is pageable")
        return SimTensor(host, torch.device("cuda", device.index or 0), owner)

    def device_name(self, index: int) -> str:
        s = self.sim
        return f"pinstage simulated CUDA device {index} ({s.mode} mode, seed {s.seed})"

    def hazard(self, message: str) -> Exception:
        return HazardError(message)

    def capture_underway(self, streams: Any) -> bool:
        """The simulator knows every thread's captures: whether this thread may not make
        "potentially unsafe" calls now."""
        return self.sim.sched.prohibits_unsafe()


# c10's DeviceType of CUDA: torch.cuda.set_stream passes ``stream.device_type`` down
SimStream.device_type = 1  # type: ignore[attr-defined]

_MISSING = object()


def _is_torch_own(value: Any) -> bool:
    """Whether ``value`` is PyTorch's own (or pinstage's), not a patch user code installed."""
    module = getattr(value, "__module__", None) or ""
    return module.split(".")[0] in ("torch", "pinstage") or module == "builtins"


class _Patches:
    """Swaps stand-ins into a namespace (``torch.cuda``, ``torch``, ``torch._C``) without
    clobbering patches user code made there: an attribute user code replaced (vLLM replaces
    ``torch.cuda.set_stream`` at import) is left alone, and one user code replaces while the
    simulator is open is not put back on leaving. Functions are installed as dispatchers that
    call the open simulator's stand-in, or the original when none is open, so a user patch that
    wraps one keeps working after the simulator closed and in the next one."""

    _dispatchers: dict[tuple[int, str], Callable[..., Any]] = {}  # created once per process

    def __init__(self, sim: SimState) -> None:
        self.sim = sim
        self.saved: list[tuple[Any, str, Any, Any]] = []  # (namespace, name, original, ours)

    def install(self, namespace: Any, names: dict[str, Any]) -> None:
        impls = _impls_of(self.sim)
        for name, value in names.items():
            present = getattr(namespace, name, _MISSING)
            key = (id(namespace), name)
            dispatcher = self._dispatchers.get(key)
            if present is not _MISSING and dispatcher is not None and present is dispatcher:
                impls[key] = value  # a dispatcher left in place (by a user patch over it)
                continue
            if present is not _MISSING and not _is_torch_own(present):
                # a user patch: left alone. If it wraps the dispatcher of an earlier session,
                # that dispatcher reaches this simulator's stand-in.
                if dispatcher is not None:
                    impls[key] = value
                continue
            if callable(value) and not isinstance(value, type):
                if dispatcher is None:
                    dispatcher = self._dispatchers[key] = _make_dispatcher(key, present)
                impls[key] = value
                ours = dispatcher
            else:
                ours = value
            setattr(namespace, name, ours)
            self.saved.append((namespace, name, present, ours))

    def restore(self) -> None:
        _impls_of(self.sim).clear()
        for namespace, name, original, ours in reversed(self.saved):
            if getattr(namespace, name, _MISSING) is not ours:
                continue  # user code patched it while open: its patch stays
            if original is _MISSING:
                delattr(namespace, name)
            else:
                setattr(namespace, name, original)
        self.saved.clear()


def _impls_of(sim: SimState) -> dict[tuple[int, str], Any]:
    impls = getattr(sim, "_torch_impls", None)
    if impls is None:
        impls = {}
        sim._torch_impls = impls  # type: ignore[attr-defined]
    return impls


def _make_dispatcher(key: tuple[int, str], original: Any) -> Callable[..., Any]:
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        sim = current()
        impl = _impls_of(sim).get(key) if sim is not None and not sim.closed else None
        if impl is not None:
            return impl(*args, **kwargs)
        if original is _MISSING:
            raise AttributeError(f"{key[1]} exists only while a simulated accelerator is open")
        return original(*args, **kwargs)

    dispatch.__name__ = key[1]
    dispatch.__qualname__ = key[1]
    dispatch.__doc__ = (f"pinstage: the simulated {key[1]} while a simulator is open, else "
                        "the original.")
    return dispatch


def _find_stream(sched: Any, stream_id: int, device_index: int) -> SimStream:
    for s in sched.all_streams():
        if s.stream_id == stream_id and s.device_index == device_index:
            return s  # type: ignore[no-any-return]
    raise RuntimeError(f"no simulated stream with id {stream_id} on device {device_index}")


def _make_torch_stream(device: Any = None, *, priority: int = 0, **kwargs: Any) -> Any:
    """``torch.Stream(...)`` while simulated: a ``cuda`` (or default) device makes a
    simulated stream; other devices get torch's own."""
    sim = current()
    dev = torch.device(device) if isinstance(device, str) else device
    if sim is None or (isinstance(dev, torch.device) and dev.type != "cuda"):
        return TorchStream.real(device, priority=priority, **kwargs)
    return sim.sched.new_stream(dev, clamp_priority(priority))


def _make_torch_event(device: Any = None, *, enable_timing: bool = False,
                      blocking: bool = False, interprocess: bool = False,
                      **kwargs: Any) -> Any:
    """``torch.Event(...)`` while simulated: events on the simulated device."""
    sim = current()
    dev = torch.device(device) if isinstance(device, str) else device
    if sim is None or (isinstance(dev, torch.device) and dev.type != "cuda"):
        return TorchEvent.real(device, enable_timing=enable_timing, blocking=blocking,
                               interprocess=interprocess, **kwargs)
    return SimEvent(sim.sched, enable_timing, blocking, interprocess,
                    bool(kwargs.get("external", False)))


TorchStream.maker = _make_torch_stream
TorchEvent.maker = _make_torch_event


def _torch_level_names(sim: SimState) -> tuple[dict[str, Any], dict[str, Any]]:
    """Stand-ins for ``torch.Stream``/``torch.Event`` and for the ``torch._C`` entry points
    the generic ``torch.accelerator`` API calls (patched there, below the Python functions,
    so user patches of ``torch.accelerator.*`` keep working)."""
    sched = sim.sched

    def index(device: Any) -> int:
        if isinstance(device, int) and not isinstance(device, bool) and \
                not -1 <= device < sim.device_count:
            raise RuntimeError(f"Device index value {device} is out of index range "
                               f"[0, {sim.device_count})")
        return sched.device_index(None if device is None or device == -1 else device)

    def exchange(idx: int) -> int:
        prev = sched.current_device()
        if idx is not None and idx >= 0:
            sched.set_device(sched.device_index(idx))
        return prev

    def set_stream(stream: Any) -> None:
        if not isinstance(stream, SimStream):
            raise TypeError(f"set_stream() expects a simulated stream, got {stream!r}")
        sched.set_stream(stream)

    top = {"Stream": TorchStream, "Event": TorchEvent}
    c = {
        "_accelerator_getAccelerator": lambda: torch.device("cuda"),
        "_get_accelerator": lambda *a: torch.device("cuda"),
        "_accelerator_getDeviceIndex": sched.current_device,
        "_accelerator_setDeviceIndex": lambda idx: exchange(idx) and None,
        "_accelerator_exchangeDevice": exchange,
        "_accelerator_maybeExchangeDevice": exchange,
        "_accelerator_getStream": lambda idx=None: sched.current_stream(index(idx)),
        "_accelerator_setStream": set_stream,
        "_accelerator_synchronizeDevice": lambda idx=None: sched.synchronize(index(idx)),
        "_accelerator_getDeviceCapability": lambda idx=None: {"major": 9, "minor": 0},
        # torch.accelerator.memory: the simulated caching allocator's figures (torch.cuda's)
        "_accelerator_isAllocatorInitialized": lambda: True,
        "_accelerator_emptyHostCache": lambda: None,
        "_accelerator_emptyCache": lambda: torch.cuda.empty_cache(),
        "_accelerator_getDeviceStats": lambda idx=None: torch.cuda.memory_stats(index(idx)),
        "_accelerator_resetAccumulatedStats":
            lambda idx=None: torch.cuda.reset_accumulated_memory_stats(index(idx)),
        "_accelerator_resetPeakStats":
            lambda idx=None: torch.cuda.reset_peak_memory_stats(index(idx)),
        "_accelerator_getMemoryInfo": lambda idx=None: torch.cuda.mem_get_info(index(idx)),
        # the CUDA entry points torch.cuda's Python layer and PyTorch's test harness
        # (common_utils.CudaNonDefaultStream) call directly
        "_cuda_setStream": lambda stream_id=0, device_index=0, device_type=1: sched.set_stream(
            _find_stream(sched, stream_id, device_index)),
        "_cuda_setDevice": lambda idx: None if idx < 0 else sched.set_device(index(idx)),
        "_cuda_getDevice": sched.current_device,
        "_accelerator_setAllocatorSettings": lambda env: _allocator_settings(sim, env),
    }
    return top, c


_REAL_SETTINGS = torch._C._accelerator_setAllocatorSettings


def _allocator_settings(sim: SimState, env: str) -> None:
    """``torch.cuda.memory._set_allocator_settings``: the simulated allocator's own key
    (``graph_capture_record_stream_reuse:True|False``) set here, the rest as torch does."""
    rest = []
    for item in str(env).split(","):
        key, _, value = item.partition(":")
        if key.strip() == "graph_capture_record_stream_reuse":
            flag = value.strip()
            if flag not in ("True", "False"):
                raise ValueError("graph_capture_record_stream_reuse expects True or False, "
                                 f"got {value!r}")
            for a in sim.allocators:
                a.capture_reuse = flag == "True"
        elif item.strip():
            rest.append(item)
    if rest:
        _REAL_SETTINGS(",".join(rest))


SIM_CUDA_VERSION = "12.8"  # torch.version.cuda while a simulator is open (on a CPU build)


def _set_cuda_version() -> Callable[[], None]:
    """A CPU build of torch has ``torch.version.cuda`` None, and code gates CUDA features
    on it (PyTorch's tests skip every graph test without it): report a CUDA build while the
    simulator is open. A CUDA or ROCm build keeps its own; returns the undo function."""
    version = torch.version
    if version.cuda is not None or getattr(version, "hip", None) is not None:
        return lambda: None
    version.cuda = SIM_CUDA_VERSION  # type: ignore[assignment]

    def undo() -> None:
        if version.cuda == SIM_CUDA_VERSION:
            version.cuda = None  # type: ignore[assignment]

    return undo


def install(sim: SimState) -> Callable[[], None]:
    """Swap the simulated names into ``torch.cuda``, ``torch.Stream``/``torch.Event`` and
    ``torch.accelerator``'s entry points; returns the undo function. Attributes user code
    patched are left as they are (see :class:`_Patches`)."""
    cuda = torch.cuda
    driver = SimDriver(sim)
    cudart = _Cudart(sim)

    sched = sim.sched

    def synchronize(device: Any = None) -> None:
        sched.synchronize(device)

    def current_stream(device: Any = None) -> SimStream:
        return sched.current_stream(device)

    def default_stream(device: Any = None) -> SimStream:
        return sched.default_stream(device)

    def set_stream(stream: SimStream | None) -> None:
        if stream is not None:
            sched.set_stream(stream)

    def set_stream_by_id(stream_id: int, device_index: int, device_type: int) -> None:
        sched.set_stream(_find_stream(sched, stream_id, device_index))

    def is_current_stream_capturing() -> bool:
        return sched.current_stream().capture is not None

    def set_sync_debug_mode(mode: Any) -> None:
        modes = {"default": 0, "warn": 1, "error": 2}
        sched.sync_debug_mode = modes[mode] if isinstance(mode, str) else int(mode)

    def get_device_properties(device: Any = None) -> Any:
        import uuid
        from types import SimpleNamespace

        index = sched.device_index(device)
        return SimpleNamespace(uuid=uuid.UUID(int=0x5105_0000 + index, version=4),
                               name=driver.device_name(index), major=9, minor=0,
                               total_memory=sim.allocators[index].capacity(),
                               multi_processor_count=132,
                               is_integrated=False)

    names: dict[str, Any] = {
        "is_available": lambda: True,
        "device_count": lambda: sim.device_count,
        "current_device": sched.current_device,
        "set_device": lambda device: sched.set_device(sched.device_index(device)),
        "device": _device,
        "device_of": _device_of,
        "get_device_name": lambda device=None: driver.device_name(sched.device_index(device)),
        "get_device_capability": lambda device=None: (9, 0),
        "get_device_properties": get_device_properties,
        "is_initialized": lambda: True,
        "init": sched.check_usable,
        "_lazy_init": sched.check_usable,
        "_is_in_bad_fork": lambda: sched.bad_fork,
        "synchronize": synchronize,
        "Stream": Stream,
        "Event": Event,
        "current_stream": current_stream,
        "default_stream": default_stream,
        "stream": StreamContext,
        "StreamContext": StreamContext,
        "set_stream": set_stream,
        "_set_stream_by_id": set_stream_by_id,
        "CUDAGraph": SimGraph,
        "graph": graph,
        "is_current_stream_capturing": is_current_stream_capturing,
        "cudart": lambda: cudart,
        "set_sync_debug_mode": set_sync_debug_mode,
        "get_sync_debug_mode": lambda: sched.sync_debug_mode,
        "empty_cache": lambda: None,
        "ipc_collect": lambda: None,
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "mem_get_info": lambda device=None: (70 * 2**30, 80 * 2**30),
        "is_bf16_supported": lambda *a, **k: True,
        "_sleep": lambda cycles: sched.enqueue(sched.current_stream(), Op(
            f"spin kernel of {cycles} cycles", None, ms=int(cycles) / CYCLES_PER_MS)),
    }
    names.update(cuda_names(sim.allocators, sched.device_index))  # memory: the allocator's
    rng_names = _rng_cuda_names(sim)  # seeds and states of the devices' generators
    names.update(rng_names)
    patches = _Patches(sim)
    patches.install(cuda, names)
    patches.install(torch.cuda.random, rng_names)
    patches.install(torch.cuda.memory, {k: names[k] for k in ("MemPool", "use_mem_pool")})
    patches.install(torch.cuda.graphs, {"graph_pool_handle": names["graph_pool_handle"]})
    top, c_names = _torch_level_names(sim)
    c_names.update(_alloc_c_names(sim.allocators, sched.device_index))
    top["Generator"] = _SimTorchGenerator
    for namespace, extra in _api_names(sim, cudart.raw).items():
        patches.install(namespace, extra)
    restore_generators = _rng_install(sim)
    patches.install(torch, top)
    patches.install(torch.accelerator, {"Graph": AcceleratorGraph})
    patches.install(torch._C, c_names)
    # Tensor.record_stream parses its argument as a C++ stream before any Python override.
    real_record_stream = torch.Tensor.record_stream

    def record_stream(self: torch.Tensor, stream: Any) -> None:
        if isinstance(stream, SimStream):
            return _tensor_record_stream(self, stream)  # (the simulated allocator's)
        return real_record_stream(self, stream)  # type: ignore[no-any-return]

    torch.Tensor.record_stream = record_stream  # type: ignore[method-assign,assignment]

    undo_version = _set_cuda_version()

    def restore() -> None:
        restore_generators()
        if torch.Tensor.record_stream is record_stream:
            torch.Tensor.record_stream = real_record_stream  # type: ignore[method-assign]
        undo_version()
        patches.restore()

    return restore
