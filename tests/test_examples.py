"""The examples run as printed and check themselves against a reference."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
from types import ModuleType

import pytest
import torch

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_engine_inputs_example_on_cpu_target():
    summary = _load("engine_inputs").main(device="cpu", steps=120, verbose=False)
    assert summary["matches_reference"] and summary["tokens"] > 0
    assert summary["requests_added"] > 0 and summary["requests_removed"] > 0


@pytest.mark.parametrize("mode", ["eager", "lazy", "random"])
def test_engine_inputs_example_unmodified_under_simulated_cuda(mode):
    """The same engine code, written for "cuda" with torch.cuda events, runs unmodified on the
    simulated CUDA and matches its NumPy reference with no host stall inside pinstage."""
    from pinstage.testing import simulated_accelerator

    with simulated_accelerator(mode, seed=3) as sim:
        if not torch.cuda.is_available():
            pytest.skip("needs the simulated CUDA")
        summary = _load("engine_inputs").main(device="cuda", steps=60, verbose=False)
        assert summary["matches_reference"] and summary["tokens"] > 0
        assert sim.stats.host_stalls == 0


@pytest.mark.timeout(240)
def test_multi_process_example_under_torchrun():
    """examples/multi_process.py as engines scale out: torchrun, two ranks on gloo, each on
    its own device of a two-device simulated CUDA, with its own staging state."""
    import subprocess

    for _ in range(3):
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             "2", str(EXAMPLES / "multi_process.py"), "--simulate"],
            capture_output=True, text=True, timeout=200, cwd=EXAMPLES.parent)
        # Known, not fixed: a rank whose work and output were complete sometimes aborts in
        # C++ teardown at exit ('terminate called without an active exception', about 1 run
        # in 10 here, not seen without the simulator). Such a run is tried again; any other
        # failure fails the test at once.
        if proc.returncode == 0 or "terminate called without an active exception" not in (
                proc.stdout + proc.stderr) or proc.stdout.count("matches NumPy") != 2:
            break
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import re

    ranks = re.findall(r"rank (\d)/2 on (cuda:\d): checksum (\d+) matches NumPy; "
                       r"all-reduced (\d+); pinned staging reserved: (\d+) bytes for cuda:\d, "
                       r"0 bytes for cuda:\d \(the other devices in this process\)", proc.stdout)
    assert sorted((r[0], r[1]) for r in ranks) == [("0", "cuda:0"), ("1", "cuda:1")], proc.stdout
    assert {int(r[3]) for r in ranks} == {sum(int(r[2]) for r in ranks)}  # the all-reduce
    assert all(int(r[4]) > 0 for r in ranks)  # each rank staged on its own device


def _example(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(EXAMPLES / "engine_inputs.py"), *args],
                          capture_output=True, text=True, timeout=200, cwd=EXAMPLES.parent)


def test_engine_inputs_simulate_flag_runs_without_a_gpu():
    proc = _example("--simulate", "--steps", "15")
    assert proc.returncode == 0, proc.stderr
    assert "'matches_reference': True" in proc.stdout and "'device': 'cuda" in proc.stdout
    assert "simulated device work:" in proc.stdout and "'host_stalls': 0" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_engine_inputs_on_a_missing_device_is_one_line():
    proc = _example("--device", "cuda", "--steps", "2")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "device 'cuda' is not available" in lines[0]
    assert "--simulate" in lines[0]
