"""pinstage compat shim, not vLLM code: vllm/v1/attention/backends/utils.py (the constant used
here)."""

PAD_SLOT_ID = -1
