"""pinstage's drivers (not vLLM's tests) for the vendored vLLM files: they run vLLM's own
BlockTables (Model Runner V2, gpu/block_table.py: StagedWriteTensor + UvaBackedTensor, Triton
kernels over pointer tables) and V1 MultiGroupBlockTable (CpuGpuBuffer) on pinstage, with the
Triton kernels replaced by the PyTorch stand-ins of standins.py, against NumPy references.
They run on the CPU target and under --pinstage-simulate in every mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.v1.worker.block_table import MultiGroupBlockTable
from vllm.v1.worker.gpu.block_table import BlockTables


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _slots(table: np.ndarray, req: int, pos: np.ndarray, block_size: int) -> np.ndarray:
    return table[req, pos // block_size].astype(np.int64) * block_size + pos % block_size


@pytest.mark.parametrize("steps", [12])
def test_v2_block_tables_gather_and_slot_mappings(steps):
    rng = np.random.default_rng(5)
    sizes, max_reqs, max_tokens, max_len = [16, 32], 8, 256, 1024
    dev = _device()
    bt = BlockTables(sizes, max_reqs, max_tokens, max_len, dev)
    ref = [np.zeros((max_reqs, -(-max_len // s)), np.int32) for s in sizes]
    lens = np.zeros((len(sizes), max_reqs), np.int64)
    nxt = 1
    for _ in range(steps):
        for req in rng.choice(max_reqs, 3, replace=False).tolist():
            overwrite = bool(rng.random() < 0.3) or lens[0, req] == 0
            new = []
            for g in range(len(sizes)):
                n = int(rng.integers(1, 4))
                ids = list(range(nxt, nxt + n))
                nxt += n
                start = 0 if overwrite else int(lens[g, req])
                ref[g][req, start:start + n] = ids
                lens[g, req] = start + n
                new.append(ids)
            bt.append_block_ids(req, tuple(new), overwrite)
        bt.apply_staged_writes()
        batch = rng.choice(max_reqs, 4, replace=False).astype(np.int32)
        idx = torch.tensor(batch, dtype=torch.int32, device=dev)
        gathered = bt.gather_block_tables(idx)
        for g in range(len(sizes)):
            got = gathered[g].cpu().numpy()
            for b, req in enumerate(batch.tolist()):
                n = int(lens[g, req])
                assert got[b, :n].tolist() == ref[g][req, :n].tolist()
        # one token per known block position of each request in the batch
        counts = [int(min(lens[g, r] for g in range(len(sizes)))) for r in batch.tolist()]
        qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        pos = np.concatenate([np.arange(c) * 16 for c in counts]).astype(np.int64)
        slots = bt.compute_slot_mappings(
            idx, torch.tensor(qsl, device=dev), torch.tensor(pos, device=dev)).cpu().numpy()
        for g, bs in enumerate(sizes):
            for b, req in enumerate(batch.tolist()):
                p = pos[qsl[b]:qsl[b + 1]]
                assert slots[g, qsl[b]:qsl[b + 1]].tolist() == _slots(ref[g], req, p, bs).tolist()
        full = bt.slot_mappings[:, int(qsl[-1]):].cpu()
        assert bool((full == -1).all())


def test_v1_multi_group_block_table_commit_and_slot_mapping():
    dev = _device()
    pin = torch.cuda.is_available()
    mg = MultiGroupBlockTable(max_num_reqs=4, max_model_len=512, max_num_batched_tokens=64,
                              pin_memory=pin, device=dev, block_sizes=[16],
                              kernel_block_sizes=[16])
    mg.add_row(([3, 4, 5],), 0)
    mg.add_row(([9],), 1)
    mg.append_row(([10],), 1)
    mg.move_row(1, 2)
    mg.commit_block_table(3)
    table = mg[0].get_device_tensor(3).cpu()
    assert table[0, :3].tolist() == [3, 4, 5]
    assert table[2, :2].tolist() == [9, 10]
    qsl = torch.tensor([0, 2, 2, 3], dtype=torch.int32, device=dev)
    pos = torch.tensor([1, 17, 20], dtype=torch.int64, device=dev)
    mg.compute_slot_mapping(3, qsl, pos)
    got = mg[0].slot_mapping.gpu[:5].cpu().tolist()
    assert got == [3 * 16 + 1, 4 * 16 + 1, 10 * 16 + 4, -1, -1]
