"""Long-run check (issue 20): an engine step loop on the CPU target (default 200,000 steps)
and on the simulated CUDA in lazy mode (default 20,000 steps); prints RSS and
``host_memory_stats()`` at intervals so their flatness can be read off.

    python scripts/long_run.py [--cpu-steps N] [--sim-steps N]
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import time

import numpy as np
import torch

import pinstage
from pinstage.testing import simulated_accelerator


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _loop(device: torch.device, steps: int, sync) -> list[dict[str, float]]:
    rng = np.random.default_rng(0)
    table = pinstage.StagedWriteTensor((256, 64), torch.int32, device)
    buf = pinstage.CpuGpuBuffer(512, dtype=torch.int64, device=device)
    pool = pinstage.UvaBufferPool((128,), torch.int32, max_concurrency=2, device=device)
    marks = []
    every = max(steps // 10, 1)
    for step in range(steps):
        n = int(rng.integers(1, 64))
        pinstage.async_tensor_h2d(list(range(n)), device)
        pinstage.h2d_many([np.arange(n), [step % 7, 1]], device)
        sync()  # (the previous step's copy_to_gpu reads buf: wait before rewriting it)
        buf.np[:n] = step
        buf.copy_to_gpu(n)
        pool.copy_to_uva(np.arange(n, dtype=np.int32))
        table.stage_write(step % 256, 0, [step % 1000] * 8)
        table.apply_write()
        if step % 64 == 0:
            sync()
        if step % every == 0 or step == steps - 1:
            gc.collect()
            sync()
            s = pinstage.host_memory_stats()
            marks.append({"step": step, "rss_mib": round(_rss_mib(), 1),
                          "reserved_bytes": s["reserved_bytes"], "in_use_bytes": s["in_use_bytes"]})
    return marks


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-steps", type=int, default=200_000)
    ap.add_argument("--sim-steps", type=int, default=20_000)
    args = ap.parse_args()
    out = {}
    t0 = time.perf_counter()
    out["cpu"] = _loop(torch.device("cpu"), args.cpu_steps, lambda: None)
    out["cpu_s"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    with simulated_accelerator("lazy") as sim:
        out["sim_lazy"] = _loop(sim.device, args.sim_steps, sim.synchronize)
    out["sim_lazy_s"] = round(time.perf_counter() - t0, 1)
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
