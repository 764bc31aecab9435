"""PyTorch stand-ins for the Triton kernels of the vendored vLLM files (pinstage's code, not
vLLM's): each does what its kernel's source says, program by program of the launch grid, with
``pinstage.testing.tensor_at`` to follow the raw device pointers the kernels take. They are
registered on the kernels with ``pinstage.testing.register_kernel``, so a launch runs them as
one kernel queued on the simulated CUDA (or at once on the CPU target)."""

from __future__ import annotations

import torch
from pinstage.testing import register_kernel, tensor_at

_I32 = 4  # bytes of the int32 block tables the pointer tables point at


def gather_block_tables(idx_mapping, src_ptrs, dst_ptrs, strides, num_blocks, num_blocks_stride,
                        BLOCK_SIZE, grid):  # noqa: N803
    """Stand-in for gpu/block_table.py ``_gather_block_tables_kernel``: per (group, batch row)
    copy the request's first ``num_blocks`` block ids from the source table to the
    input table."""
    groups, rows = grid
    src, dst, st = src_ptrs.tolist(), dst_ptrs.tolist(), strides.tolist()
    flat_nb = num_blocks.reshape(-1)
    for g in range(groups):
        for b in range(rows):
            req = int(idx_mapping[b])
            n = int(flat_nb[g * num_blocks_stride + req])
            if n:
                s = tensor_at(src[g] + req * st[g] * _I32, (n,), torch.int32)
                tensor_at(dst[g] + b * st[g] * _I32, (n,), torch.int32).copy_(s)


def compute_slot_mappings(num_tokens, max_num_tokens, idx_mapping, query_start_loc, pos,
                          block_table_ptrs, block_table_strides, block_sizes, slot_mappings,
                          slot_mappings_stride, cp_rank, CP_SIZE, CP_INTERLEAVE, PAD_ID,  # noqa: N803
                          TRITON_BLOCK_SIZE, grid):  # noqa: N803
    """Stand-in for gpu/block_table.py ``_compute_slot_mappings_kernel``."""
    groups, programs = grid
    ptrs, strides = block_table_ptrs.tolist(), block_table_strides.tolist()
    flat = slot_mappings.reshape(-1)
    for g in range(groups):
        out = flat[g * slot_mappings_stride: g * slot_mappings_stride + max_num_tokens]
        out[num_tokens:max_num_tokens] = PAD_ID  # the last program pads
        block_size = int(block_sizes[g])
        for b in range(programs - 1):
            req = int(idx_mapping[b])
            start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
            if end <= start:
                continue
            p = pos[start:end].to(torch.int64)
            span = block_size * CP_SIZE
            block_idx, block_off = p // span, p % span
            row = tensor_at(ptrs[g] + req * strides[g] * _I32, (int(block_idx.max()) + 1,),
                            torch.int32)
            numbers = row[block_idx].to(torch.int64)
            if CP_SIZE == 1:
                slots = numbers * block_size + block_off
            else:
                is_local = block_off // CP_INTERLEAVE % CP_SIZE == cp_rank
                local = (block_off // (CP_INTERLEAVE * CP_SIZE)) * CP_INTERLEAVE + \
                    block_off % CP_INTERLEAVE
                slots = torch.where(is_local, numbers * block_size + local,
                                    torch.full_like(local, PAD_ID))
            out[start:end] = slots


def compute_slot_mapping_v1(num_tokens, max_num_tokens, query_start_loc, positions,
                            block_table, block_table_stride, block_size, slot_mapping,
                            TOTAL_CP_WORLD_SIZE, TOTAL_CP_RANK,  # noqa: N803
                            CP_KV_CACHE_INTERLEAVE_SIZE, PAD_ID, BLOCK_SIZE, grid):  # noqa: N803
    """Stand-in for V1 block_table.py ``_compute_slot_mapping_kernel`` (tensors, no
    pointer tables)."""
    (programs,) = grid
    flat_table = block_table.reshape(-1)
    slot_mapping[num_tokens:max_num_tokens] = PAD_ID
    world, rank, inter = TOTAL_CP_WORLD_SIZE, TOTAL_CP_RANK, CP_KV_CACHE_INTERLEAVE_SIZE
    for r in range(programs - 1):
        start, end = int(query_start_loc[r]), int(query_start_loc[r + 1])
        if end <= start:
            continue
        p = positions[start:end].to(torch.int64)
        virtual = block_size * world
        block_idx = p // virtual
        numbers = flat_table[r * block_table_stride + block_idx].to(torch.int64)
        voff = p - block_idx * virtual
        is_local = (voff // inter) % world == rank
        local = (voff // (world * inter)) * inter + voff % inter
        slots = torch.where(is_local, numbers * block_size + local,
                            torch.full_like(local, PAD_ID))
        slot_mapping[start:end] = slots


def register_all() -> None:
    """Register the stand-ins on the vendored modules' kernels."""
    from vllm.v1.worker import block_table as v1
    from vllm.v1.worker.gpu import block_table as v2

    register_kernel(v2._gather_block_tables_kernel, gather_block_tables)
    register_kernel(v2._compute_slot_mappings_kernel, compute_slot_mappings)
    register_kernel(v1._compute_slot_mapping_kernel, compute_slot_mapping_v1)
