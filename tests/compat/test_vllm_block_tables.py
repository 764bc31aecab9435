"""vLLM-style block tables over many engine steps, compared with a NumPy reference:
Model Runner V2 (one StagedWriteTensor per KV-cache group, applied by a FusedStagedWriter) and
V1 (a CpuGpuBuffer written on the host and committed with copy_to_gpu)."""

from __future__ import annotations

import numpy as np
import torch

from pinstage import CpuGpuBuffer, FusedStagedWriter, StagedWriteTensor, async_tensor_h2d


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class V2BlockTables:
    """Model Runner V2 style: per group a (max_reqs, max_blocks) table and a 1-D block count,
    appended to by staged writes and applied together in one fused call per step."""

    def __init__(self, block_sizes: list[int], max_reqs: int, max_len: int, device) -> None:
        self.block_sizes = block_sizes
        self.tables = [StagedWriteTensor((max_reqs, cdiv(max_len, bs)), torch.int32, device)
                       for bs in block_sizes]
        self.num_blocks = [StagedWriteTensor(max_reqs, torch.int32, device) for _ in block_sizes]
        self.num_blocks_np = np.zeros((len(block_sizes), max_reqs), np.int32)
        self.writer = FusedStagedWriter(device, max_writes=4 * max_reqs)

    def append_block_ids(self, req: int, new_ids: tuple[list[int], ...], overwrite: bool) -> None:
        for g, ids in enumerate(new_ids):
            start = 0 if overwrite else int(self.num_blocks_np[g, req])
            if ids:
                self.tables[g].stage_write(req, start, ids)
            self.num_blocks_np[g, req] = start + len(ids)
            self.num_blocks[g].stage_write_elem(req, start + len(ids))

    def apply_staged_writes(self) -> None:
        self.writer.apply(self.tables + self.num_blocks)

    def gather(self, idx_mapping: torch.Tensor) -> list[torch.Tensor]:
        return [t.gpu[idx_mapping] for t in self.tables]


def test_model_runner_v2_two_groups(target):
    rng = np.random.default_rng(11)
    block_sizes, max_reqs, max_len = [16, 32], 24, 512
    bt = V2BlockTables(block_sizes, max_reqs, max_len, target.device)
    ref = [np.zeros((max_reqs, cdiv(max_len, bs)), np.int32) for bs in block_sizes]
    lens = np.zeros(max_reqs, np.int64)
    active: list[int] = []
    next_block = [1, 1]
    for step in range(80):
        free = [r for r in range(max_reqs) if r not in active]
        if free and (rng.random() < 0.5 or not active):  # add a request (overwrites its row)
            req = int(rng.choice(free))
            lens[req] = int(rng.integers(1, max_len // 2))
            new = []
            for g, bs in enumerate(block_sizes):
                n = cdiv(int(lens[req]), bs)
                new.append(list(range(next_block[g], next_block[g] + n)))
                next_block[g] += n
                ref[g][req, :n] = new[g]
            bt.append_block_ids(req, tuple(new), overwrite=True)
            active.append(req)
        if active and rng.random() < 0.2:  # remove a finished request
            active.remove(int(rng.choice(active)))
        for req in list(active):  # decode: each request grows; new blocks when it crosses one
            grow = int(rng.integers(1, 9))
            if lens[req] + grow > max_len:
                active.remove(req)
                continue
            new = []
            for g, bs in enumerate(block_sizes):
                have, need = cdiv(int(lens[req]), bs), cdiv(int(lens[req]) + grow, bs)
                new.append(list(range(next_block[g], next_block[g] + need - have)))
                next_block[g] += need - have
                ref[g][req, have:need] = new[g]
            lens[req] += grow
            bt.append_block_ids(req, tuple(new), overwrite=False)
        bt.apply_staged_writes()
        idx = async_tensor_h2d(active or [0], dtype=torch.int64, device=target.device)
        target.sync()  # an engine reads results once per step (sampling)
        got = bt.gather(idx)
        for g in range(len(block_sizes)):
            np.testing.assert_array_equal(got[g].cpu().numpy(), ref[g][active or [0]],
                                          err_msg=f"group {g}, step {step}")
            for req in active:
                assert bt.num_blocks[g].gpu[req].item() == cdiv(int(lens[req]), block_sizes[g])


class V1BlockTable:
    """V1 style: rows written in host memory (.np), condensed when requests leave, and
    committed with one copy per step."""

    def __init__(self, max_reqs: int, max_blocks: int, device) -> None:
        self.buf = CpuGpuBuffer(max_reqs, max_blocks, dtype=torch.int32, device=device)
        self.num_blocks = np.zeros(max_reqs, np.int32)

    def add_row(self, ids: list[int], row: int) -> None:
        self.num_blocks[row] = 0
        self.append_row(ids, row)

    def append_row(self, ids: list[int], row: int) -> None:
        start = int(self.num_blocks[row])
        self.buf.np[row, start : start + len(ids)] = ids
        self.num_blocks[row] = start + len(ids)

    def move_row(self, src: int, dst: int) -> None:
        n = int(self.num_blocks[src])
        self.buf.np[dst, :n] = self.buf.np[src, :n]
        self.num_blocks[dst] = n

    def commit(self, num_reqs: int) -> torch.Tensor:
        return self.buf.copy_to_gpu(num_reqs)


def test_v1_block_table_over_many_steps(target):
    rng = np.random.default_rng(12)
    max_reqs, max_blocks, bs = 16, 32, 16
    bt = V1BlockTable(max_reqs, max_blocks, target.device)
    rows: list[list[int]] = []  # the reference: block ids of the request in each row
    lens: list[int] = []
    next_block = 1
    for step in range(100):
        if len(rows) < max_reqs and rng.random() < 0.5:
            n_tok = int(rng.integers(1, 200))
            ids = list(range(next_block, next_block + cdiv(n_tok, bs)))
            next_block += len(ids)
            bt.add_row(ids, len(rows))
            rows.append(ids)
            lens.append(n_tok)
        if rows and rng.random() < 0.3:  # a request leaves: the last row fills its hole
            gone = int(rng.integers(len(rows)))
            last = len(rows) - 1
            if gone != last:
                bt.move_row(last, gone)
                rows[gone], lens[gone] = rows[last], lens[last]
            rows.pop()
            lens.pop()
        for i in range(len(rows)):
            grow = int(rng.integers(1, 20))
            need = cdiv(lens[i] + grow, bs) - cdiv(lens[i], bs)
            if len(rows[i]) + need > max_blocks:
                continue
            ids = list(range(next_block, next_block + need))
            next_block += need
            if ids:
                bt.append_row(ids, i)
            rows[i] = rows[i] + ids
            lens[i] += grow
        gpu = bt.commit(len(rows))
        assert gpu.shape == (len(rows), max_blocks)
        target.sync()  # the step's output is read back before the host writes again
        got = gpu.cpu().numpy()
        for i, ids in enumerate(rows):
            np.testing.assert_array_equal(got[i, : len(ids)], ids, err_msg=f"step {step}")
