"""pinstage compat shim, not vLLM code: vllm.sampling_params (the fields states.py reads,
with vLLM's defaults)."""

from dataclasses import dataclass


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
