"""The smaller parts of ``torch.cuda`` that PyTorch's own tests use, on the simulated devices:
stream priorities and the CUDA stream protocol, ``Event.device``, ``check_error``,
``get_allocator_backend``, raw streams through ``cudart()`` and ``ExternalStream``, the legacy
``torch.cuda.FloatTensor``-style types and ``torch.cuda.comm``'s collectives across devices.
``names(sim)`` gives them, per namespace, for ``_torch_cuda.install``."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from ._core import SimState, active
from ._sched import SimEvent, SimStream
from ._tensor import empty_device, is_device

__all__ = ["PRIORITY_RANGE", "clamp_priority", "names", "CudaRt"]

# (least, greatest): PyTorch exposes at most 4 priority levels (0 .. -3) on GPUs whose range
# is wider, as a compute-capability 9.0 device's is
PRIORITY_RANGE = (0, -3)


def clamp_priority(priority: Any) -> int:
    """A stream priority mapped into the supported range, as CUDA maps one outside it."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"a stream priority must be an int, got {priority!r}")
    least, greatest = PRIORITY_RANGE
    return max(greatest, min(least, priority))


def _priority_range() -> tuple[int, int]:
    return PRIORITY_RANGE


def _cuda_stream_protocol(self: SimStream) -> tuple[int, int]:
    """The CUDA Stream Protocol: (version 0, the stream's handle)."""
    return (0, int(self.cuda_stream))


def _event_device(self: SimEvent) -> torch.device | None:
    """The device of the stream the event was recorded on; ``None`` before it is recorded
    (a CUDA event is created at its first record)."""
    stream = self.stream
    return None if stream is None else stream.device


def _event_handle(self: SimEvent) -> int:
    """``Event.cuda_event``: 0 until the event is first recorded, then a stable handle."""
    if self.stream is None and not getattr(self, "_handle", 0):
        return 0
    handle = getattr(self, "_handle", 0)
    if not handle:
        handle = self._handle = 0x5E00_0000 + id(self) % 0x00FF_FFFF  # type: ignore[attr-defined]
    return int(handle)


SimStream.priority_range = staticmethod(_priority_range)  # type: ignore[attr-defined]
SimStream.__cuda_stream__ = _cuda_stream_protocol  # type: ignore[attr-defined]
SimStream._as_parameter_ = property(  # type: ignore[attr-defined]
    lambda self: ctypes.c_void_p(self.cuda_stream))
SimStream.is_capturing = lambda self: self.capture is not None  # type: ignore[attr-defined]
SimEvent.device = property(_event_device)  # type: ignore[attr-defined]
SimEvent.event_id = property(_event_handle)  # type: ignore[attr-defined]
SimEvent.cuda_event = property(_event_handle)  # type: ignore[attr-defined]
SimEvent._as_parameter_ = property(  # type: ignore[attr-defined]
    lambda self: ctypes.c_void_p(_event_handle(self)))


# --------------------------------------------------------------------------------------------
# errors


_ERRORS = {  # code: (name, CUDA's description: what cudaGetErrorString gives)
    1: ("cudaErrorInvalidValue", "invalid argument"),
    2: ("cudaErrorMemoryAllocation", "out of memory"),
    100: ("cudaErrorNoDevice", "no CUDA-capable device is detected"),
    101: ("cudaErrorInvalidDevice", "invalid device ordinal"),
    400: ("cudaErrorInvalidResourceHandle", "invalid resource handle"),
    700: ("cudaErrorIllegalAddress", "an illegal memory access was encountered"),
    713: ("cudaErrorHostMemoryNotRegistered",
          "pointer does not correspond to a registered memory region"),
    801: ("cudaErrorNotSupported", "operation not supported"),
    900: ("cudaErrorStreamCaptureUnsupported",
          "operation not permitted when stream is capturing"),
}


def error_string(code: int) -> str:
    """CUDA's description of an error code (``cudaGetErrorString``), naming the code."""
    known = _ERRORS.get(int(code))
    if known is None:
        return f"unknown error (simulated CUDA error {code})"
    return f"{known[1]} ({known[0]}, simulated)"


def check_error(res: int) -> None:
    """``torch.cuda.check_error``: nothing for 0 (``cudaSuccess``), else ``CudaError``."""
    if isinstance(res, bool) or not isinstance(res, int):
        raise TypeError(f"check_error() expects a CUDA error code (int), got {res!r}")
    if res == 0:
        return
    err = torch.cuda.CudaError.__new__(torch.cuda.CudaError)
    RuntimeError.__init__(err, f"{error_string(res)} ({res})")
    raise err


