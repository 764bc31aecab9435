"""vLLM names kept so engine code ports by changing an import: ``async_copy_to_gpu`` (the
helper vLLM folded into ``async_tensor_h2d``) and ``get_accelerator_view_from_cpu_tensor``.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch

from ._capabilities import capabilities_for
from ._copies import async_tensor_h2d
from ._errors import UnavailableError, describe
from ._registry import get_backend
from ._state import on_fork_child

__all__ = ["async_copy_to_gpu", "get_accelerator_view_from_cpu_tensor"]

_warned = False
_warn_lock = threading.Lock()


def _reset_after_fork() -> None:
    global _warn_lock
    _warn_lock = threading.Lock()  # (the parent's may have been held at the fork)


on_fork_child(_reset_after_fork)


def async_copy_to_gpu(x: Any, out: torch.Tensor | None = None,
                      device: Any = None) -> torch.Tensor:
    """Deprecated alias: ``async_tensor_h2d(x, device=device, out=out)``. Warns
    ``DeprecationWarning`` once per process (vLLM folded it into ``async_tensor_h2d``)."""
    global _warned
    if not _warned:
        with _warn_lock: first, _warned = not _warned, True  # noqa: E701 - (one line: see _host)
        if first:
            warnings.warn("pinstage.async_copy_to_gpu(x, out, device) is deprecated: use "
                          "async_tensor_h2d(x, device=device, out=out)", DeprecationWarning,
                          stacklevel=2)
    return async_tensor_h2d(x, device=device, out=out)


def get_accelerator_view_from_cpu_tensor(t: torch.Tensor) -> torch.Tensor:
    """A device tensor aliasing the pinned CPU tensor ``t`` (UVA), on the current accelerator:
    host writes to ``t`` are visible through it with no copy. On the CPU target it is ``t``.

    ``RuntimeError`` where UVA is not available; ``ValueError`` when ``t`` is not pinned or not
    contiguous (a view of pageable memory would read garbage, not fail)."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        where = f"a tensor on {t.device}" if isinstance(t, torch.Tensor) else describe(t)
        raise TypeError(f"t must be a CPU tensor, got {where}")
    backend = get_backend(None)
    caps = capabilities_for(backend)
    if not caps.uva:
        raise UnavailableError(f"UVA is not available for {backend.device}: "
                               + "; ".join(caps.reasons), caps.reasons)
    if not t.is_contiguous():
        raise ValueError(f"t must be contiguous for a UVA view; got shape {tuple(t.shape)} "
                         f"with strides {t.stride()} (use .contiguous() on pinned memory)")
    if not backend.accelerator:
        return t  # the CPU target: host memory is device memory
    if not backend.is_pinned(t):
        raise ValueError("t must be pinned host memory for a UVA view (e.g. a "
                         "CpuGpuBuffer's .cpu, or torch.empty(..., pin_memory=True)); this "
                         "tensor is pageable")
    return backend.uva_view(t)
