"""CUDA (and ROCm, through ``torch.cuda``/HIP) backend: the only module that touches torch.cuda.

* Pinned memory: the device state's page-aligned ``mmap`` regions of the exact size asked,
  registered here with ``cudaHostRegister(Portable | Mapped)`` (PyTorch's caching host
  allocator would round every request up to a power of two).
* Copies: ``Tensor.copy_(non_blocking=True)`` on the current stream, only from pinned,
  contiguous memory; otherwise a plain blocking copy (said in ``capabilities().reasons``).
* Events: ``torch.cuda.Event`` (blocking: a host wait sleeps, it does not spin).
* UVA views: an object exposing ``__cuda_array_interface__`` with the device pointer from
  ``cudaHostGetDevicePointer`` (``hipHostGetDevicePointer`` on ROCm), given to
  ``torch.as_tensor`` with an explicit device index; the pointer is checked and the host tensor
  kept alive by the view. Verified once per device by a write-after-map coherence probe.

The backend talks to the runtime through a small driver object (:class:`CudaDriver`); the
simulated CUDA supplies its own, so this module's code runs unchanged in CPU-only CI.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ._audit import pinstage_fallback
from ._callsite import explicit_wait
from ._device import Backend, Event, Probe, Stream
from ._errors import CaptureError, DriverError, UnavailableError
from ._platform import WSL_STAGING_LIMIT, wsl_info

__all__ = ["CudaBackend", "CudaDriver", "CudaProvider", "provider", "bandwidth_probe",
           "device_name"]

_HOST_REGISTER_PORTABLE = 0x01
_HOST_REGISTER_MAPPED = 0x02
_CPU = torch.device("cpu")
# what a failing device or driver raises, as opposed to a bug in pinstage
_DEVICE_FAILURES = (DriverError, UnavailableError, OSError, torch.AcceleratorError)


def _is_rocm() -> bool:
    return getattr(torch.version, "hip", None) is not None


class _Runtime:
    """``cudaHostGetDevicePointer`` / ``hipHostGetDevicePointer`` and ``cudaGetLastError``
    through ctypes, taken from the runtime library this process already loaded (so it is the
    one torch uses)."""

    def __init__(self) -> None:
        self.rocm = _is_rocm()
        self.lib = self._load()
        fn_name = "hipHostGetDevicePointer" if self.rocm else "cudaHostGetDevicePointer"
        try:
            self.fn = getattr(self.lib, fn_name)
        except AttributeError:
            raise DriverError(f"the runtime library has no {fn_name}") from None
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_uint]

    def _load(self) -> ctypes.CDLL:
        stem = "libamdhip64" if self.rocm else "libcudart"
        try:
            with open("/proc/self/maps", encoding="utf-8") as f:
                for line in f:
                    path = line.rsplit(None, 1)[-1]
                    if stem in path.rsplit("/", 1)[-1]:
                        return ctypes.CDLL(path)
        except OSError:
            pass
        names = ["libamdhip64.so"] if self.rocm else ["libcudart.so.13", "libcudart.so.12",
                                                      "libcudart.so.11.0", "libcudart.so"]
        for name in names:
            try:
                return ctypes.CDLL(name)
            except OSError:
                continue
        raise DriverError(f"cannot find the {stem} runtime library to map pinned memory")

    def clear_last_error(self) -> None:
        name = "hipGetLastError" if self.rocm else "cudaGetLastError"
        try:
            fn = getattr(self.lib, name)
        except AttributeError:
            raise DriverError(f"the runtime library has no {name}") from None
        fn.restype = ctypes.c_int
        fn()

    def stream_is_capturing(self, stream: int) -> bool:
        name = "hipStreamIsCapturing" if self.rocm else "cudaStreamIsCapturing"
        fn = getattr(self.lib, name, None)
        if fn is None:
            return False
        status = ctypes.c_int(0)
        err = fn(ctypes.c_void_p(stream), ctypes.byref(status))
        return err == 0 and status.value != 0  # 0: cudaStreamCaptureStatusNone

    def device_pointer(self, host_ptr: int) -> int:
        out = ctypes.c_void_p()
        err = self.fn(ctypes.byref(out), ctypes.c_void_p(host_ptr), 0)
        if err != 0 or not out.value:
            raise DriverError(f"{'hip' if self.rocm else 'cuda'}HostGetDevicePointer failed "
                              f"with error {err} for host address {host_ptr:#x}", err)
        return int(out.value)


_runtime: _Runtime | None = None


def _get_runtime() -> _Runtime:
    global _runtime
    if _runtime is None:
        _runtime = _Runtime()
    return _runtime


class _DeviceArray:
    """``__cuda_array_interface__`` for a device pointer into pinned host memory. Holds the host
    tensor so the memory outlives every view made from this object."""

    def __init__(self, host: torch.Tensor, dptr: int, nbytes: int) -> None:
        self.host = host
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (dptr, False),
            "version": 3, "strides": None,
        }


class CudaDriver:
    """The driver calls pinstage makes beyond ``torch.cuda``: registering host memory
    (``cudaHostRegister``), unregistering it, and mapping it for the device (UVA). The
    simulator supplies its own, so the backend above it runs unchanged on a CPU."""

    checks_deferred_reads = False

    def register(self, ptr: int, size: int) -> int:
        """``cudaHostRegister(Portable | Mapped)``; returns the error code (0: success)."""
        return int(torch.cuda.cudart().cudaHostRegister(
            ptr, size, _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED))

    def clear_error(self) -> None:
        """``cudaGetLastError()``: take back the error a failed runtime call left set, which
        torch's next kernel-launch check would otherwise report from unrelated code."""
        try:
            _get_runtime().clear_last_error()
        except DriverError:
            pass  # no runtime library to ask: nothing of ours could have set an error

    def unregister(self, ptr: int) -> int:
        """``cudaHostUnregister``; returns the error code. On ROCm, ``hipHostUnregister``
        synchronizes the whole device: pinstage calls it only for memory the device is done
        with (parked frees, collected off the hot path)."""
        return int(torch.cuda.cudart().cudaHostUnregister(ptr) or 0)

    def uva_view(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        nbytes = host.numel() * host.element_size()
        flat = host.reshape(-1).view(torch.uint8)
        with torch.cuda.device(device):
            dptr = _get_runtime().device_pointer(host.data_ptr())
            view = torch.as_tensor(_DeviceArray(flat, dptr, nbytes), device=device)
        if view.data_ptr() != dptr or view.device != device:
            raise DriverError("torch did not alias the mapped pinned memory (it copied it); "
                              "UVA views are not usable here")
        return view.view(host.dtype).view(host.shape)

    def device_name(self, index: int) -> str:
        return str(torch.cuda.get_device_name(index))

    def capture_underway(self, streams: Iterable[Any]) -> bool:
        """Whether any of ``streams`` is capturing (``cudaStreamIsCapturing``, legal during a
        capture). Captures on streams pinstage never used cannot be seen from here."""
        try:
            runtime = _get_runtime()
        except DriverError:
            return False
        for s in streams:
            handle = getattr(s, "cuda_stream", None)
            if handle is not None and runtime.stream_is_capturing(int(handle)):
                return True
        return False

    def hazard(self, message: str) -> Exception:
        return RuntimeError(message)


class CudaBackend(Backend):
    """One CUDA/ROCm device, stateless: work goes on that device's current stream."""

    name = "cuda"
    accelerator = True
    asynchronous = True

    def __init__(self, index: int, driver: Any = None) -> None:
        self.index = index
        self.device = torch.device("cuda", index)
        self.driver = driver if driver is not None else CudaDriver()
        self.checks_deferred_reads = bool(getattr(self.driver, "checks_deferred_reads", False))

    # -- facts -------------------------------------------------------------------------------
    def probe(self, alloc_pinned: Callable[[int], torch.Tensor]) -> Probe:
        if self.is_capturing():
            raise CaptureError(
                f"pinstage's capability probe for {self.device} cannot run inside a CUDA "
                "graph capture (it synchronizes): call pinstage.capabilities() (or any "
                "pinstage function) once before capturing")
        with pinstage_fallback():  # its copies are not the caller's hidden syncs
            return self._run_probe(alloc_pinned)

    def _run_probe(self, alloc_pinned: Callable[[int], torch.Tensor]) -> Probe:
        reasons: list[str] = []
        name = self.driver.device_name(self.index)
        kind = "ROCm/HIP" if _is_rocm() else "CUDA"
        reasons.append(f"{kind} device {self.device} ({name})")
        limit = None
        wsl = wsl_info()
        if wsl is not None:
            if not wsl.pinning_works:
                reasons.append(f"running under WSL kernel {wsl.release}: pinned memory does not "
                               "work before kernel 4.19.121, so it is off")
                return Probe(True, False, False, tuple(reasons))
            limit = WSL_STAGING_LIMIT
            reasons.append(
                f"running under WSL kernel {wsl.release}: pinning works but WSL caps pinned "
                "memory near 0.5-1 GiB in total, so pinstage keeps it on with its staging arena "
                f"capped at {WSL_STAGING_LIMIT >> 20} MiB (vLLM turns it off; a bounded arena "
                "is what the cap allows)")
        try:
            probe_buf = alloc_pinned(4096)
            can_pin = bool(self.is_pinned(probe_buf))
            reasons.append("pinned host memory: a test page was registered" if can_pin else
                           "pinned host memory: a registered page is not reported pinned")
        except _DEVICE_FAILURES as exc:
            return Probe(True, False, False, (*reasons, f"pinned host memory unavailable: {exc}"),
                         limit)
        uva = False
        if can_pin:
            try:
                uva = self._coherence_probe(probe_buf)
                reasons.append("UVA: a host write after mapping was seen by the device and a "
                               "device write by the host" if uva else
                               "UVA off: the coherence probe read stale data through the "
                               "mapped view (e.g. Confidential Computing)")
            except _DEVICE_FAILURES as exc:
                reasons.append(f"UVA off: mapping pinned memory failed: {exc}")
        return Probe(True, can_pin, uva, tuple(reasons), limit)

    def _coherence_probe(self, host: torch.Tensor) -> bool:
        """Write after mapping, read on the device; write on the device, read on the host.
        Every tensor is made on an explicit device (a default device of ``cuda`` or ``meta``
        must not move them), and nothing here blocks in a way ``set_sync_debug_mode`` flags:
        results come back by non-blocking copies into pinned memory and a device sync."""
        view = self.uva_view(host[:256])
        expected = torch.arange(256, dtype=torch.uint8, device=_CPU)
        host[:256].copy_(expected)  # host write after mapping
        back = host[1024:1280]
        with torch.cuda.device(self.device):
            seen = torch.empty(256, dtype=torch.uint8, device=self.device)
            seen.copy_(view, non_blocking=True)  # device reads through the mapping
            view[:16].fill_(7)  # device writes through it
            back.copy_(seen, non_blocking=True)  # device -> pinned host, no blocking read
            torch.cuda.synchronize(self.device)
        ok_read = bool(torch.equal(back, expected))
        ok_write = bool((host[:16] == 7).all())
        return ok_read and ok_write

    # -- memory ------------------------------------------------------------------------------
    def register_host(self, ptr: int, size: int) -> None:
        torch.cuda.init()
        with torch.cuda.device(self.device):
            err = self.driver.register(ptr, size)
        if err != 0:
            self.driver.clear_error()  # a failed call leaves its error set for unrelated code
            raise DriverError(f"cudaHostRegister of {size} bytes failed: error {err}", err)

    def unregister_host(self, ptr: int, size: int) -> None:
        err = self.driver.unregister(ptr)
        if err:
            self.driver.clear_error()  # (the memory is released either way)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and bool(t.is_pinned())

    def is_device_tensor(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda"

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    def zeros(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=dtype, device=self.device)

    def uva_view(self, host: torch.Tensor) -> torch.Tensor:
        if not (host.device.type == "cpu" and host.is_contiguous()):
            raise ValueError("a UVA view needs a contiguous host tensor")
        if host.numel() == 0:
            return torch.empty(host.shape, dtype=host.dtype, device=self.device)
        if not host.is_pinned():
            raise ValueError("a UVA view needs pinned host memory; this tensor is pageable")
        return self.driver.uva_view(host, self.device)  # type: ignore[no-any-return]

    # -- device work -------------------------------------------------------------------------
    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, pinned: bool = False) -> None:
        if pinned or (src.is_contiguous() and src.is_pinned()):
            dst.copy_(src, non_blocking=True)  # host -> device, async from pinned memory
        else:
            with pinstage_fallback():
                dst.copy_(src)  # host -> device, blocking: pageable source (pinning is off)

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.is_pinned() and dst.is_contiguous():
            dst.copy_(src, non_blocking=True)  # device -> host, async into pinned memory
        else:
            with pinstage_fallback():
                dst.copy_(src)  # device -> host, blocking: pageable destination

    def copy_d2d(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)  # device -> device (or UVA view -> device)

    def launch(self, fn: Callable[..., Any], *args: Any) -> None:
        fn(*args)  # torch ops on device tensors: queued on the current stream

    def synchronize(self) -> None:
        with explicit_wait():
            torch.cuda.synchronize(self.device)

    def is_capturing(self) -> bool:
        try:
            return bool(torch.cuda.is_current_stream_capturing())
        except RuntimeError:  # a torch build without CUDA graphs
            return False

    def capture_underway(self, streams: Iterable[Stream]) -> bool:
        if self.is_capturing():
            return True
        return bool(self.driver.capture_underway(streams))

    def deferred_read_changed(self, message: str) -> Exception:
        return self.driver.hazard(message)  # type: ignore[no-any-return]

    # -- streams and raw events --------------------------------------------------------------
    def current_stream(self) -> Stream:
        return torch.cuda.current_stream(self.device)

    def new_event(self) -> Event:
        return torch.cuda.Event(blocking=True)  # a host wait on it sleeps instead of spinning

    def record_event(self, event: Event, stream: Stream) -> None:
        event.record(stream)  # after all work queued on that stream so far

    def event_done(self, event: Event) -> bool:
        return bool(event.query())

    def wait_event_host(self, event: Event) -> None:
        event.synchronize()


class CudaProvider:
    """Serves ``cuda`` devices with :class:`CudaBackend` over the real runtime."""

    def __init__(self) -> None:
        self._backends: dict[int, CudaBackend] = {}

    def why_unavailable(self, device_type: str = "cuda") -> str | None:
        if getattr(torch.cuda, "_is_in_bad_fork", lambda: False)():
            return ("this process was forked after CUDA was initialised in its parent, and "
                    "CUDA cannot be used in such a child (use the 'spawn' start method)")
        if not torch.cuda.is_available():
            return ("CUDA is not available in this process (CPU-only build of torch, or no "
                    "GPU visible)")
        return None

    def current_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def normalize(self, device: torch.device) -> torch.device:
        if device.index is None:
            return self.current_device()
        count = torch.cuda.device_count()
        if device.index >= count:
            raise ValueError(f"device cuda:{device.index} does not exist: this machine has "
                             f"{count} CUDA device(s)")
        return device

    def backend_for(self, device: torch.device) -> Backend:
        index = device.index if device.index is not None else torch.cuda.current_device()
        backend = self._backends.get(index)
        if backend is None:  # (two threads may both make one: the first stored wins)
            backend = self._backends.setdefault(index, CudaBackend(index))
        return backend


_PROVIDER: list[CudaProvider] = []


def provider() -> CudaProvider:
    """The process's CUDA provider (made on first use)."""
    if not _PROVIDER:
        _PROVIDER.append(CudaProvider())
    return _PROVIDER[0]


def device_name(device: torch.device) -> str:
    from ._registry import get_backend

    backend = get_backend(device)
    driver = getattr(backend, "driver", None) or CudaDriver()
    return driver.device_name(device.index or 0)  # type: ignore[no-any-return]


def bandwidth_probe(device: torch.device, nbytes: int = 64 * 2**20) -> dict[str, float]:
    """A few seconds' measure of H2D bandwidth (pinned and pageable) and of a small copy's
    host overhead, for ``pinstage doctor``."""
    import time

    import numpy as np

    from ._registry import get_backend
    from ._state import device_state

    pinned = device_state(get_backend(device)).alloc_pinned(nbytes)
    pageable = torch.empty(nbytes, dtype=torch.uint8, device=_CPU)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out: dict[str, float] = {}
    for name, src in (("pinned_h2d_gbps", pinned), ("pageable_h2d_gbps", pageable)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        out[name] = nbytes / float(np.median(times)) / 1e9
    small = pinned[:1024]
    calls = 200
    t0 = time.perf_counter()
    for _ in range(calls):
        dst[:1024].copy_(small, non_blocking=True)
    out["small_copy_host_us"] = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize(device)
    return out
