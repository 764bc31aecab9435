"""The simulated accelerator: modes, stats, garbage, and the hazards it must catch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pinstage
from pinstage.testing import HazardError, simulated_accelerator


def test_modes_run_work_when_expected():
    with simulated_accelerator("eager") as sim:
        pinstage.async_tensor_h2d([1, 2], sim.device)
        assert sim.pending == 0
    with simulated_accelerator("lazy") as sim:
        pinstage.async_tensor_h2d([1, 2], sim.device)
        assert sim.pending == 1
        sim.synchronize()
        assert sim.pending == 0


def test_random_mode_is_seeded():
    def trace(seed):
        with simulated_accelerator("random", seed=seed) as sim:
            pend = []
            for i in range(30):
                pinstage.async_tensor_h2d([i], sim.device)
                pend.append(sim.pending)
            return pend

    assert trace(5) == trace(5)
    assert any(trace(5) != trace(s) for s in range(6, 12))


def test_pinstage_destinations_hold_garbage_until_copied():
    with simulated_accelerator("lazy", seed=1) as sim:
        out = pinstage.async_tensor_h2d(np.zeros(64, np.int32), sim.device)
        assert out.abs().sum() != 0  # not yet copied: garbage
        sim.synchronize()
        assert out.abs().sum() == 0


def test_existing_destination_keeps_old_values_until_copy_runs():
    with simulated_accelerator("lazy") as sim:
        out = pinstage.async_tensor_h2d([1, 1], sim.device)
        sim.synchronize()
        pinstage.async_tensor_h2d([2, 2], out=out)
        assert out.tolist() == [1, 1]
        sim.synchronize()
        assert out.tolist() == [2, 2]


@pytest.mark.parametrize("mode", ["lazy", "random"])
def test_pinned_source_changed_before_copy_raises_naming_source(mode):
    caught = 0
    for seed in range(10):
        try:
            with simulated_accelerator(mode, seed=seed) as sim:
                src = pinstage.np_to_pinned_tensor(np.arange(4))
                pinstage.async_tensor_h2d(src, sim.device)  # read in place, asynchronously
                src[0] = 100
        except HazardError as exc:
            assert "async_tensor_h2d" in str(exc) and "source" in str(exc)
            caught += 1
    assert caught == 10 if mode == "lazy" else caught >= 1


def test_hazard_raises_at_context_exit_at_the_latest():
    with pytest.raises(HazardError):
        with simulated_accelerator("lazy") as sim:
            buf = pinstage.CpuGpuBuffer(3, dtype=torch.int32, device=sim.device)
            buf.copy_to_gpu()
            buf.np[1] = 9


def test_eager_mode_never_sees_hazards():
    with simulated_accelerator("eager") as sim:
        buf = pinstage.CpuGpuBuffer(3, dtype=torch.int32, device=sim.device)
        buf.copy_to_gpu()
        buf.np[1] = 9  # copy already ran


def test_stats_count_copies_launches_and_stalls():
    with simulated_accelerator("lazy") as sim:
        pinstage.async_tensor_h2d([1], sim.device)
        sim.launch(lambda: None)
        assert (sim.stats.copies, sim.stats.launches, sim.stats.host_stalls) == (1, 1, 0)
        sim.synchronize()
        assert sim.stats.host_stalls == 0  # explicit synchronize is not a stall
    with simulated_accelerator("lazy", pin_memory=False) as sim:
        pinstage.async_tensor_h2d([1], sim.device)
        assert sim.stats.host_stalls == 1  # pageable copies block


def test_capabilities_inside_simulator():
    with simulated_accelerator(pin_memory=True, uva=False) as sim:
        caps = pinstage.capabilities()
        assert caps.accelerator and caps.can_pin and caps.pin_memory and not caps.uva
        assert caps.device == sim.device
        assert pinstage.capabilities(sim.device) == caps
    with simulated_accelerator(pin_memory=False, uva=True):
        caps = pinstage.capabilities()
        assert not caps.can_pin and not caps.pin_memory and not caps.uva


def test_d2h_into_pinned_is_queued():
    with simulated_accelerator("lazy") as sim:
        buf = pinstage.CpuGpuBuffer(2, dtype=torch.int64, device=sim.device)
        buf.gpu.fill_(5)
        out = buf.copy_to_cpu()
        assert out.tolist() == [0, 0]
        sim.synchronize()
        assert out.tolist() == [5, 5]


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        with simulated_accelerator("sometimes"):
            pass
    with pytest.raises(TypeError):
        with simulated_accelerator(seed="1"):
            pass
