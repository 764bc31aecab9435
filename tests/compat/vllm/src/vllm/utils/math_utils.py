"""pinstage compat shim, not vLLM code: vllm/utils/math_utils.py (the one helper used here)."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(a // -b)
