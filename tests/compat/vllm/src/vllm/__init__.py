"""pinstage compat shim, not vLLM code: the `vllm` package the vendored vLLM files and tests import.
Only the modules they need exist; see tests/compat/vllm/README.md."""
