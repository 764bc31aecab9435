"""pinstage compat shim, not vLLM code: vllm.v1.outputs (a type states.py names)."""


class LogprobsTensors:
    pass
