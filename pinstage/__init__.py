"""pinstage: move data from host memory to an accelerator without stalling the host by accident.

The names follow vLLM's host-to-device helpers so engine code ports by changing an import.
Importing pinstage does no device work and never initialises CUDA.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import _backend
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
from ._errors import PinstageError, ValueOverflowError
from ._memory import host_memory_stats
from ._staged import FusedStagedWriter, StagedWriteTensor

__version__ = "0.1.0"

# CUDA (and ROCm through torch.cuda) serves "cuda" devices; its module is imported on first use.
_backend.register_provider("cuda", lambda: importlib.import_module("._cuda", __name__))

__all__ = [
    "Capabilities",
    "CpuGpuBuffer",
    "Finding",
    "FusedStagedWriter",
    "HiddenSyncError",
    "NonUvaBuffer",
    "PIN_MEMORY",
    "PinstageError",
    "StagedWriteTensor",
    "SyncReport",
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


def __getattr__(name: str) -> Any:
    # vLLM's module-level PIN_MEMORY, evaluated when read (never at import).
    if name == "PIN_MEMORY":
        return is_pin_memory_available()
    raise AttributeError(f"module 'pinstage' has no attribute {name!r}")
