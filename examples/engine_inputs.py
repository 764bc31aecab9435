"""An inference engine's input preparation on pinstage, written as engine code is.

Each step the scheduler adds, removes and extends requests; the engine then
* appends new KV-cache block ids to a block table per KV-cache group (two groups with different
  block sizes), staged on the host and applied with one ``FusedStagedWriter`` call;
* uploads the step's metadata (request indices, query start locations, sequence lengths) with
  one ``h2d_many`` transfer, token ids through a ``CpuGpuBuffer``, sampling temperatures with
  ``async_tensor_h2d``;
* computes the slot mapping on the device and reads back a small result (as sampling would).
Every result is checked against a NumPy reference. Run: ``python examples/engine_inputs.py
[--device cuda] [--steps 200] [--simulate]``; ``--simulate`` runs the same code on pinstage's
simulated CUDA (no GPU needed). A device this machine does not have is a one-line error.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import pinstage

BLOCK_SIZES = (16, 32)  # two KV-cache groups (e.g. full and sliding-window attention)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Request:
    row: int  # its row in the block tables
    num_tokens: int  # tokens with KV cache so far
    blocks: list[list[int]] = field(default_factory=list)  # block ids per group


class InputPreparer:
    """The engine side: persistent device tables and buffers, refreshed every step."""

    def __init__(self, device: Any, max_reqs: int, max_len: int, max_tokens: int) -> None:
        self.device = torch.device(device)
        self.tables = [pinstage.StagedWriteTensor((max_reqs, cdiv(max_len, bs)), torch.int32,
                                                  self.device) for bs in BLOCK_SIZES]
        self.writer = pinstage.FusedStagedWriter(self.device, max_writes=4 * max_reqs)
        self.input_ids = pinstage.CpuGpuBuffer(max_tokens, dtype=torch.int32,
                                               device=self.device)
        self.is_cuda = self.device.type == "cuda"
        self.upload_done: Any = None  # a torch.cuda.Event after the last copy from input_ids

    def append_blocks(self, req: Request, new: list[list[int]], start: list[int]) -> None:
        for g, ids in enumerate(new):
            if ids:
                self.tables[g].stage_write(req.row, start[g], ids)

    def prepare(self, reqs: list[Request], new_tokens: list[int], token_ids: np.ndarray,
                temperatures: list[float]) -> dict[str, torch.Tensor]:
        self.writer.apply(self.tables)  # every group's new block ids: one copy
        rows = np.array([r.row for r in reqs], np.int32)
        query_start = np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.int32)
        seq_lens = np.array([r.num_tokens for r in reqs], np.int32)
        idx_mapping, query_start_loc, seq_lens_d = pinstage.h2d_many(
            [rows, query_start, seq_lens], self.device, dtype=torch.int32)  # one transfer
        if self.is_cuda and self.upload_done is not None:
            self.upload_done.synchronize()  # the previous step's copy has read input_ids
        n = int(query_start[-1])
        self.input_ids.np[:n] = token_ids
        ids = self.input_ids.copy_to_gpu(n)
        if self.is_cuda:
            self.upload_done = torch.cuda.Event()
            self.upload_done.record(torch.cuda.current_stream(self.device))
        temps = pinstage.async_tensor_h2d(temperatures, self.device, dtype=torch.float32)
        # The device computes each new token's position and KV-cache slot, per group.
        req_of_token = torch.repeat_interleave(
            torch.arange(len(reqs), device=self.device), torch.diff(query_start_loc).long(),
            output_size=n)
        positions = (seq_lens_d.long()[req_of_token] - n_tokens_after(query_start_loc, n)
                     .to(torch.int64))
        slots = []
        for g, bs in enumerate(BLOCK_SIZES):
            table = self.tables[g].gpu
            block = table[idx_mapping.long()[req_of_token], positions // bs]
            slots.append(block.long() * bs + positions % bs)
        return {"input_ids": ids, "positions": positions, "temperatures": temps,
                "slot_mapping_0": slots[0], "slot_mapping_1": slots[1]}


def n_tokens_after(query_start_loc: torch.Tensor, n: int) -> torch.Tensor:
    """For each new token, how many new tokens of its request come at or after it (so its
    position is ``seq_len - that``)."""
    ends = query_start_loc[1:].long()
    req = torch.searchsorted(ends, torch.arange(n, device=ends.device), right=True)
    return ends[req] - torch.arange(n, device=ends.device)


def reference(reqs: list[Request], new_tokens: list[int]) -> dict[str, np.ndarray]:
    pos, slots = [], [[], []]
    for r, k in zip(reqs, new_tokens):
        for p in range(r.num_tokens - k, r.num_tokens):
            pos.append(p)
            for g, bs in enumerate(BLOCK_SIZES):
                slots[g].append(r.blocks[g][p // bs] * bs + p % bs)
    return {"positions": np.array(pos, np.int64), "slot_mapping_0": np.array(slots[0]),
            "slot_mapping_1": np.array(slots[1])}


def main(device: Any = "cuda", steps: int = 200, seed: int = 0, max_reqs: int = 64,
         max_len: int = 2048, verbose: bool = True) -> dict[str, Any]:
    """Run ``steps`` engine steps on ``device``; returns a summary (raises on any mismatch)."""
    rng = np.random.default_rng(seed)
    max_tokens = max_reqs * 16
    prep = InputPreparer(device, max_reqs, max_len, max_tokens)
    free_rows = list(range(max_reqs))
    running: list[Request] = []
    next_block = [1] * len(BLOCK_SIZES)
    added = removed = tokens = 0
    for _step in range(steps):
        if free_rows and rng.random() < 0.6:  # a new request's prompt arrives (prefill)
            req = Request(free_rows.pop(), 0, [[] for _ in BLOCK_SIZES])
            running.append(req)
            added += 1
        if running and rng.random() < 0.15:  # a request finishes: its row is reused later
            done = running.pop(int(rng.integers(len(running))))
            free_rows.append(done.row)
            removed += 1
        if not running:
            continue
        new_tokens = []
        for req in running:
            k = int(rng.integers(20, 200)) if req.num_tokens == 0 else 1
            k = min(k, max_len - req.num_tokens, 16)
            new_tokens.append(k)
            start = [len(b) for b in req.blocks]
            new = []
            for g, bs in enumerate(BLOCK_SIZES):
                need = cdiv(req.num_tokens + k, bs) - len(req.blocks[g])
                new.append(list(range(next_block[g], next_block[g] + need)))
                next_block[g] += need
                req.blocks[g] += new[g]
            req.num_tokens += k
            prep.append_blocks(req, new, start)
        keep = [(r, k) for r, k in zip(running, new_tokens) if k > 0]
        batch, counts = [r for r, _ in keep], [k for _, k in keep]
        if not batch:
            continue
        n = sum(counts)
        token_ids = rng.integers(0, 32000, n).astype(np.int32)
        out = prep.prepare(batch, counts, token_ids, [0.7] * len(batch))
        ref = reference(batch, counts)
        for name, expected in ref.items():  # reading back waits for the device (as sampling)
            got = out[name].cpu().numpy()
            if not np.array_equal(got, expected):
                raise AssertionError(f"{name} differs from the NumPy reference at step {_step}")
        if not np.array_equal(out["input_ids"].cpu().numpy(), token_ids):
            raise AssertionError(f"input_ids differ at step {_step}")
        tokens += n
        finished = [r for r in running if r.num_tokens >= max_len]
        for r in finished:
            running.remove(r)
            free_rows.append(r.row)
    pinstage.synchronize(prep.device)
    summary = {"device": str(prep.device), "steps": steps, "requests_added": added,
               "requests_removed": removed, "tokens": tokens, "matches_reference": True}
    if verbose:
        print(summary)
    return summary


def cli(argv: list[str] | None = None) -> int:
    """The command line: ``--device``, ``--steps`` and ``--simulate``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None,
                        help="cuda, cuda:N or cpu (default: cuda if there is one, else cpu; "
                             "with --simulate: cuda)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--simulate", action="store_true",
                        help="run on pinstage's simulated CUDA (no GPU needed)")
    args = parser.parse_args(argv)
    if args.simulate:
        from pinstage.testing import simulated_accelerator

        with simulated_accelerator("random", seed=1) as sim:
            main(args.device or "cuda", args.steps)
            print("simulated device work:", sim.stats.as_dict())
        return 0
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    from pinstage.cli import device_problem

    problem = device_problem(device)
    if problem is not None:  # one line, not a traceback from deep inside the engine
        parser.exit(2, f"{parser.prog}: error: {problem}; or run with --simulate\n")
    main(device, args.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
