"""Code ported from vLLM runs under a default device (issue 19, item 1): vLLM's model loader
and tests call ``torch.set_default_device("cuda")`` or enter ``with torch.device(...)``, and
every tensor pinstage makes for its own use (the coherence probe included) names its device,
so nothing lands on the default device by accident."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pinstage
from pinstage.testing import simulated_accelerator


def _whole_api(device: torch.device) -> None:
    """One call of each entry point vLLM code uses, checked against plain values."""
    caps = pinstage.capabilities(device)
    assert caps.device.type == device.type
    t = pinstage.async_tensor_h2d([1, 2, 3], device=device, dtype=torch.int32)
    assert t.device.type == device.type and t.cpu().tolist() == [1, 2, 3]
    p = pinstage.np_to_pinned_tensor(np.arange(4, dtype=np.int64))
    assert p.device.type == "cpu" and p.tolist() == [0, 1, 2, 3]
    buf = pinstage.CpuGpuBuffer(4, dtype=torch.int32, device=device)
    assert buf.cpu.device.type == "cpu" and buf.gpu.device.type == device.type
    buf.np[:] = [4, 5, 6, 7]
    assert buf.copy_to_gpu().cpu().tolist() == [4, 5, 6, 7]
    pool = pinstage.UvaBufferPool(4, torch.int32, device=device)
    assert pool.copy_to_gpu(np.array([9, 8], np.int32)).cpu().tolist() == [9, 8]
    swt = pinstage.StagedWriteTensor((2, 3), torch.int32, device)
    swt.stage_write(1, 1, [5, 6])
    swt.apply_write()
    assert swt.gpu.device.type == device.type
    assert swt.gpu.cpu().tolist() == [[0, 0, 0], [0, 5, 6]]


@pytest.fixture
def default_device():
    """Sets torch's default device for one test and puts it back."""
    yield torch.set_default_device
    torch.set_default_device(None)


@pytest.mark.parametrize("how", ["set_default_device", "context"])
def test_whole_api_under_a_default_cuda_device_on_a_fresh_simulated_device(how, default_device):
    # a fresh simulator: pinstage's CUDA backend is new, so its first call runs the UVA
    # coherence probe, which once put its arange on the default device and failed
    for mode in ("eager", "lazy"):
        with simulated_accelerator(mode) as sim:
            if how == "context":
                with torch.device("cuda"):
                    _whole_api(sim.device)
            else:
                default_device("cuda")
                try:
                    _whole_api(sim.device)
                finally:
                    default_device(None)
            assert pinstage.capabilities(sim.device).uva


@pytest.mark.parametrize("target_name", ["cpu", "sim"])
def test_whole_api_under_a_default_meta_device(target_name, default_device):
    if target_name == "cpu":
        default_device("meta")
        _whole_api(torch.device("cpu"))
        return
    with simulated_accelerator() as sim:
        default_device("meta")
        try:
            _whole_api(sim.device)
        finally:
            default_device(None)
