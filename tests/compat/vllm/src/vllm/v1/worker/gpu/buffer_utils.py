"""pinstage compat shim, not vLLM code: vllm/v1/worker/gpu/buffer_utils.py: a thin re-export of
pinstage (the import change that ports vLLM's code onto it)."""

from pinstage import (  # noqa: F401
    FusedStagedWriter,
    StagedWriteTensor,
    UvaBackedTensor,
    UvaBuffer,
    UvaBufferPool,
    async_copy_to_gpu,
    async_tensor_h2d,
    get_accelerator_view_from_cpu_tensor,
    set_default_max_concurrency,
)
