"""pinstage compat shim, not vLLM code: vllm/v1/worker/cpu/buffer_utils.py: pinstage's (its CPU
target does what vLLM's CPU worker variants do)."""

from pinstage import FusedStagedWriter, StagedWriteTensor  # noqa: F401
