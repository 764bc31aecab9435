"""vLLM's own files and tests, vendored verbatim under tests/compat/vllm/, run on pinstage on
the CPU target and under the simulator in every mode (issue 19): every test's outcome must be
the one tests/compat/vllm/expected.json records, and every expected failure must have a
reason there."""

from __future__ import annotations

import importlib.util
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

_RUN = os.path.join(os.path.dirname(__file__), "vllm", "run.py")
_spec = importlib.util.spec_from_file_location("pinstage_vllm_run", _RUN)
assert _spec is not None and _spec.loader is not None
run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run)


def test_compare_reports_regressions_new_passes_and_missing_tests():
    expected = {"outcomes": {"lazy": {"a::t1": "passed", "a::t2": "failed", "a::t3": "passed"}},
                "reasons": {}}
    got = {"a::t1": "failed", "a::t2": "passed", "a::t4": "passed"}
    problems = run.compare("lazy", got, expected)
    assert any("REGRESSION a::t1" in p for p in problems)
    assert any("a::t2 now passes" in p for p in problems)
    assert any("a::t3 did not run" in p for p in problems)
    assert any("new test a::t4" in p for p in problems)
    assert run.compare("lazy", dict(expected["outcomes"]["lazy"]), expected) == []


def test_every_expected_failure_has_a_reason():
    expected = run.load_expected()
    assert set(expected["outcomes"]) == set(run.MODES)
    assert [p for m in run.MODES for p in run.unexplained(m, expected)] == []
    # and the reasons name their category
    cats = ("not-provided", "by-design", "vllm-skew", "cpu-target")
    assert all(text.startswith(cats) for text in expected["reasons"].values())


@pytest.mark.timeout(400)
def test_vllm_tests_on_pinstage_match_expected_in_every_mode():
    expected = run.load_expected()
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(run.MODES, pool.map(run.run_mode, run.MODES)))
    problems = [p for m in run.MODES for p in run.compare(m, results[m], expected)]
    assert problems == [], "\n".join(problems)
    # the simulator modes run vLLM's real block tables through the Triton stand-ins
    for m in ("eager", "lazy", "random"):
        node = ("drivers/test_vendored_block_tables.py::"
                "test_v2_block_tables_gather_and_slot_mappings[12]")
        assert results[m][node] == "passed"


def test_vendored_vllm_files_are_unchanged():
    import hashlib
    import json

    here = os.path.dirname(_RUN)
    with open(os.path.join(here, "vendored.json")) as f:
        files = json.load(f)["files"]
    assert len(files) >= 8
    for rel, meta in files.items():
        with open(os.path.join(here, rel), "rb") as fh:
            data = fh.read()
        assert hashlib.sha256(data).hexdigest() == meta["sha256"], f"{rel} was edited"
        text = data.decode("utf-8")
        assert text.startswith("# SPDX-License-Identifier: Apache-2.0\n"), rel
        assert "Copyright contributors to the vLLM project" in text.splitlines()[1], rel
