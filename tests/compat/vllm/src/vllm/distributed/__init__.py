"""pinstage compat shim, not vLLM code: vllm.distributed: no parallel groups (as in vLLM's unit
tests, where they are not initialized)."""


def get_dcp_group():  # type: ignore[no-untyped-def]
    raise AssertionError("decode context parallel group is not initialized")
