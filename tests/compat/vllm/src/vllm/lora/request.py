"""pinstage compat shim, not vLLM code: vllm.lora.request (the field states.py reads)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
