"""Scale-out as engines do it: one process per device.

Run with ``torchrun --standalone --nproc-per-node 2 examples/multi_process.py``. Each rank
uses ``cuda:<rank>``: a real GPU where there is one, else device ``<rank>`` of a simulated
CUDA with as many devices as ranks (``--simulate`` forces that). Per rank: a few steps of
uploads (``h2d_many``) and staged block-table writes, checked against NumPy; then a checksum
all-reduced over ``gloo`` (CPU tensors, so it needs no NCCL). Each device has its own pinned
staging state, shown by ``host_memory_stats(device)``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist

import pinstage


def rank_work(rank: int, device: torch.device, steps: int = 8) -> int:
    """This rank's uploads and staged writes; returns their checksum (checked against NumPy)."""
    rng = np.random.default_rng(rank)
    table = pinstage.StagedWriteTensor((32, 16), torch.int32, device)
    ref = np.zeros((32, 16), np.int64)
    total = ref_total = 0
    for step in range(steps):
        lens = rng.integers(1, 100, 32)
        idx = rng.permutation(32)
        lens_d, idx_d = pinstage.h2d_many([lens.tolist(), idx.tolist()], device,
                                          dtype=torch.int64)
        for r in range(32):
            ids = rng.integers(0, 1000, 2)
            table.stage_write(r, (2 * step) % 16, ids.tolist())
            ref[r, (2 * step) % 16: (2 * step) % 16 + 2] = ids
        table.apply_write()
        total += int((lens_d[idx_d] * (step + 1)).sum().item())
        ref_total += int((lens[idx] * (step + 1)).sum())
    total += int(table.gpu.to(torch.int64).sum().item())
    ref_total += int(ref.sum())
    if total != ref_total:
        raise SystemExit(f"rank {rank}: checksum {total} != reference {ref_total}")
    return total


@contextlib.contextmanager
def devices(world: int, simulate: bool) -> Iterator[None]:
    """A simulated CUDA with ``world`` devices when asked or when there is no GPU."""
    if simulate or not torch.cuda.is_available():
        from pinstage.testing import simulated_accelerator

        with simulated_accelerator("random", seed=int(os.environ.get("RANK", "0")),
                                   device_count=world):
            yield
    else:
        yield


def main(argv: list[str]) -> int:
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dist.init_process_group("gloo")
    try:
        with devices(world, "--simulate" in argv):
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
            checksum = rank_work(rank, device)
            mine = pinstage.host_memory_stats(device)
            others = {f"cuda:{r}": pinstage.host_memory_stats(
                torch.device("cuda", r))["reserved_bytes"] for r in range(world) if r != rank}
            total = torch.tensor([checksum], dtype=torch.int64)
            dist.all_reduce(total)  # over gloo: CPU tensors
            line = (f"rank {rank}/{world} on {device}: checksum {checksum} matches NumPy; "
                    f"all-reduced {int(total.item())}; pinned staging reserved: "
                    f"{mine['reserved_bytes']} bytes for {device}, "
                    + ", ".join(f"{n} bytes for {d}" for d, n in others.items())
                    + " (the other devices in this process)\n")
            sys.stdout.write(line)  # one write: the ranks share the terminal
            sys.stdout.flush()
            if any(others.values()):
                raise SystemExit(f"rank {rank}: another device's staging state was used")
        dist.barrier()  # no rank tears gloo down while another still talks to it
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
