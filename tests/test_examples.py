"""The examples run as printed and check themselves against a reference."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

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
