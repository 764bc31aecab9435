"""pinstage compat shim, not vLLM code: vllm/v1/utils.py: CpuGpuBuffer is pinstage's."""

from pinstage import CpuGpuBuffer  # noqa: F401
