"""pinstage compat shim, not vLLM code: vllm/utils/platform_utils.py: pinstage's answers."""

from pinstage import is_pin_memory_available, is_uva_available  # noqa: F401
