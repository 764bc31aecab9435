"""Run vLLM's vendored tests (and pinstage's drivers for the vendored files) on pinstage: on
the CPU target and under ``--pinstage-simulate`` in each mode, one pytest process per mode,
and compare every test's outcome with expected.json.

    python tests/compat/vllm/run.py                 # all modes; exit 1 on any difference
    python tests/compat/vllm/run.py --mode lazy     # one mode (repeatable)
    python tests/compat/vllm/run.py --update        # write the outcomes to expected.json

A difference is a test that passed in expected.json and now does not (a regression), a test
that now passes where expected.json says it fails (update expected.json and its reason), or a
test that appeared or disappeared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
EXPECTED = os.path.join(HERE, "expected.json")
MODES = ("cpu", "eager", "lazy", "random")
SUITES = ("vllm_tests", "drivers")


def run_mode(mode: str, paths: list[str] | None = None, timeout: float = 600) -> dict[str, str]:
    """Each test's outcome (passed, failed, error, skipped) in ``mode``, by node id."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "outcomes.json")
        cmd = [sys.executable, "-m", "pytest", "-c", os.path.join(HERE, "pytest.ini"),
               "--rootdir", HERE, "-q", "-p", "no:randomly",
               *(paths or [os.path.join(HERE, s) for s in SUITES])]
        if mode != "cpu":
            cmd.append(f"--pinstage-simulate={mode}")
        env = dict(os.environ, PINSTAGE_VLLM_OUTCOMES=out)
        for name in ("PINSTAGE_PIN_MEMORY", "PINSTAGE_UVA", "PINSTAGE_STAGING_LIMIT"):
            env.pop(name, None)
        proc = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True,
                              timeout=timeout)
        if not os.path.exists(out):
            raise RuntimeError(f"pytest in mode {mode} recorded nothing (exit "
                               f"{proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)  # type: ignore[no-any-return]


def load_expected() -> dict:  # type: ignore[type-arg]
    with open(EXPECTED) as f:
        return json.load(f)  # type: ignore[no-any-return]


def compare(mode: str, got: dict[str, str], expected: dict, only: list[str] | None = None
            ) -> list[str]:  # type: ignore[type-arg]
    """The differences of ``got`` from expected.json in ``mode``, one line each (``only``:
    compare just these node ids)."""
    want = expected["outcomes"][mode]
    if only is not None:
        want = {k: v for k, v in want.items() if k in only}
        got = {k: v for k, v in got.items() if k in only}
    problems = []
    for node in sorted(set(want) | set(got)):
        w, g = want.get(node), got.get(node)
        if w == g:
            continue
        if w is None:
            problems.append(f"{mode}: new test {node} ({g}): add it to expected.json")
        elif g is None:
            problems.append(f"{mode}: {node} did not run (expected {w})")
        elif w == "passed":
            problems.append(f"{mode}: REGRESSION {node}: {g}, expected passed")
        elif g == "passed":
            problems.append(f"{mode}: {node} now passes (expected {w}): update expected.json")
        else:
            problems.append(f"{mode}: {node}: {g}, expected {w}")
    return problems


def reason_for(node: str, mode: str, expected: dict) -> str | None:  # type: ignore[type-arg]
    """expected.json's reason for ``node`` not passing in ``mode`` (keys are
    ``file.py::function @modes``, modes ``*`` or a comma list)."""
    base = node.split("[")[0]
    for key, text in expected.get("reasons", {}).items():
        where, _, modes = key.partition(" @")
        if base.endswith("/" + where) and (modes == "*" or mode in modes.split(",")):
            return text  # type: ignore[no-any-return]
    return None


def unexplained(mode: str, expected: dict) -> list[str]:  # type: ignore[type-arg]
    """Tests expected to fail or error in ``mode`` without a reason in expected.json."""
    return [f"{mode}: {node} is expected to {'fail' if v == 'failed' else v} but "
            "expected.json gives no reason" for node, v in expected["outcomes"][mode].items()
            if v in ("failed", "error") and reason_for(node, mode, expected) is None]


def summary(mode: str, got: dict[str, str]) -> str:
    counts = {k: sum(1 for v in got.values() if v == k)
              for k in ("passed", "failed", "error", "skipped")}
    vllm_only = {k: v for k, v in got.items() if k.startswith("vllm_tests/")}
    vp = sum(1 for v in vllm_only.values() if v == "passed")
    return (f"{mode:>6}: {counts['passed']} passed, {counts['failed']} failed, "
            f"{counts['error']} errors, {counts['skipped']} skipped "
            f"(vLLM's own tests: {vp} of {len(vllm_only)} passed)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", action="append", choices=MODES,
                    help="run only this mode (repeatable; default: all)")
    ap.add_argument("--update", action="store_true", help="write outcomes to expected.json")
    ap.add_argument("--jobs", type=int, default=2, help="modes run at once (default 2)")
    args = ap.parse_args(argv)
    modes = args.mode or list(MODES)
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = dict(zip(modes, pool.map(run_mode, modes)))
    for mode in modes:
        print(summary(mode, results[mode]))
    if args.update:
        expected = load_expected() if os.path.exists(EXPECTED) else {"outcomes": {}}
        expected.setdefault("reasons", {})
        for mode in modes:
            expected["outcomes"][mode] = dict(sorted(results[mode].items()))
        with open(EXPECTED, "w") as f:
            json.dump(expected, f, indent=1)
            f.write("\n")
        print(f"wrote {EXPECTED}")
        return 0
    expected = load_expected()
    problems = [p for mode in modes
                for p in compare(mode, results[mode], expected) + unexplained(mode, expected)]
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