# --------------------------------------------------------------------------------------------
# raw streams


class CudaRt:
    """The raw-stream calls of ``torch.cuda.cudart()``: ``cudaStreamCreate(ptr)`` writes a new
    simulated stream's handle at ``ptr`` (a ``cudaStream_t*``), ``cudaStreamDestroy(handle)``
    forgets it; ``torch.cuda.ExternalStream(handle)`` finds the stream again."""

    def __init__(self, sim: SimState) -> None:
        self.sim = sim
        self.raw: dict[int, SimStream] = {}

    def cudaStreamCreate(self, ptr: int) -> int:  # noqa: N802
        if not isinstance(ptr, int) or isinstance(ptr, bool) or ptr == 0:
            return 1  # cudaErrorInvalidValue
        stream = self.sim.sched.new_stream(None, 0)
        self.raw[int(stream.cuda_stream)] = stream
        ctypes.c_uint64.from_address(ptr).value = int(stream.cuda_stream)
        return 0

    def cudaStreamDestroy(self, handle: int) -> int:  # noqa: N802
        return 0 if self.raw.pop(int(handle or 0), None) is not None else 400

    def external(self, stream_ptr: Any, device: Any = None, **kwargs: Any) -> SimStream:
        handle = int(getattr(stream_ptr, "value", stream_ptr) or 0)
        stream = self.raw.get(handle)
        if stream is None:
            for s in self.sim.sched.all_streams():
                if int(s.cuda_stream) == handle:
                    stream = s
                    break
        if stream is None:
            raise ValueError(f"ExternalStream: {handle:#x} is not a stream of the simulated "
                             "devices (make it with torch.cuda.cudart().cudaStreamCreate)")
        return stream


# --------------------------------------------------------------------------------------------
# legacy tensor types

_LEGACY = {"FloatTensor": torch.float32, "DoubleTensor": torch.float64,
           "HalfTensor": torch.float16, "BFloat16Tensor": torch.bfloat16,
           "LongTensor": torch.int64, "IntTensor": torch.int32, "ShortTensor": torch.int16,
           "CharTensor": torch.int8, "ByteTensor": torch.uint8, "BoolTensor": torch.bool}


class _LegacyType(type):
    """``torch.cuda.FloatTensor`` and the like: calling one makes a simulated tensor of its
    dtype (sizes: uninitialized; data: copied; nothing: empty), and ``isinstance`` holds for
    simulated tensors of that dtype, as for CUDA tensors."""

    dtype: torch.dtype

    def __instancecheck__(cls, obj: Any) -> bool:
        return is_device(obj) and obj.dtype == cls.dtype

    def __call__(cls, *args: Any, device: Any = None) -> Any:
        sim = active()
        probe = empty_device(sim, (0,), cls.dtype, sim.sched.device_index(device))
        return probe.new(*args)

    def __repr__(cls) -> str:
        return f"<class 'torch.cuda.{cls.__name__}'>"


def _legacy_types() -> dict[str, Any]:
    return {name: _LegacyType(name, (), {"dtype": dtype, "is_cuda": True,
                                         "__module__": "torch.cuda"})
            for name, dtype in _LEGACY.items()}


# --------------------------------------------------------------------------------------------
# torch.cuda.comm


