"""pinstage's drivers (not vLLM's tests) for vLLM's vendored gpu/states.py (Model Runner V2's
RequestState: per-request sampling parameters in CpuGpuBuffers, uploaded each step by
``Param.copy_np_to_gpu``), on the CPU target and the simulator in every mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pinstage.testing import HazardError

from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.v1.worker.gpu.states import RequestState


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _state() -> RequestState:
    return RequestState(max_num_reqs=8, max_model_len=64, max_num_batched_tokens=64,
                        vocab_size=1000, device=_device(), pin_memory=torch.cuda.is_available())


def test_request_state_sampling_metadata_over_engine_steps():
    rs = _state()
    rng = np.random.default_rng(3)
    params = {}
    for step in range(10):
        if len(params) < 6:
            rid = f"r{step}"
            sp = SamplingParams(temperature=float(rng.uniform(0.1, 2)),
                                top_p=float(rng.choice([1.0, 0.9])), top_k=int(rng.choice([0, 50])),
                                seed=step, logprobs=int(rng.choice([0, 5])) if step % 2 else None)
            lora = LoRARequest("l", 7) if step % 3 == 0 else None
            rs.add_request(rid, 4, [1, 2, 3, 4, 5], 2, sp, lora)
            params[rid] = (sp, lora)
        if step % 4 == 3:
            gone = sorted(params)[0]
            rs.remove_request(gone)
            del params[gone]
        rids = sorted(params)
        idx = np.array([rs.req_id_to_index[r] for r in rids], dtype=np.int32)
        pos = torch.zeros(len(rids), dtype=torch.int64, device=_device())
        md = rs.make_sampling_metadata(idx, pos)
        # the engine reads what the sampler produced each step: the host waits here
        assert md.temperature.cpu().tolist() == pytest.approx(
            [params[r][0].temperature for r in rids], rel=1e-6)
        assert md.seeds.cpu().tolist() == [params[r][0].seed for r in rids]
        top_k = [params[r][0].top_k or 1000 for r in rids]
        assert (md.top_k is None) == all(k == 1000 for k in top_k)
        if md.top_k is not None:
            assert md.top_k.cpu().tolist() == top_k
        logprobs = [params[r][0].logprobs for r in rids]
        want = max((lp for lp in logprobs if lp is not None), default=None)
        assert md.max_num_logprobs == want
        _, tokens, loras = rs.make_lora_inputs(rids, idx, np.ones(len(rids), np.int64))
        assert loras == {p[1] for p in params.values() if p[1] is not None}
        assert rs.num_computed_tokens.cpu()[idx].tolist() == [2] * len(rids)


def test_two_steps_without_a_host_wait_race_on_the_parameter_buffers(request):
    """``Param.copy_np_to_gpu`` rewrites the pinned buffer that the previous step's
    non-blocking copy reads. vLLM's engine waits for each step's output in between; without
    that wait the second step's host write races the first copy on a GPU. The simulator
    catches it deterministically where copies are queued (lazy), and says which."""
    mode = request.config.getoption("pinstage_simulate", default=None)
    if mode != "lazy":
        pytest.skip("the race is deterministic in lazy mode (eager runs copies at once)")
    rs = _state()
    rs.add_request("a", 1, [1], 0, SamplingParams(temperature=0.5, seed=1), None)
    rs.add_request("b", 1, [1], 0, SamplingParams(temperature=0.7, seed=2), None)
    a, b = rs.req_id_to_index["a"], rs.req_id_to_index["b"]
    pos = torch.zeros(2, dtype=torch.int64, device=_device())
    rs.make_sampling_metadata(np.array([a, b], np.int32), pos)
    with pytest.raises(HazardError, match="changed by the host"):
        rs.make_sampling_metadata(np.array([b, a], np.int32), pos)  # the next step, at once
        torch.accelerator.synchronize()
    for _ in range(8):  # each raced copy reports once: let the others report too
        try:
            torch.accelerator.synchronize()
            break
        except HazardError:
            continue
