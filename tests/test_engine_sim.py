"""Engine-style code written for a GPU (``"cuda"`` strings, ``torch.cuda`` streams and events),
run unmodified under the simulated CUDA in every mode and compared with a NumPy reference;
and one test per async bug the simulator must find when it is re-introduced."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pinstage
from pinstage.testing import MODES, HazardError, simulated_accelerator

MAX_REQS, MAX_BLOCKS = 16, 12


def engine(steps: int = 6, seed: int = 0, order_streams: bool = True) -> tuple[int, int]:
    """Several steps of input preparation as an engine writes it: a block table updated by
    staged writes and per-step metadata uploaded on a copy stream, an event handing them to
    the compute stream, a gather on the compute stream, ``.item()`` at the end. Returns
    (device result, NumPy reference)."""
    rng = np.random.default_rng(seed)
    device = "cuda"
    copy_stream = torch.cuda.Stream()
    table = pinstage.StagedWriteTensor((MAX_REQS, MAX_BLOCKS), torch.int32, device)
    lens_buf = pinstage.CpuGpuBuffer(MAX_REQS, dtype=torch.int32, device=device)
    ref_table = np.zeros((MAX_REQS, MAX_BLOCKS), np.int64)
    num_blocks = np.zeros(MAX_REQS, np.int64)
    ref_total = 0
    copied = None  # when the device has read lens_buf.cpu (the host may rewrite it after)
    outs = []
    for _ in range(steps):
        n = int(rng.integers(4, MAX_REQS + 1))
        for r in range(n):  # the scheduler appends blocks to some requests
            k = int(rng.integers(0, 3))
            if k and num_blocks[r] + k <= MAX_BLOCKS:
                ids = rng.integers(0, 1000, k)
                table.stage_write(r, int(num_blocks[r]), ids.tolist())
                ref_table[r, num_blocks[r]: num_blocks[r] + k] = ids
                num_blocks[r] += k
        positions = rng.integers(0, 100, n)
        if copied is not None:
            copied.synchronize()  # don't rewrite pinned memory a queued copy still reads
        lens_buf.np[:n] = num_blocks[:n]
        if order_streams:  # the copy stream rewrites what the last step's compute reads
            copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(copy_stream):
            table.apply_write()
            lens = lens_buf.copy_to_gpu(n)
            pos = pinstage.async_tensor_h2d(positions.tolist(), device, dtype=torch.int64)
            copied = torch.cuda.Event()
            copied.record()
        compute = torch.cuda.current_stream()
        compute.wait_event(copied)
        out = table.gpu[:n].to(torch.int64).sum(dim=1) + lens.to(torch.int64) * 1000 + pos
        outs.append(out.sum())
        ref_total += int(ref_table[:n].sum() + num_blocks[:n].sum() * 1000 + positions.sum())
    total = torch.stack(outs).sum().item()
    return int(total), ref_total


@pytest.mark.parametrize("mode", MODES)
def test_engine_code_runs_unmodified_and_matches_numpy(mode):
    with simulated_accelerator(mode) as sim:
        got, want = engine()
        assert got == want
        assert sim.stats.host_stalls == 0  # staging never made the engine's host wait


def test_a_missing_stream_order_in_the_engine_is_caught():
    """Without ``copy_stream.wait_stream(compute)``, step k+1's uploads overwrite the table
    and lengths that step k's compute has not read yet: wrong in lazy mode, and in some
    random schedules (on a GPU: sometimes, under load)."""
    for mode, seed in [("eager", 0), ("lazy", 0), *(("random", s) for s in range(5))]:
        with pytest.raises(HazardError, match="stream race"):  # when queued (issue 17)
            with simulated_accelerator(mode, seed=seed):
                engine(steps=4, seed=seed, order_streams=False)


@pytest.mark.timeout(300)
def test_engine_code_over_200_random_schedules():
    for seed in range(200):
        with simulated_accelerator("random", seed=seed):
            got, want = engine(steps=3, seed=seed)
            assert got == want, seed


def test_engine_code_matches_on_the_cpu_target_without_cuda_strings():
    """The same steps on the CPU target (no streams there): the reference itself is sound."""
    got, want = _cpu_engine()
    assert got == want


def _cpu_engine() -> tuple[int, int]:
    rng = np.random.default_rng(0)
    table = pinstage.StagedWriteTensor((MAX_REQS, MAX_BLOCKS), torch.int32, "cpu")
    ref = np.zeros((MAX_REQS, MAX_BLOCKS), np.int64)
    for r in range(MAX_REQS):
        ids = rng.integers(0, 1000, 3)
        table.stage_write(r, 2, ids.tolist())
        ref[r, 2:5] = ids
    table.apply_write()
    return int(table.gpu.to(torch.int64).sum()), int(ref.sum())


# -- the bugs the simulated CUDA must find (each test fails if its bug comes back) -----------


def test_a_fence_recorded_on_the_wrong_stream_is_caught(monkeypatch):
    """A staging region read by a copy on a side stream, then the ring reused from the default
    stream: the region's fence must be on the side stream. One recorded on the stream current
    later would let the arena overwrite memory the side stream's copy has not read (the
    simulator then raises HazardError, or the side stream's result is wrong)."""
    monkeypatch.setenv("PINSTAGE_STAGING_LIMIT", "4KiB")
    for mode, seeds in (("lazy", 1), ("random", 20)):
        for seed in range(seeds):
            with simulated_accelerator(mode, seed=seed) as sim:
                side = torch.cuda.Stream()
                with torch.cuda.stream(side):
                    first = pinstage.async_tensor_h2d(np.full(4, 7, np.int64), sim.device)
                rest = [pinstage.async_tensor_h2d(np.full(96, i, np.int64), sim.device)
                        for i in range(30)]  # from the default stream: the 4 KiB ring wraps
                sim.synchronize()
                assert first.tolist() == [7] * 4
                assert [r.tolist() for r in rest] == [[i] * 96 for i in range(30)]


