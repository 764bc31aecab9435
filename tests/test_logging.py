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


# -- issue 16: the library logging convention -------------------------------------------------

FALLBACK = (
    "import pinstage\n"
    "from pinstage.testing import simulated_accelerator\n"
    "with simulated_accelerator(pin_memory=False) as sim:\n"
    "    pinstage.capabilities(sim.device)\n"
    "    pinstage.capabilities(sim.device)\n"
    "print('done')\n"
)


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PINSTAGE_")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**clean, **env})


def test_the_pinstage_logger_has_a_null_handler():
    log = logging.getLogger("pinstage")
    assert any(isinstance(h, logging.NullHandler) for h in log.handlers)
    proc = _python("import logging, pinstage\n"
                   "print([type(h).__name__ for h in logging.getLogger('pinstage').handlers])")
    assert proc.stdout.strip() == "['NullHandler']", proc.stdout + proc.stderr


def test_unconfigured_fallback_is_one_prefixed_line():
    """Nothing configured: the fallback is printed once, as ``pinstage: warning: ...`` (not a
    bare message from logging's last-resort handler)."""
    proc = _python(FALLBACK)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("pinstage: warning: pinned staging is off for cuda:0")


def test_configured_logging_gets_the_record_and_no_extra_line():
    proc = _python("import logging\nlogging.basicConfig(format='LOG %(name)s %(levelname)s "
                   "%(message)s')\n" + FALLBACK)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("LOG pinstage WARNING pinned staging is off")


@pytest.mark.parametrize("value,printed", [("error", False), ("ERROR", False), ("40", False),
                                           ("warning", True), ("debug", True)])
def test_log_level_variable(value, printed):
    proc = _python(FALLBACK + "import logging\n"
                   "print(logging.getLevelName(logging.getLogger('pinstage').level))\n",
                   PINSTAGE_LOG_LEVEL=value)
    assert proc.returncode == 0, proc.stderr
    assert ("pinstage: warning:" in proc.stderr) == printed, proc.stderr
    expected = value.upper() if not value.isdigit() else logging.getLevelName(int(value))
    assert proc.stdout.split()[-1] == expected


def test_an_invalid_log_level_never_breaks_import_and_is_said_once():
    proc = _python(FALLBACK, PINSTAGE_LOG_LEVEL="loud")
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("pinstage: warning: PINSTAGE_LOG_LEVEL='loud' is not a valid "
                               "setting") and lines[0].endswith("ignored"), lines
    assert len(lines) == 2 and "pinned staging is off" in lines[1]
    from pinstage import _logging

    with pytest.raises(ValueError, match="DEBUG, INFO, WARNING, ERROR, CRITICAL"):
        os.environ["PINSTAGE_LOG_LEVEL"] = "loud"
        try:
            _logging.level_from_env()
        finally:
            del os.environ["PINSTAGE_LOG_LEVEL"]


def test_configured_ignores_null_handlers(monkeypatch):
    from pinstage import _logging

    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.setattr(logging.getLogger("pinstage"), "handlers", [logging.NullHandler()])
    assert not _logging.configured()
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.StreamHandler()])
    assert _logging.configured()