def _comm(sim: SimState) -> dict[str, Any]:
    sched = sim.sched

    def dev(d: Any) -> torch.device:
        if isinstance(d, torch.device) and d.type == "cpu" or d in ("cpu", -1):
            return torch.device("cpu")
        return torch.device("cuda", sched.device_index(d))

    def on(t: torch.Tensor, d: torch.device) -> torch.Tensor:
        same = (is_device(t) and d.type == "cuda" and t.get_device() == d.index) or \
            (not is_device(t) and d.type == "cpu")
        return t if same else t.to(d)

    def outputs_on_cuda(out: Sequence[torch.Tensor]) -> None:
        for i, o in enumerate(out):
            if not is_device(o):
                raise RuntimeError("Expected all output tensors to be CUDA tensors, but output "
                                   f"tensor at index {i} has device '{o.device}'")

    def broadcast(tensor: torch.Tensor, devices: Sequence[Any] | None = None, *,
                  out: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
        if (devices is None) == (out is None):
            raise RuntimeError("Exactly one of 'devices' and 'out' must be specified, but got "
                               f"devices={devices!r} and out={out!r}")
        if out is not None:
            outputs_on_cuda(out)
            for i, o in enumerate(out):
                if o.shape != tensor.shape:
                    raise RuntimeError(
                        "Expected all output tensors to have same shape as the source tensor "
                        f"{tuple(tensor.shape)}, but output tensor at index {i} has shape "
                        f"{tuple(o.shape)}")
            for o in out:
                o.copy_(tensor)
            return tuple(out)
        return tuple(on(tensor, dev(d)) for d in devices)  # type: ignore[union-attr]

    def scatter(tensor: torch.Tensor, devices: Sequence[Any] | None = None,
                chunk_sizes: Sequence[int] | None = None, dim: int = 0,
                streams: Sequence[Any] | None = None, *,
                out: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
        d = dim + tensor.dim() if dim < 0 else dim
        if out is not None:
            if devices is not None:
                raise RuntimeError("'devices' must not be specified when 'out' is specified, "
                                   f"but got devices={devices!r}")
            if chunk_sizes is not None:
                raise RuntimeError("'chunk_sizes' must not be specified when 'out' is "
                                   f"specified, but got chunk_sizes={chunk_sizes!r}")
            if not out:
                raise RuntimeError("Expected at least one output tensor to scatter to")
            outputs_on_cuda(out)
            want = list(tensor.shape)
            for i, o in enumerate(out):
                shape = list(o.shape)
                if len(shape) != len(want) or any(
                        a != b for k, (a, b) in enumerate(zip(shape, want)) if k != d):
                    raise RuntimeError(
                        f"Output tensor at index {i} has incorrect shape: {tuple(shape)}. "
                        f"Expected same shape except for scatter dim {d} as the source "
                        f"tensor: {tuple(want)}.")
            if sum(o.shape[d] for o in out) != tensor.shape[d]:
                raise RuntimeError(
                    f"Total size for output tensors along scatter dim {d} does not match "
                    f"that of the input tensor {tensor.shape[d]}")
            parts = tensor.split([o.shape[d] for o in out], d)
            for o, p in zip(out, parts):
                o.copy_(p)
            return tuple(out)
        if devices is None:
            raise RuntimeError("Exactly one of 'devices' and 'out' must be specified")
        devices = list(devices)
        if not devices:
            raise RuntimeError("Expected at least one device to scatter to")
        if chunk_sizes is not None and len(chunk_sizes) != len(devices):
            raise RuntimeError(
                "Expected devices and chunk_sizes to be of same length, but got "
                f"len(devices) = {len(devices)} and len(chunk_sizes) = {len(chunk_sizes)}")
        parts = tensor.split(list(chunk_sizes), d) if chunk_sizes is not None else \
            tensor.chunk(len(devices), d)
        result = []
        for i, (p, target) in enumerate(zip(parts, devices)):
            stream = streams[i] if streams is not None else None
            with torch.cuda.stream(stream):  # (.to keeps a dense chunk's memory format)
                result.append(p.to(dev(target)))
        return tuple(result)

    def gather(tensors: Sequence[torch.Tensor], dim: int = 0, destination: Any = None, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
        if out is not None and destination is not None:
            raise RuntimeError("'destination' must not be specified when 'out' is specified, "
                               f"but got destination={destination!r}")
        if not tensors:
            raise RuntimeError("Expected at least one tensor to gather from")
        first = tensors[0]
        d = dim + first.dim() if dim < 0 else dim
        for i, t in enumerate(tensors):
            if not is_device(t):
                raise RuntimeError("Expected all input tensors to be CUDA tensors, but input "
                                   f"tensor at index {i} has device {t.device}")
            if t.dim() != first.dim():
                raise RuntimeError(
                    "Expected all input tensors to have the same number of dimensions as the "
                    f"first tensor ({first.dim()}), but input tensor at index {i} has "
                    f"{t.dim()} dimensions")
            if any(a != b for k, (a, b) in enumerate(zip(t.shape, first.shape)) if k != d):
                raise RuntimeError(
                    f"Input tensor at index {i} has invalid shape {tuple(t.shape)}, but "
                    f"expected the first tensor's {tuple(first.shape)} except for the "
                    f"gather dim {d}")
        target = out.device if out is not None else \
            dev(sched.current_device() if destination is None else destination)
        joined = torch.cat([on(t, target) for t in tensors], d)
        if out is not None:
            return out.copy_(joined)
        return joined

    def reduce_add(inputs: Sequence[torch.Tensor], destination: Any = None) -> torch.Tensor:
        target = dev(sched.current_device() if destination is None else destination)
        total = on(inputs[0], target).clone()
        for t in inputs[1:]:
            total += on(t, target)
        return total

    def broadcast_coalesced(tensors: Sequence[torch.Tensor], devices: Sequence[Any],
                            buffer_size: int = 10485760) -> list[tuple[torch.Tensor, ...]]:
        """Per device, the tensors there (``DataParallel``'s replicate uses it); the source
        device gets the tensors themselves."""
        return [tuple(on(t, dev(d)) for t in tensors) for d in devices]

    return {"broadcast": broadcast, "scatter": scatter, "gather": gather,
            "reduce_add": reduce_add, "broadcast_coalesced": broadcast_coalesced}


def names(sim: SimState, cudart: CudaRt) -> dict[Any, dict[str, Any]]:
    """The stand-ins, per namespace to patch."""
    import torch.cuda.comm
    import torch.cuda.nvtx
    import torch.nn.parallel.comm

    comm = _comm(sim)
    raw = _raw_allocations(sim)
    cuda = {
        "get_allocator_backend": lambda: "native",
        "check_error": check_error,
        "ExternalStream": cudart.external,
        "get_stream_from_external": cudart.external,
        **raw,
        **_legacy_types(),
    }
    c = {  # entry points torch.cuda's Python layer and PyTorch's test harness call directly
        "_cuda_clearCublasWorkspaces": lambda: None,  # (no cuBLAS workspaces are simulated)
        "_host_emptyCache": lambda: None,  # (pinned memory is the host's: nothing cached)
        "_cuda_hostMemoryStats": sim.pinned.stats.nested,
        "_cuda_resetAccumulatedHostMemoryStats": sim.pinned.stats.reset_accumulated,
        "_cuda_resetPeakHostMemoryStats": sim.pinned.stats.reset_peak,
        "_cuda_getStreamFromExternal": lambda ptr, device_index=None: cudart.external(ptr),
    }
    # (torch.cuda.memory's own gate, a CPU build's is_initialized(), would answer {} there)
    host = {"host_memory_stats_as_nested_dict": sim.pinned.stats.nested}
    cuda.update(host)
    return {torch.cuda: cuda, torch.cuda.comm: comm, torch.nn.parallel.comm: comm,
            torch._C: c, torch.cuda.nvtx: {"_nvtx": _NVTX}, torch.cuda.memory: host}


class _NoNvtx:
    """NVTX ranges and marks on a simulated device: accepted, and nothing to show them."""

    __module__ = "pinstage._sim"

    @staticmethod
    def rangePushA(msg: str) -> int:  # noqa: N802 - (NVTX's own names)
        return 0

    @staticmethod
    def rangePop() -> int:  # noqa: N802
        return 0

    @staticmethod
    def rangeStartA(msg: str) -> int:  # noqa: N802
        return 1

    @staticmethod
    def rangeEnd(handle: int) -> None:  # noqa: N802
        return None

    @staticmethod
    def markA(msg: str) -> None:  # noqa: N802
        return None

    @staticmethod
    def deviceRangeStart(msg: str, stream: int = 0) -> int:  # noqa: N802
        return 1

    @staticmethod
    def deviceRangeEnd(handle: int, stream: int = 0) -> None:  # noqa: N802
        return None


_NVTX = _NoNvtx()


def _raw_allocations(sim: SimState) -> dict[str, Any]:
    """``caching_allocator_alloc``/``caching_allocator_delete``: raw device memory from the
    simulated allocator, as an address, on a stream (the current one by default)."""
    sched = sim.sched
    held: dict[int, torch.Tensor] = {}

    def alloc(size: int, device: Any = None, stream: Any = None) -> int:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise TypeError(f"caching_allocator_alloc() expects a size in bytes, got {size!r}")
        index = sched.device_index(device)
        if stream is None:
            stream = sched.current_stream(index)
        elif not isinstance(stream, SimStream):
            raise TypeError("Invalid type for stream argument, must be `torch.cuda.Stream` or "
                            f"`int` representing a pointer to an existing stream, got {stream!r}")
        prev = sched.current_stream(index)
        sched.set_stream(stream)
        try:
            t = empty_device(sim, (max(size, 1),), torch.uint8, index)
        finally:
            sched.set_stream(prev)
        ptr = t.data_ptr()
        held[ptr] = t
        return ptr

    def delete(mem_ptr: int) -> None:
        if held.pop(int(mem_ptr), None) is None:
            raise ValueError(f"caching_allocator_delete(): {mem_ptr!r} is not an address "
                             "caching_allocator_alloc gave on the simulated devices")

    return {"caching_allocator_alloc": alloc, "caching_allocator_delete": delete}
