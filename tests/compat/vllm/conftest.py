"""Harness conftest (pinstage's, not vLLM's): puts the vllm package of src/ (vendored vLLM
files plus shims) on the path, registers the PyTorch stand-ins for its Triton kernels, puts
back what vLLM's tests change process-wide, and records each test's outcome for run.py."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "src"))
sys.path.insert(0, _HERE)

import standins  # noqa: E402

standins.register_all()

_outcomes: dict[str, str] = {}


@pytest.fixture(autouse=True)
def _restore_default_device():
    """vLLM's test_uva calls torch.set_default_device() and never puts it back."""
    yield
    torch.set_default_device(None)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    node = report.nodeid
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if report.skipped:
            _outcomes[node] = "skipped"
        elif report.passed:
            _outcomes[node] = "passed"
        else:
            _outcomes[node] = "failed" if report.when == "call" else "error"
    elif report.when == "teardown" and report.failed and _outcomes.get(node) == "passed":
        _outcomes[node] = "error"


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = os.environ.get("PINSTAGE_VLLM_OUTCOMES")
    if out:
        with open(out, "w") as f:
            json.dump(_outcomes, f, indent=1, sort_keys=True)
