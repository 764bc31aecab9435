"""pinstage compat shim, not vLLM code: vllm/utils/torch_utils.py.

The host-to-device helpers are pinstage's (the import change a port makes); the few other
definitions vLLM's tests use are vLLM's own, copied verbatim in _torch_utils_vllm.py."""

from pinstage import (  # noqa: F401
    PIN_MEMORY,
    async_tensor_h2d,
    get_accelerator_view_from_cpu_tensor,
    np_to_pinned_tensor,
)

from vllm.utils._torch_utils_vllm import (  # noqa: F401
    _current_stream_tls,
    _patched_set_stream,
    common_broadcastable_dtype,
    current_stream,
    is_lossless_cast,
    prev_set_stream,
)
