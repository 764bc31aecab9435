"""The report of ``scripts/gpu-check``, built from the pieces it wrote (standard library only,
so a report is written even where torch or pinstage cannot be imported).

    python scripts/gpu_check_report.py OUTDIR REPORT.json TESTS_RC DOCTOR_RC BENCH_RC START
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

GPU_GOALS = ("pageable_ge_75pct_of_pinned_bandwidth", "large_pinned_ge_90pct_of_bare",
             "small_cases_0_host_stalls", "pinned_rss_le_1_05x_requested",
             "small_copy_1k_host_us")


def _load_json(path: str) -> tuple[dict[str, Any] | None, str | None]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        return None, f"{os.path.basename(path)} unreadable: {exc}"
    return (data, None) if isinstance(data, dict) else (None, f"{path}: not a JSON object")


def _junit(path: str) -> dict[str, Any]:
    """Counts and per-test outcomes from pytest's ``--junitxml`` file."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        return {"error": f"{os.path.basename(path)} unreadable: {exc}"}
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {"error": f"{os.path.basename(path)} has no testsuite"}
    out: dict[str, Any] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors",
                                                              "skipped")}
    out["cases"] = [
        {"name": c.get("name"),
         "outcome": ("failed" if c.find("failure") is not None or c.find("error") is not None
                     else "skipped" if c.find("skipped") is not None else "passed")}
        for c in suite.iter("testcase")]
    return out


def gpu_check_report(outdir: str, returncodes: dict[str, int],
                     seconds: float | None = None) -> dict[str, Any]:
    """The report of ``scripts/gpu-check`` from the pieces it wrote in ``outdir``
    (``gpu-tests.xml``, ``doctor.json``, ``bench.json``): every GPU goal with its measured
    value and pass/fail, or ``not run`` with the reason; the other goals of the bench."""
    tests = _junit(os.path.join(outdir, "gpu-tests.xml"))
    tests["returncode"] = returncodes.get("tests")
    doctor, doctor_err = _load_json(os.path.join(outdir, "doctor.json"))
    bench_report, bench_err = _load_json(os.path.join(outdir, "bench.json"))
    if bench_report is not None and returncodes.get("bench", 0) != 0:
        bench_err = (f"pinstage bench exited with status {returncodes['bench']} "
                     "(see bench.log)")
    all_goals = (bench_report or {}).get("goals") or {}
    gpu_goals: dict[str, Any] = {}
    for name in GPU_GOALS:
        if bench_err is not None or name not in all_goals:
            gpu_goals[name] = {"status": "not run",
                               "reason": bench_err or "the bench report does not name it"}
        else:
            gpu_goals[name] = all_goals[name]
    ran = tests.get("tests", 0) - tests.get("skipped", 0)
    if "error" in tests or tests["returncode"] not in (0, 5):
        status = "fail" if "error" not in tests else "not run"
        gpu_goals["gpu_tests_pass"] = {"goal": "every gpu-marked test passes", "status": status,
                                       "reason": tests.get("error", "see gpu-tests.log"),
                                       "failed": tests.get("failures", 0) + tests.get("errors", 0)}
    elif ran == 0:
        gpu_goals["gpu_tests_pass"] = {"goal": "every gpu-marked test passes",
                                       "status": "not run",
                                       "reason": f"all {tests.get('tests', 0)} gpu tests were "
                                                 "skipped (no GPU)"}
    else:
        gpu_goals["gpu_tests_pass"] = {"goal": "every gpu-marked test passes", "status": "pass",
                                       "value": ran}
    caps = (doctor or {}).get("capabilities", {})
    return {
        "gpu": caps.get("device") if caps.get("accelerator") else None,
        "device_name": (bench_report or {}).get("device_name"),
        "goals": gpu_goals,
        "other_goals": {k: v for k, v in all_goals.items() if k not in gpu_goals},
        "summary": {s: sum(g["status"] == s for g in gpu_goals.values())
                    for s in ("pass", "fail", "not run")},
        "tests": tests,
        "doctor": doctor if doctor is not None else {"error": doctor_err},
        "bench": bench_report if bench_report is not None else {"error": bench_err},
        "returncodes": returncodes,
        "seconds": None if seconds is None else round(seconds, 1),
    }


def main(argv: list[str]) -> int:
    """Write the report and print one line per GPU goal."""
    outdir, out, t_rc, d_rc, b_rc, start = argv
    rcs = {"tests": int(t_rc), "doctor": int(d_rc), "bench": int(b_rc)}
    report = gpu_check_report(outdir, rcs, time.time() - float(start))
    with open(out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    for name, g in report["goals"].items():
        shown = g.get("reason") if g["status"] == "not run" else g.get("value")
        print(f"{g['status']:>8}  {name}: {shown}")
    print(f"gpu-check: {report['summary']} in {report['seconds']} s; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
