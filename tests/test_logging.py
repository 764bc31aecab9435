"""Fallbacks to a slower path are logged once per process and reason (logger ``pinstage``)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

import pinstage
from pinstage import _capabilities
from pinstage._device import Probe
from pinstage._state import device_state
from pinstage.testing import simulated_accelerator


@pytest.fixture(autouse=True)
def fresh_log(monkeypatch):
    """Each test starts as a new process would: nothing logged yet, no policy set."""
    for name in ("PINSTAGE_PIN_MEMORY", "PINSTAGE_UVA", "PINSTAGE_STAGING_LIMIT"):
        monkeypatch.delenv(name, raising=False)
    _capabilities._reset_after_fork()
    yield
    _capabilities._reset_after_fork()


def records(caplog):
    return [r for r in caplog.records if r.name == "pinstage"]


def test_no_pinned_memory_is_logged_once(caplog):
    caplog.set_level(logging.WARNING, logger="pinstage")
    for _ in range(3):
        with simulated_accelerator(pin_memory=False) as sim:
            pinstage.capabilities(sim.device)
            pinstage.async_tensor_h2d([1, 2, 3], sim.device, dtype=torch.int32)
            buf = pinstage.CpuGpuBuffer(4, dtype=torch.int32, device=sim.device)
            buf.copy_to_gpu()
    recs = records(caplog)
    assert len(recs) == 1, [r.getMessage() for r in recs]
    rec = recs[0]
    assert rec.levelno == logging.WARNING
    assert "pinned staging is off" in rec.getMessage() and "block the host" in rec.getMessage()


def test_same_reason_on_two_devices_and_in_every_mode_is_logged_once(caplog):
    caplog.set_level(logging.WARNING, logger="pinstage")
    for mode in ("eager", "lazy", "random"):
        with simulated_accelerator(mode, pin_memory=False, device_count=2):
            for i in range(2):
                pinstage.capabilities(f"cuda:{i}")
    assert len(records(caplog)) == 1, [r.getMessage() for r in records(caplog)]


def test_no_uva_is_logged_once(caplog):
    caplog.set_level(logging.WARNING, logger="pinstage")
    for _ in range(3):
        with simulated_accelerator(uva=False) as sim:
            pool = pinstage.UvaBufferPool((16,), torch.int32, device=sim.device)
            pool.copy_to_uva([1, 2, 3])
            pinstage.capabilities(sim.device)
    recs = records(caplog)
    assert len(recs) == 1, [r.getMessage() for r in recs]
    assert "UVA is off" in recs[0].getMessage() and "NonUvaBuffer" in recs[0].getMessage()


def test_each_reason_once(caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="pinstage")
    for _ in range(2):
        with simulated_accelerator(pin_memory=False) as sim:
            pinstage.capabilities(sim.device)
        with simulated_accelerator(uva=False) as sim:
            pinstage.capabilities(sim.device)
        monkeypatch.setenv("PINSTAGE_PIN_MEMORY", "0")
        with simulated_accelerator() as sim:
            pinstage.capabilities(sim.device)
        monkeypatch.delenv("PINSTAGE_PIN_MEMORY")
    msgs = [r.getMessage() for r in records(caplog)]
    assert len(msgs) == 3, msgs
    assert sum("PINSTAGE_PIN_MEMORY=0" in m for m in msgs) == 1


def test_full_speed_and_cpu_target_log_nothing(caplog):
    caplog.set_level(logging.DEBUG, logger="pinstage")
    with simulated_accelerator() as sim:
        pinstage.async_tensor_h2d([1, 2, 3], sim.device, dtype=torch.int32)
    pinstage.async_tensor_h2d([1, 2, 3], "cpu", dtype=torch.int32)
    pinstage.capabilities("cpu")
    assert records(caplog) == []


def test_platform_staging_cap_is_logged_once(caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="pinstage")
    for _ in range(2):
        with simulated_accelerator() as sim:
            state = device_state(sim.backend)
            probe = state.probe()
            capped = Probe(probe.accelerator, probe.can_pin, probe.uva,
                           (*probe.reasons, "running under WSL kernel 5.15: capped"), 64 << 20)
            monkeypatch.setattr(state, "probe", lambda capped=capped: capped)
            caps = pinstage.capabilities(sim.device)
            assert caps.staging_limit == 64 << 20
    msgs = [r.getMessage() for r in records(caplog)]
    assert len(msgs) == 1 and "capped at 64 MiB" in msgs[0], msgs
    # a limit the user chose is not a fallback
    _capabilities._reset_after_fork()
    caplog.clear()
    monkeypatch.setenv("PINSTAGE_STAGING_LIMIT", "32MiB")
    with simulated_accelerator() as sim:
        state = device_state(sim.backend)
        probe = state.probe()
        monkeypatch.setattr(state, "probe", lambda: Probe(
            probe.accelerator, probe.can_pin, probe.uva, probe.reasons, 64 << 20))
        pinstage.capabilities(sim.device)
    assert records(caplog) == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_logs_again():
    code = (
        "import logging, os, sys\n"
        "logging.basicConfig(format='%(name)s %(message)s')\n"
        "import pinstage\n"
        "from pinstage.testing import simulated_accelerator\n"
        "with simulated_accelerator(pin_memory=False) as sim:\n"
        "    pinstage.capabilities(sim.device)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    with simulated_accelerator(pin_memory=False) as sim:\n"
        "        pinstage.capabilities(sim.device)\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("pinned staging is off") == 2, proc.stderr