def test_dropping_pinned_memory_with_a_copy_in_flight_is_safe():
    import gc

    for mode in MODES:
        with simulated_accelerator(mode) as sim:
            outs = []
            for i in range(10):
                x = torch.empty(16, dtype=torch.int64, device="cuda")
                x.copy_(pinstage.np_to_pinned_tensor(np.arange(16) * i), non_blocking=True)
                outs.append(x)
                gc.collect()
            sim.synchronize()
            assert [o.tolist() for o in outs] == [list(range(0, 16 * i, i))[:16] if i else
                                                  [0] * 16 for i in range(10)]


def test_a_burst_of_apply_writes_behind_a_slow_device_makes_no_host_stall():
    with simulated_accelerator("lazy") as sim:
        table = pinstage.StagedWriteTensor((64, 16), torch.int32, sim.device)
        sim.launch(lambda: None)  # the device is busy; nothing runs until the host waits
        for step in range(4):
            for r in range(64):
                table.stage_write(r, step, [r + step])
            table.apply_write()
        assert sim.stats.host_stalls == 0
        assert table.gpu[5, :4].tolist() == [5, 6, 7, 8]


def test_objects_made_under_inference_mode_work_outside_it():
    with simulated_accelerator("lazy") as sim:
        with torch.inference_mode():
            buf = pinstage.CpuGpuBuffer(4, dtype=torch.int32, device=sim.device)
            table = pinstage.StagedWriteTensor((4, 4), torch.int32, sim.device)
        buf.np[:] = 3
        buf.copy_to_gpu()
        table.stage_write(1, 1, [7])
        table.apply_write()
        assert buf.gpu.tolist() == [3] * 4 and table.gpu[1].tolist() == [0, 7, 0, 0]


def test_a_graph_captured_copy_of_ring_memory_is_refused():
    with simulated_accelerator("lazy") as sim:
        pinstage.capabilities()
        g = torch.cuda.CUDAGraph()
        # (both refused: the graph is empty, which CUDA warns about at capture_end)
        with pytest.warns(UserWarning, match="The CUDA Graph is empty"), torch.cuda.graph(g):
            with pytest.raises(RuntimeError, match="captur"):
                pinstage.h2d_many([[1, 2], [3]], sim.device)
            with pytest.raises(RuntimeError, match="captur"):
                pinstage.async_tensor_h2d(np.arange(3), sim.device)


def test_the_race_the_engine_avoids_is_found_when_it_is_not_avoided():
    """Without waiting for the previous copy, rewriting ``CpuGpuBuffer.cpu`` is a hazard."""
    with pytest.raises(HazardError):
        with simulated_accelerator("lazy") as sim:
            buf = pinstage.CpuGpuBuffer(8, dtype=torch.int32, device=sim.device)
            for i in range(3):
                buf.np[:] = i
                buf.copy_to_gpu()
            sim.synchronize()
