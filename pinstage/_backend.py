"""Kept for one round: the names this module held before the seam was split.

The device seam is now ``_device`` (the interface), ``_registry`` (providers and device
resolution) and ``_cpu`` (the CPU and generic backends). Import from those; this module only
re-exports them for code written against the old layout.
"""

from __future__ import annotations

from ._callsite import explicit_wait
from ._cpu import CpuBackend, GenericBackend
from ._device import DONE, AllOf, Backend, Fence, Probe, refuse_capture
from ._registry import get_backend, register_provider, resolve_device

__all__ = ["Backend", "Probe", "Fence", "AllOf", "DONE", "CpuBackend", "GenericBackend",
           "get_backend", "resolve_device", "register_provider", "refuse_capture",
           "explicit_wait"]
