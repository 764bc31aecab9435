"""pinstage compat shim, not vLLM code: vllm/v1/worker/cpu/shm.py (imported for its side effects by
vLLM's test; nothing here is needed)."""
