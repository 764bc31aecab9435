"""A toy engine step on pinstage: per-request uploads plus block-table appends.

Runs on a GPU when there is one, else on the CPU target; `--simulate` runs it on the simulated
accelerator and prints what the device was asked to do.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

import pinstage
from pinstage.testing import simulated_accelerator


def step(device: torch.device, table: pinstage.StagedWriteTensor, rng: np.random.Generator,
         n: int = 256) -> tuple[torch.Tensor, ...]:
    seq_lens = rng.integers(1, 2048, n)
    query_start_loc = np.concatenate([[0], np.cumsum(rng.integers(1, 8, n))])
    idx_mapping = rng.permutation(n)
    uploads = pinstage.h2d_many([idx_mapping, query_start_loc, seq_lens], device,
                                dtype=torch.int32)  # one transfer
    for r in range(n):  # each request's new KV blocks
        table.stage_write(r, int(seq_lens[r] % 60), rng.integers(0, 1 << 20, 4).tolist())
    table.apply_write()  # one batch, bounds-checked when staged
    return uploads


def main() -> None:
    rng = np.random.default_rng(0)
    if "--simulate" in sys.argv:
        with simulated_accelerator("random", seed=1) as sim:
            table = pinstage.StagedWriteTensor((256, 64), torch.int32, sim.device)
            for _ in range(10):
                step(sim.device, table, rng)
            sim.synchronize()
            print("simulated device work:", sim.stats.as_dict())
        return
    caps = pinstage.capabilities()
    print("target:", caps.device, "| pinned:", caps.pin_memory, "| uva:", caps.uva)
    table = pinstage.StagedWriteTensor((256, 64), torch.int32, caps.device)
    with pinstage.audit() as report:
        for _ in range(10):
            step(caps.device, table, rng)
    pinstage.synchronize(caps.device)
    print(report.summary())
    print("pinned host memory:", pinstage.host_memory_stats())


if __name__ == "__main__":
    main()
