"""CUDA (and ROCm, through ``torch.cuda``/HIP) backend: the only module that touches torch.cuda.

* Pinned memory: page-aligned ``mmap`` regions of the exact size asked, registered with
  ``cudaHostRegister(Portable | Mapped)`` (PyTorch's caching host allocator would round every
  request up to a power of two).
* Copies: ``Tensor.copy_(non_blocking=True)`` on the current stream, only from pinned,
  contiguous memory; otherwise a plain blocking copy (said in ``capabilities().reasons``).
* Events: ``torch.cuda.Event`` recorded on the current stream.
* UVA views: an object exposing ``__cuda_array_interface__`` with the device pointer from
  ``cudaHostGetDevicePointer`` (``hipHostGetDevicePointer`` on ROCm), given to
  ``torch.as_tensor`` with an explicit device index; the pointer is checked and the host tensor
  kept alive by the view. Verified once per device by a write-after-map coherence probe.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import torch

from ._audit import pinstage_fallback
from ._backend import Backend, Probe, explicit_wait, host_region_tensor
from ._platform import WSL_STAGING_LIMIT, wsl_info

__all__ = ["CudaBackend", "available", "current_device", "backend_for"]

_HOST_REGISTER_PORTABLE = 0x01
_HOST_REGISTER_MAPPED = 0x02

_backends: dict[int, CudaBackend] = {}
_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def available() -> bool:
    return bool(torch.cuda.is_available())


def current_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def backend_for(device: torch.device) -> CudaBackend:
    index = device.index if device.index is not None else torch.cuda.current_device()
    from ._backend import SIM_STACK

    if SIM_STACK:  # a simulated CUDA is open: its devices, over its simulated driver
        return SIM_STACK[-1].backend_for(index)  # type: ignore[no-any-return]
    with _lock:
        if index not in _backends:
            if not available():
                raise RuntimeError(f"device {device} was asked for, but CUDA is not available "
                                   "in this process (CPU-only build or no GPU)")
            if index >= torch.cuda.device_count():
                raise ValueError(f"device cuda:{index} does not exist: this machine has "
                                 f"{torch.cuda.device_count()} CUDA device(s)")
            _backends[index] = CudaBackend(index)
        return _backends[index]


def _is_rocm() -> bool:
    return getattr(torch.version, "hip", None) is not None


class _Runtime:
    """``cudaHostGetDevicePointer`` / ``hipHostGetDevicePointer`` through ctypes, taken from the
    runtime library this process already loaded (so it is the one torch uses)."""

    def __init__(self) -> None:
        self.rocm = _is_rocm()
        self.lib = self._load()
        fn_name = "hipHostGetDevicePointer" if self.rocm else "cudaHostGetDevicePointer"
        self.fn = getattr(self.lib, fn_name)
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
        raise OSError(f"cannot find the {stem} runtime library to map pinned memory")

    def clear_last_error(self) -> None:
        fn = getattr(self.lib, "hipGetLastError" if self.rocm else "cudaGetLastError")
        fn.restype = ctypes.c_int
        fn()

    def device_pointer(self, host_ptr: int) -> int:
        out = ctypes.c_void_p()
        err = self.fn(ctypes.byref(out), ctypes.c_void_p(host_ptr), 0)
        if err != 0 or not out.value:
            raise RuntimeError(f"{'hip' if self.rocm else 'cuda'}HostGetDevicePointer failed "
                               f"with error {err} for host address {host_ptr:#x}")
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

    def register(self, ptr: int, size: int) -> int:
        """``cudaHostRegister(Portable | Mapped)``; returns the error code (0: success)."""
        return int(torch.cuda.cudart().cudaHostRegister(
            ptr, size, _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED))

    def clear_error(self) -> None:
        """``cudaGetLastError()``: take back the error a failed runtime call left set, which
        torch's next kernel-launch check would otherwise report from unrelated code."""
        try:
            _get_runtime().clear_last_error()
        except (OSError, AttributeError, RuntimeError):
            pass

    def unregister(self, ptr: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(ptr)

    def uva_view(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        nbytes = host.numel() * host.element_size()
        flat = host.reshape(-1).view(torch.uint8)
        with torch.cuda.device(device):
            dptr = _get_runtime().device_pointer(host.data_ptr())
            view = torch.as_tensor(_DeviceArray(flat, dptr, nbytes), device=device)
        if view.data_ptr() != dptr or view.device != device:
            raise RuntimeError("torch did not alias the mapped pinned memory (it copied it); "
                               "UVA views are not usable here")
        return view.view(host.dtype).view(host.shape)

    def device_name(self, index: int) -> str:
        return str(torch.cuda.get_device_name(index))


_EVENT_RING = 16  # events re-recorded per stream (a re-recorded event only fences later)


class CudaBackend(Backend):
    """One CUDA/ROCm device. Work goes on that device's current stream."""

    name = "cuda"
    accelerator = True

    def __init__(self, index: int, driver: Any = None) -> None:
        super().__init__()
        self.index = index
        self.device = torch.device("cuda", index)
        self.driver = driver if driver is not None else CudaDriver()
        self.checks_deferred_reads = bool(getattr(self.driver, "checks_deferred_reads", False))
        self._probe: Probe | None = None
        self._probe_lock = threading.Lock()
        self._events: dict[Any, tuple[list[Any], list[int]]] = {}
        self._events_lock = threading.Lock()

    def reset_after_fork(self) -> None:
        super().reset_after_fork()
        self._probe_lock = threading.Lock()
        self._events_lock = threading.Lock()
        self._events = {}  # the parent's CUDA events mean nothing in the child

    # -- facts -------------------------------------------------------------------------------
    def probe(self) -> Probe:
        with self._probe_lock:
            if self._probe is None:
                if self.is_capturing():
                    raise RuntimeError(
                        f"pinstage's capability probe for {self.device} cannot run inside a "
                        "CUDA graph capture (it synchronizes): call pinstage.capabilities() "
                        "(or any pinstage function) once before capturing")
                with pinstage_fallback():  # its copies are not the caller's hidden syncs
                    self._probe = self._run_probe()
            return self._probe

    def _run_probe(self) -> Probe:
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
            probe_buf = self.alloc_pinned(4096, in_use=False)
            can_pin = bool(probe_buf.is_pinned())
            reasons.append("pinned host memory: a test page was registered" if can_pin else
                           "pinned host memory: a registered page is not reported pinned")
        except (RuntimeError, OSError) as exc:
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
            except (RuntimeError, OSError, AttributeError) as exc:
                reasons.append(f"UVA off: mapping pinned memory failed: {exc}")
        return Probe(True, can_pin, uva, tuple(reasons), limit)

    def _coherence_probe(self, host: torch.Tensor) -> bool:
        view = self.uva_view(host[:256])
        arr = host.numpy()
        arr[:256] = torch.arange(256, dtype=torch.uint8).numpy()  # host write after mapping
        with torch.cuda.device(self.device):
            seen = view.clone()  # device reads through the mapping
            view[:16].fill_(7)  # device writes through it
            torch.cuda.synchronize(self.device)
        ok_read = bool(torch.equal(seen.cpu(), torch.arange(256, dtype=torch.uint8)))
        ok_write = bool((host[:16] == 7).all())
        return ok_read and ok_write

    # -- memory ------------------------------------------------------------------------------
    def alloc_pinned(self, nbytes: int, *, in_use: bool = True) -> torch.Tensor:
        torch.cuda.init()
        driver = self.driver

        def pin(ptr: int, size: int) -> None:
            with torch.cuda.device(self.device):
                err = driver.register(ptr, size)
            if err != 0:
                driver.clear_error()  # a failed call leaves its error set for unrelated code
                raise RuntimeError(f"cudaHostRegister of {size} bytes failed: error {err}")

        def unpin(ptr: int, size: int) -> None:
            driver.unregister(ptr)

        # backend=self: a dropped region is parked behind events, unregistered only after the
        # device has read it (cudaHostUnregister does not wait; hipHostUnregister would
        # synchronize the whole device from inside the garbage collector)
        return host_region_tensor(nbytes, pin=pin, unpin=unpin, in_use=in_use, backend=self)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and bool(t.is_pinned())

    def is_device_tensor(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda"

    # -- device work -------------------------------------------------------------------------
    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, label: str = "",
                 pinned: bool = False) -> None:
        if pinned or (src.is_contiguous() and src.is_pinned()):
            dst.copy_(src, non_blocking=True)  # host -> device, async from pinned memory
        else:
            with pinstage_fallback():
                dst.copy_(src)  # host -> device, blocking: pageable source (pinning is off)

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor, label: str = "") -> None:
        if dst.is_pinned() and dst.is_contiguous():
            dst.copy_(src, non_blocking=True)  # device -> host, async into pinned memory
        else:
            with pinstage_fallback():
                dst.copy_(src)  # device -> host, blocking: pageable destination

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def record_event(self, stream: Any) -> Any:
        """An event from a small per-stream ring, re-recorded: creating one per fence costs a
        driver call, and a re-recorded event completes only after the point it had fenced
        (fences stay correct, at worst a little late). Blocking events: waits sleep, not spin."""
        with self._events_lock:
            ring, pos = self._events.setdefault(stream, ([], [0]))
            if len(ring) < _EVENT_RING:
                event = torch.cuda.Event(blocking=True)
                ring.append(event)
            else:
                event = ring[pos[0]]
                pos[0] = (pos[0] + 1) % _EVENT_RING
            event.record(stream)  # after all work queued on that stream so far
            return event

    def is_capturing(self) -> bool:
        try:
            return bool(torch.cuda.is_current_stream_capturing())
        except RuntimeError:  # a torch build without CUDA graphs
            return False

    def event_done(self, event: Any) -> bool:
        return event is None or bool(event.query())

    def wait_event(self, event: Any) -> None:
        if event is not None and not event.query():
            self.stalls += 1
            event.synchronize()

    def uva_view(self, host: torch.Tensor) -> torch.Tensor:
        if not (host.device.type == "cpu" and host.is_contiguous()):
            raise ValueError("a UVA view needs a contiguous host tensor")
        if host.numel() == 0:
            return torch.empty(host.shape, dtype=host.dtype, device=self.device)
        if not host.is_pinned():
            raise ValueError("a UVA view needs pinned host memory; this tensor is pageable")
        return self.driver.uva_view(host, self.device)  # type: ignore[no-any-return]

    def synchronize(self) -> None:
        with explicit_wait():
            torch.cuda.synchronize(self.device)


def device_name(device: torch.device) -> str:
    return backend_for(device).driver.device_name(device.index or 0)  # type: ignore[no-any-return]


def bandwidth_probe(device: torch.device, nbytes: int = 64 * 2**20) -> dict[str, float]:
    """A few seconds' measure of H2D bandwidth (pinned and pageable) and of a small copy's
    host overhead, for ``pinstage doctor``."""
    import time

    import numpy as np

    backend = backend_for(device)
    pinned = backend.alloc_pinned(nbytes)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
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
