"""pinstage: move data from host memory to an accelerator without stalling the host by accident.

The names follow vLLM's host-to-device helpers so engine code ports by changing an import.
Importing pinstage does no device work and never initialises CUDA.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import _backend as _backend  # the old layout's names, kept one round
from . import _logging as _logging  # the logger's NullHandler and PINSTAGE_LOG_LEVEL
from . import _memory as _memory  # (the old layout's names, likewise)
from . import _registry
from ._audit import Finding, HiddenSyncError, SyncReport, audit
from ._buffers import (
    CpuGpuBuffer,
    NonUvaBuffer,
    UvaBackedTensor,
    UvaBuffer,
    UvaBufferPool,
    set_default_max_concurrency,
)
from ._capabilities import Capabilities, capabilities, is_pin_memory_available, is_uva_available
from ._compat import async_copy_to_gpu, get_accelerator_view_from_cpu_tensor
from ._copies import async_tensor_h2d, h2d_many, np_to_pinned_tensor, synchronize
from ._cpu import CpuProvider, GenericProvider
from ._errors import (
    BusyError,
    CaptureError,
    DriverError,
    NotANumberError,
    PinstageError,
    UnavailableError,
    ValueOverflowError,
)
from ._staged import FusedStagedWriter, StagedWriteTensor
from ._state import host_memory_stats
from ._version import __version__ as __version__

# Who serves which device type. device=None means the first available of the defaults, in
# order: CUDA (and ROCm through torch.cuda; its module is imported on first use, so importing
# pinstage touches no driver), then the host. Every other type gets plain torch copies.
_registry.register_provider(
    "cuda", lambda: importlib.import_module("._cuda", __name__).provider(), default=True)
_registry.register_provider("cpu", CpuProvider, default=True)
_registry.set_fallback_provider(GenericProvider)

__all__ = [
    "BusyError",
    "Capabilities",
    "CaptureError",
    "CpuGpuBuffer",
    "DriverError",
    "Finding",
    "FusedStagedWriter",
    "HiddenSyncError",
    "NonUvaBuffer",
    "NotANumberError",
    "PIN_MEMORY",
    "PinstageError",
    "StagedWriteTensor",
    "SyncReport",
    "UnavailableError",
    "UvaBackedTensor",
    "UvaBuffer",
    "UvaBufferPool",
    "ValueOverflowError",
    "async_copy_to_gpu",
    "async_tensor_h2d",
    "audit",
    "capabilities",
    "get_accelerator_view_from_cpu_tensor",
    "h2d_many",
    "host_memory_stats",
    "is_pin_memory_available",
    "is_uva_available",
    "np_to_pinned_tensor",
    "set_default_max_concurrency",
    "synchronize",
]


PIN_MEMORY: bool  # for type checkers only: the value comes from __getattr__, when read


def __getattr__(name: str) -> Any:
    # vLLM's module-level PIN_MEMORY, evaluated when read (never at import).
    if name == "PIN_MEMORY":
        return is_pin_memory_available()
    raise AttributeError(f"module 'pinstage' has no attribute {name!r}")
