"""Backends whose work finishes before each call returns: the host itself, and any torch
device type pinstage has no accelerator backend for.

* :class:`CpuBackend` - the target is the host: plain copies, "UVA" is the host tensor itself.
* :class:`GenericBackend` - another torch device type (``meta``, ``xpu``, ``mps``...): plain
  torch copies, no pinned staging. ``meta`` stands in for an accelerator in audit tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ._audit import pinstage_fallback
from ._device import Backend, Probe, SyncDevice
from ._errors import UnavailableError

__all__ = ["CpuBackend", "GenericBackend", "CpuProvider", "GenericProvider"]


class CpuBackend(SyncDevice, Backend):
    """The host is the target: everything is finished when the call returns."""

    name = "cpu"
    accelerator = False

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def probe(self, alloc_pinned: Callable[[int], torch.Tensor]) -> Probe:
        return Probe(accelerator=False, can_pin=False, uva=True,
                     reasons=("no accelerator: CPU target (host memory is device memory)",))

    def register_host(self, ptr: int, size: int) -> None:
        raise UnavailableError("the CPU target has no pinned host memory (host memory is "
                               "device memory there)")

    def unregister_host(self, ptr: int, size: int) -> None:
        return None

    def is_pinned(self, t: torch.Tensor) -> bool:
        return False

    def is_device_tensor(self, t: torch.Tensor) -> bool:
        return False

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    def zeros(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=dtype, device=self.device)

    def uva_view(self, host: torch.Tensor) -> torch.Tensor:
        return host  # host memory is device memory

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, pinned: bool = False) -> None:
        dst.copy_(src)  # host -> host

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def copy_d2d(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def launch(self, fn: Callable[..., Any], *args: Any) -> None:
        fn(*args)

    def synchronize(self) -> None:
        return None  # everything is finished when a call returns

    def is_capturing(self) -> bool:
        return False

    def capture_underway(self, streams: Iterable[Any]) -> bool:
        return False

    def deferred_read_changed(self, message: str) -> Exception:
        return RuntimeError(message)


class GenericBackend(SyncDevice, Backend):
    """Another torch device type: plain torch copies, no pinned staging or UVA.

    Copies here are blocking when the device is real; that is the platform's limit and is said
    in ``capabilities().reasons``."""

    accelerator = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.name = device.type

    def probe(self, alloc_pinned: Callable[[int], torch.Tensor]) -> Probe:
        return Probe(accelerator=True, can_pin=False, uva=False, reasons=(
            f"{self.device.type} device: pinstage stages through pinned memory only on "
            "CUDA/ROCm; copies here are plain torch copies",))

    def register_host(self, ptr: int, size: int) -> None:
        raise UnavailableError(f"{self.device.type} devices get no pinned staging memory from "
                               "pinstage")

    def unregister_host(self, ptr: int, size: int) -> None:
        return None

    def is_pinned(self, t: torch.Tensor) -> bool:
        return False

    def is_device_tensor(self, t: torch.Tensor) -> bool:
        return t.device.type == self.device.type

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    def zeros(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=dtype, device=self.device)

    def uva_view(self, host: torch.Tensor) -> torch.Tensor:
        raise UnavailableError(f"{self.device.type} devices have no UVA views")

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, pinned: bool = False) -> None:
        with pinstage_fallback():
            dst.copy_(src)  # host -> device, blocking: no pinned staging on this device type

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with pinstage_fallback():
            dst.copy_(src)  # device -> host, blocking

    def copy_d2d(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def launch(self, fn: Callable[..., Any], *args: Any) -> None:
        fn(*args)

    def synchronize(self) -> None:
        sync = getattr(getattr(torch, self.device.type, None), "synchronize", None)
        if callable(sync) and self.device.type != "meta":
            sync()

    def is_capturing(self) -> bool:
        return False

    def capture_underway(self, streams: Iterable[Any]) -> bool:
        return False

    def deferred_read_changed(self, message: str) -> Exception:
        return RuntimeError(message)


class CpuProvider:
    """The host: always available, one device."""

    def __init__(self) -> None:
        self.backend = CpuBackend()

    def why_unavailable(self, device_type: str) -> str | None:
        return None

    def normalize(self, device: torch.device) -> torch.device:
        return self.backend.device

    def current_device(self) -> torch.device:
        return self.backend.device

    def backend_for(self, device: torch.device) -> Backend:
        return self.backend


class GenericProvider:
    """Any other torch device type, through plain torch calls."""

    def __init__(self) -> None:
        self._backends: dict[torch.device, GenericBackend] = {}

    def why_unavailable(self, device_type: str) -> str | None:
        if device_type == "meta":
            return None
        if device_type == "mps":
            ok = bool(torch.backends.mps.is_available())
        else:
            check = getattr(getattr(torch, device_type, None), "is_available", None)
            ok = bool(check()) if callable(check) else True
        return None if ok else f"torch reports no {device_type} device in this process"

    def normalize(self, device: torch.device) -> torch.device:
        return device

    def current_device(self) -> torch.device:
        raise UnavailableError("a generic device type is never the default target")

    def backend_for(self, device: torch.device) -> Backend:
        backend = self._backends.get(device)
        if backend is None:  # (two threads may both make one: the first stored wins)
            backend = self._backends.setdefault(device, GenericBackend(device))
        return backend
