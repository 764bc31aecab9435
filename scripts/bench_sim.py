"""The simulated CUDA's per-op cost (issue 17 item 5): small elementwise ops on CPU tensors and
on simulated cuda tensors (eager and lazy mode, race detector on), timed in the same run,
in interleaved rounds; prints the median microseconds per op and the ratio to the CPU op.

    python scripts/bench_sim.py [--rounds N] [--ops N] [--size N] [--clock cpu|wall] [--json]

Goal: at most 10x a plain CPU op in eager and lazy mode. Each timed round of simulated ops
ends with ``synchronize()`` inside the timing, so lazy mode's time is that of queuing an op
and running it (eager runs each op as it is queued).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from pinstage.testing import simulated_accelerator

MODES = ("eager", "lazy")


def _cases(device: Any, size: int) -> dict[str, Callable[[], Any]]:
    """Each case: one small op (the same call on either device)."""
    x = torch.arange(size, dtype=torch.float32, device=device)
    y = torch.ones(size, dtype=torch.float32, device=device)
    z = torch.empty(size, dtype=torch.float32, device=device)
    idx = torch.arange(0, size, 2, device=device)

    return {
        "add": lambda: x + y,
        "add_": lambda: x.add_(1),
        "mul": lambda: x.mul(y),
        "mul_": lambda: z.mul_(y),
        "copy_": lambda: z.copy_(y),
        "getitem_slice": lambda: x[1:5],
        "getitem_index": lambda: x[idx],
        "setitem": lambda: x.__setitem__(slice(0, 4), 2.0),
    }


_CLOCK = {"cpu": time.thread_time, "wall": time.perf_counter}
clock = _CLOCK["cpu"]


def _time(fn: Callable[[], Any], n: int, sync: Callable[[], Any] | None = None) -> float:
    """Seconds per call, ``sync()`` after the calls included, the garbage collector off
    while timing (as ``timeit``)."""
    gc.disable()
    try:
        t0 = clock()
        for _ in range(n):
            fn()
        if sync is not None:
            sync()
        return (clock() - t0) / n
    finally:
        gc.enable()


def run(rounds: int = 15, ops: int = 200, size: int = 16) -> dict[str, Any]:
    """``{"cases": {name: {"cpu_us", "eager_us", "lazy_us", "eager_ratio", "lazy_ratio"}},
    "geomean": {...}}`` (medians over ``rounds`` rounds of ``ops`` calls each)."""
    times: dict[str, dict[str, list[float]]] = {}
    cpu = _cases("cpu", size)
    for name in cpu:
        times[name] = {"cpu": [], **{mode: [] for mode in MODES}}
    for fn in cpu.values():
        _time(fn, 20)
    for _ in range(rounds):  # interleaved: plain CPU ops (no simulator open), then each mode
        for name, fn in cpu.items():
            times[name]["cpu"].append(_time(fn, ops))
        for mode in MODES:
            with simulated_accelerator(mode) as sim:
                dev = _cases(sim.device, size)
                for fn in dev.values():  # warm up (shape caches, the allocator's pools)
                    _time(fn, 5, sim.synchronize)
                for name, fn in dev.items():
                    times[name][mode].append(_time(fn, ops, sim.synchronize))
    cases: dict[str, dict[str, float]] = {}
    for name, t in times.items():
        row = {f"{k}_us": statistics.median(v) * 1e6 for k, v in t.items()}
        for mode in MODES:
            row[f"{mode}_ratio"] = row[f"{mode}_us"] / row["cpu_us"]
        cases[name] = row
    geomean = {f"{mode}_ratio": statistics.geometric_mean(
        [c[f"{mode}_ratio"] for c in cases.values()]) for mode in MODES}
    return {"size": size, "rounds": rounds, "ops_per_round": ops, "cases": cases,
            "clock": "cpu" if clock is time.thread_time else "wall",
            "geomean": geomean, "torch": torch.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--ops", type=int, default=200)
    ap.add_argument("--size", type=int, default=16, help="elements per tensor")
    ap.add_argument("--clock", choices=sorted(_CLOCK), default="cpu",
                    help="cpu: the thread's CPU time (default: on a shared machine wall time "
                    "also counts waiting for a core); wall: time.perf_counter")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    a = ap.parse_args()
    global clock
    clock = _CLOCK[a.clock]
    for flag in ("rounds", "ops", "size"):
        if getattr(a, flag) < 1:
            ap.error(f"--{flag} must be at least 1, got {getattr(a, flag)}")
    report = run(a.rounds, a.ops, a.size)
    if a.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{'op':<15}{'cpu us':>9}{'eager us':>10}{'lazy us':>10}{'eager x':>9}{'lazy x':>9}")
    for name, c in report["cases"].items():
        print(f"{name:<15}{c['cpu_us']:>9.2f}{c['eager_us']:>10.2f}{c['lazy_us']:>10.2f}"
              f"{c['eager_ratio']:>9.1f}{c['lazy_ratio']:>9.1f}")
    g = report["geomean"]
    print(f"{'geomean':<15}{'':>9}{'':>10}{'':>10}{g['eager_ratio']:>9.1f}{g['lazy_ratio']:>9.1f}")


if __name__ == "__main__":
    main()
