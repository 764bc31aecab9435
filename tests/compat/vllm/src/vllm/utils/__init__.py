"""pinstage compat shim, not vLLM code: package marker."""
