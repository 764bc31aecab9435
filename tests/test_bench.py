"""The benchmark suite's report (cases, skips, goals) and scripts/gpu-check, on the CPU.

Performance goals are measured and reported, never asserted here: these tests check that each
goal is named with a value and pass/fail, or "not run" with a reason."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from pinstage import bench

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_CHECK = os.path.join(HERE, "scripts", "gpu-check")


def _report_module():
    spec = importlib.util.spec_from_file_location(
        "gpu_check_report", os.path.join(HERE, "scripts", "gpu_check_report.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def check_goal_shape(name, goal):
    assert goal["status"] in ("pass", "fail", "not run"), (name, goal)
    assert goal.get("goal") or goal["status"] == "not run", name
    if goal["status"] == "not run":
        assert isinstance(goal["reason"], str) and goal["reason"], name
    else:
        assert isinstance(goal["value"], (int, float)), name
        assert isinstance(goal["limit"], (int, float)) and goal["compare"] in ("<=", ">="), name


def test_unknown_case_names_the_valid_ones():
    with pytest.raises(ValueError, match="unknown case 'nope'; valid cases: list_upload_256"):
        bench.run_suite(quick=True, only=["nope"])


def test_meta_cannot_be_benchmarked():
    with pytest.raises(ValueError, match="meta tensors hold no data"):
        bench.resolve_target("meta")


def test_cpu_suite_reports_overlap_and_stage_write_goals():
    report = bench.run_suite(quick=True, device="cpu",
                             only=["staged_writes_overlap", "stage_write_call", "uva_gather"])
    assert report["target"] == "cpu" and report["interrupted"] is False
    cases = {c["name"]: c for c in report["cases"]}
    assert set(cases) == {"staged_writes_overlap", "stage_write_call"}
    over = cases["staged_writes_overlap"]
    assert over["overlap_vs_disjoint"] == pytest.approx(
        over["pinstage_us"] / over["pinstage_disjoint_us"])
    assert "struct.pack" in cases["stage_write_call"]["what"]
    assert cases["stage_write_call"]["baseline_floor"] == "struct.pack"
    # the packing stage_write leaves to apply_write is timed too, never hidden
    assert cases["stage_write_call"]["stage_and_apply_us"] > cases["stage_write_call"][
        "pinstage_us"] > 0
    assert over["baseline_floor"] is None
    for c in cases.values():
        assert c["speedup"] == pytest.approx(c["baseline_us"] / c["pinstage_us"])
        assert c["pinstage_host_stalls"] == 0
    assert report["skipped"] == [{"name": "uva_gather", "what": bench.CASES[-1].what,
                                  "reason": "needs an accelerator; the target is the CPU"}]
    goals = report["goals"]
    for name, goal in goals.items():
        check_goal_shape(name, goal)
    for name in ("staged_writes_overlap_le_1_3x_disjoint", "stage_write_call_le_2x_struct_pack"):
        assert goals[name]["status"] in ("pass", "fail")
    for name in ("pageable_ge_75pct_of_pinned_bandwidth", "large_pinned_ge_90pct_of_bare",
                 "small_copy_1k_host_us", "small_cases_0_host_stalls",
                 "pinned_rss_le_1_05x_requested"):
        assert goals[name]["status"] == "not run"
    assert "not selected" in goals["pageable_ge_75pct_of_pinned_bandwidth"]["reason"]
    json.dumps(report)  # JSON-able


def test_gpu_cases_are_skipped_with_a_reason_on_the_cpu():
    report = bench.run_suite(quick=True, device="cpu", only=["small_copy_1k",
                                                           "large_pinned_256m"])
    assert report["cases"] == []
    assert {s["name"] for s in report["skipped"]} == {"small_copy_1k", "large_pinned_256m"}
    reason = report["goals"]["large_pinned_ge_90pct_of_bare"]["reason"]
    assert reason == "large_pinned_256m: needs an accelerator; the target is the CPU"


def _fake_case(name, pinstage_us, baseline_us, **extra):
    return {"name": name, "pinstage_us": pinstage_us, "baseline_us": baseline_us,
            "speedup": baseline_us / pinstage_us, "pinstage_host_stalls": 0, **extra}


def fake_gpu_report():
    big = 256 * 2**20
    cases = [
        _fake_case("list_upload_256", 5.0, 20.0),
        _fake_case("small_copy_1k", 6.0, 9.0, bare_pinned_copy_us=4.0),
        _fake_case("large_pinned_256m", 5.5, 5.0, pinstage_gbps=big / 5.5e3,
                   baseline_gbps=big / 5e3),
        _fake_case("large_pageable_256m", 6.0, 30.0, pinstage_gbps=big / 6e3,
                   baseline_gbps=big / 30e3, bare_pinned_copy_us=5.0,
                   bare_pinned_copy_gbps=big / 5e3, pinstage_vs_bare_pinned=5.0 / 6.0),
    ]
    cases[0]["pinstage_host_stalls"] = 2
    return {"target": "cuda:0", "capabilities": {"accelerator": True, "pin_memory": True},
            "cases": cases, "skipped": [], "interrupted": False,
            "pinned_memory": {"ratio": 1.01}}


def test_goals_from_gpu_numbers():
    goals = bench.goals(fake_gpu_report())
    for name, goal in goals.items():
        check_goal_shape(name, goal)
    assert goals["pageable_ge_75pct_of_pinned_bandwidth"]["status"] == "pass"
    assert goals["pageable_ge_75pct_of_pinned_bandwidth"]["value"] == pytest.approx(0.8333,
                                                                                    abs=1e-4)
    assert goals["large_pinned_ge_90pct_of_bare"]["status"] == "pass"  # 5.0 / 5.5 = 0.909
    assert goals["small_copy_1k_host_us"]["value"] == 6.0
    assert goals["small_copy_1k_host_us"]["bare_pinned_copy_us"] == 4.0
    assert goals["small_copy_1k_host_us"]["status"] == "pass"
    assert goals["small_cases_0_host_stalls"]["status"] == "fail"  # 2 stalls in list_upload
    assert goals["pinned_rss_le_1_05x_requested"]["status"] == "pass"
    assert goals["staged_writes_overlap_le_1_3x_disjoint"]["status"] == "not run"


def test_interrupted_suite_keeps_finished_cases(monkeypatch):
    first = next(c for c in bench.CASES if c.name == "ndarray_upload_4k")

    def interrupted(device):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "CASES", [first, bench.Case("explodes", "Ctrl-C", interrupted)])
    seen = []
    report = bench.run_suite(quick=True, device="cpu", on_result=seen.append)
    assert report["interrupted"] is True
    assert [c["name"] for c in report["cases"]] == ["ndarray_upload_4k"] == [
        c["name"] for c in seen]
    assert report["simulator"] is None
    assert "interrupted" in report["goals"]["stage_write_call_le_2x_struct_pack"]["reason"]


def _write_pieces(outdir, bench_report, failures=0, skipped=0):
    with open(os.path.join(outdir, "bench.json"), "w") as f:
        json.dump({**bench_report, "goals": bench.goals(bench_report)}, f)
    with open(os.path.join(outdir, "doctor.json"), "w") as f:
        json.dump({"capabilities": {"device": "cuda:0", "accelerator": True}}, f)
    cases = "".join(f'<testcase name="t{i}"><failure message="x"/></testcase>'
                    for i in range(failures))
    cases += "".join(f'<testcase name="s{i}"><skipped message="x"/></testcase>'
                     for i in range(skipped))
    cases += '<testcase name="ok"/>'
    with open(os.path.join(outdir, "gpu-tests.xml"), "w") as f:
        f.write(f'<testsuites><testsuite tests="{failures + skipped + 1}" '
                f'failures="{failures}" errors="0" skipped="{skipped}">{cases}</testsuite>'
                "</testsuites>")


def test_gpu_check_report_from_fake_pieces(tmp_path):
    mod = _report_module()
    _write_pieces(str(tmp_path), fake_gpu_report(), failures=1)
    report = mod.gpu_check_report(str(tmp_path), {"tests": 1, "doctor": 0, "bench": 0}, 3.0)
    goals = report["goals"]
    assert set(goals) == {*mod.GPU_GOALS, "gpu_tests_pass"}
    assert set(mod.GPU_GOALS) <= set(bench.goals(fake_gpu_report()))
    assert goals["gpu_tests_pass"]["status"] == "fail" and goals["gpu_tests_pass"]["failed"] == 1
    assert goals["pageable_ge_75pct_of_pinned_bandwidth"]["status"] == "pass"
    assert goals["small_cases_0_host_stalls"]["status"] == "fail"
    assert report["gpu"] == "cuda:0" and report["summary"]["pass"] == 4
    assert "staged_writes_overlap_le_1_3x_disjoint" in report["other_goals"]
    json.dumps(report)


def test_gpu_check_report_when_the_bench_crashed(tmp_path):
    mod = _report_module()
    report = mod.gpu_check_report(str(tmp_path), {"tests": 0, "doctor": 1, "bench": 1})
    for name in mod.GPU_GOALS:
        assert report["goals"][name]["status"] == "not run"
        assert "bench.json unreadable" in report["goals"][name]["reason"]
    assert report["goals"]["gpu_tests_pass"]["status"] == "not run"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU, run scripts/gpu-check itself")
def test_gpu_check_runs_on_a_cpu_machine(tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run([GPU_CHECK, "--quick", str(out)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    mod = _report_module()
    for name in (*mod.GPU_GOALS, "gpu_tests_pass"):
        goal = report["goals"][name]
        assert goal["status"] == "not run" and goal["reason"], name
    assert "skipped (no GPU)" in report["goals"]["gpu_tests_pass"]["reason"]
    assert report["bench"]["target"] == "cpu"
    assert report["returncodes"] == {"tests": 0, "doctor": 0, "bench": 0}
    for piece in ("bench.json", "doctor.json", "gpu-tests.xml", "bench.log"):
        assert (tmp_path / piece).exists(), piece


def test_gpu_cases_run_on_the_simulated_cuda(monkeypatch):
    """The accelerator cases, their checks and the pinned-memory measure run (timings on the
    simulator mean nothing; only that the code paths work and the goals get values)."""
    from pinstage.testing import simulated_accelerator

    monkeypatch.setattr(bench, "_LARGE", 2**20)
    monkeypatch.setattr(bench, "_UVA_ROWS", 1024)
    gpu_cases = [c.name for c in bench.CASES if c.gpu_only]
    with simulated_accelerator("random", seed=1) as sim:
        report = bench.run_suite(quick=True, device=sim.device,
                                 only=[*gpu_cases, "list_upload_256"])
    assert report["target"] == "cuda:0" and report["skipped"] == []
    assert [c["name"] for c in report["cases"]] == ["list_upload_256", *gpu_cases]
    assert report["simulator"] is None  # one simulator at a time: the target is one
    assert 1.0 <= report["pinned_memory"]["ratio"] < 1.05
    cases = {c["name"]: c for c in report["cases"]}
    assert cases["large_pageable_256m"]["bare_pinned_copy_us"] > 0
    assert cases["small_copy_1k"]["bare_pinned_copy_us"] > 0
    goals = report["goals"]
    for name in ("pageable_ge_75pct_of_pinned_bandwidth", "large_pinned_ge_90pct_of_bare",
                 "small_copy_1k_host_us", "small_cases_0_host_stalls",
                 "pinned_rss_le_1_05x_requested"):
        check_goal_shape(name, goals[name])
        assert goals[name]["status"] in ("pass", "fail"), name
    assert goals["small_cases_0_host_stalls"]["value"] == 0
