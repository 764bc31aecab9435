"""The GPU path's second review (issue 18), on the simulated CUDA: each finding is a test that
fails on the code before its fix.

1. dropped pinned memory goes back on the paths that allocate, not only in three calls;
2. a buffer read on a side stream and dropped on another is fenced on the side stream;
3. a fence nobody waits for any more is never moved forward by later records;
4. ``set_sync_debug_mode("error")`` does not turn UVA off through the probe;
5. no event record, query or registration while another thread captures a graph;
8. a buffer whose memory ``share_memory_()`` moved is refused, not silently diverged.
"""

from __future__ import annotations

import gc
import threading
import warnings

import numpy as np
import pytest
import torch

import pinstage
from pinstage._host import TOTALS
from pinstage._state import device_state
from pinstage.testing import HazardError, simulated_accelerator

MODES = ["eager", "lazy", "random"]


@pytest.mark.parametrize("mode", MODES)
def test_dropped_buffers_go_back_without_host_memory_stats(mode, quiet_gc):
    """An engine loop that makes and drops buffers (and only ever synchronizes through
    torch) holds a bounded amount of pinned memory: allocation collects what was dropped."""
    nbytes = 64 * 1024
    with simulated_accelerator(mode, seed=2) as sim:
        base = TOTALS.reserved_bytes
        peak = 0
        for k in range(60):
            buf = pinstage.CpuGpuBuffer(nbytes // 4, dtype=torch.int32, device=sim.device)
            buf.np[:] = k
            out = buf.copy_to_gpu()
            torch.cuda.synchronize()  # the engine reads its results: the device is done
            assert int(out[-1].item()) == k
            del buf, out
            gc.collect()
            peak = max(peak, TOTALS.reserved_bytes - base)
        assert peak <= 4 * nbytes, f"{peak} bytes pinned for one live 64 KiB buffer"


@pytest.mark.parametrize("mode", ["lazy", "random"])
def test_buffer_read_on_a_side_stream_is_fenced_there(mode, quiet_gc):
    """Copied on a side stream, dropped while the default stream is current: its memory is
    kept registered until the side stream's copy has run (no HazardError, right values)."""
    with simulated_accelerator(mode, seed=3) as sim:
        side = torch.cuda.Stream()
        buf = pinstage.CpuGpuBuffer(256, dtype=torch.int32, device=sim.device)
        buf.np[:] = 7
        side.wait_stream(torch.cuda.current_stream())  # after the .gpu zero-fill
        with torch.cuda.stream(side):
            gpu = buf.copy_to_gpu()  # queued on the side stream, not run yet (lazy)
        del buf
        gc.collect()
        torch.cuda.current_stream().synchronize()  # the default stream is done, the side not
        pinstage.CpuGpuBuffer(16, dtype=torch.int32, device=sim.device)  # collects
        side.synchronize()
        assert gpu.cpu().tolist() == [7] * 256


def test_a_done_fence_stays_done_however_much_work_follows():
    """A pool slot whose readers have finished is handed out with no host wait, even after
    hundreds of uploads recorded fences on the same stream since (a shared event ring would
    re-record the slot's event on the newest work)."""
    with simulated_accelerator("lazy") as sim:
        pool = pinstage.UvaBufferPool(4, torch.int64, max_concurrency=2, device=sim.device)
        seen = torch.zeros(4, dtype=torch.int64, device=sim.device)
        seen.copy_(pool.copy_to_uva([1, 2, 3, 4]))  # hand-out 1 (slot 0) and its reader
        pool.copy_to_uva([5, 6, 7, 8])  # hand-out 2 (slot 1) fences hand-out 1
        sim.synchronize()  # every reader is done
        for i in range(400):  # lazily queued work, and fences, on the same stream
            pinstage.async_tensor_h2d([i, i + 1], sim.device)
        state = device_state(sim.backend)
        stalls = state.stalls
        pool.copy_to_uva([9, 10, 11, 12])  # slot 0 again: its readers finished long ago
        assert state.stalls == stalls
        assert seen.cpu().tolist() == [1, 2, 3, 4]


def test_sync_debug_mode_error_leaves_uva_on():
    with simulated_accelerator("lazy") as sim:
        torch.cuda.set_sync_debug_mode("error")
        try:
            caps = pinstage.capabilities(sim.device)  # the first call: the probe runs here
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert caps.pin_memory and caps.uva, caps.reasons


def test_the_simulator_enforces_sync_debug_mode():
    with simulated_accelerator("lazy"):
        x = torch.arange(4, device="cuda") + 1
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with pytest.warns(UserWarning, match="called a synchronizing CUDA operation"):
                x.sum().item()
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                torch.cuda.synchronize()  # not flagged, as in torch
                ev = torch.cuda.Event()
                ev.record()
                ev.synchronize()  # not flagged either
            torch.cuda.set_sync_debug_mode("error")
            with pytest.raises(RuntimeError, match="called a synchronizing CUDA operation"):
                x.cpu()
            with pytest.raises(RuntimeError, match="called a synchronizing CUDA operation"):
                torch.cuda.current_stream().synchronize()
            y = torch.empty(4, dtype=torch.int64).pin_memory()
            y.copy_(x, non_blocking=True)  # into pinned memory: no sync, not flagged
        finally:
            torch.cuda.set_sync_debug_mode(0)


def _capture_in_thread(started: threading.Event, release: threading.Event, mode: str,
                       errors: list[BaseException], out: list[torch.Tensor]) -> None:
    try:
        g = torch.cuda.CUDAGraph()
        x = torch.zeros(4, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(g, stream=s, capture_error_mode=mode):
            y = x + 1
            started.set()
            release.wait(10)
        g.replay()
        torch.cuda.synchronize()
        out.append(y.cpu())
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)
        started.set()


def test_housekeeping_waits_while_another_thread_captures(quiet_gc):
    """A metrics thread calling host_memory_stats() (with dropped memory to collect) while
    another thread captures in the default "global" mode records and queries no event, and
    makes no registration: the capture is intact."""
    with simulated_accelerator("lazy") as sim:
        pinstage.capabilities(sim.device)
        buf = pinstage.CpuGpuBuffer(64, dtype=torch.int32, device=sim.device)
        buf.copy_to_gpu()
        del buf
        gc.collect()  # parked: host_memory_stats would fence and collect it
        pinstage.async_tensor_h2d(list(range(64)), sim.device)  # a staging region to reclaim
        started, release = threading.Event(), threading.Event()
        errors: list[BaseException] = []
        out: list[torch.Tensor] = []
        t = threading.Thread(target=_capture_in_thread,
                             args=(started, release, "global", errors, out))
        t.start()
        assert started.wait(10)
        try:
            stats = pinstage.host_memory_stats()  # must not touch events now
            with pytest.raises(pinstage.CaptureError):
                pinstage.CpuGpuBuffer(64, dtype=torch.int32, device=sim.device)
        finally:
            release.set()
            t.join(10)
        assert not errors, errors
        assert out[0].tolist() == [1.0] * 4
        assert stats["reserved_bytes"] > 0
        assert pinstage.host_memory_stats(sim.device)["in_use_bytes"] >= 0  # after: collects


def test_event_query_from_another_thread_invalidates_a_global_capture():
    """What CUDA does: in "global" mode an event query from any thread is refused, and the
    capture it would have broken fails at its end."""
    with simulated_accelerator("lazy"):
        started, release = threading.Event(), threading.Event()
        errors: list[BaseException] = []
        out: list[torch.Tensor] = []
        t = threading.Thread(target=_capture_in_thread,
                             args=(started, release, "global", errors, out))
        t.start()
        assert started.wait(10)
        try:
            ev = torch.cuda.Event()
            with pytest.raises(RuntimeError, match="capturing"):
                ev.query()
        finally:
            release.set()
            t.join(10)
        assert errors and "Invalidated" in str(errors[0])


def test_thread_local_capture_allows_other_threads():
    with simulated_accelerator("lazy"):
        started, release = threading.Event(), threading.Event()
        errors: list[BaseException] = []
        out: list[torch.Tensor] = []
        t = threading.Thread(target=_capture_in_thread,
                             args=(started, release, "thread_local", errors, out))
        t.start()
        assert started.wait(10)
        try:
            ev = torch.cuda.Event()
            ev.record()
            assert ev.query() in (True, False)  # legal from another thread in this mode
        finally:
            release.set()
            t.join(10)
        assert not errors, errors


def test_np_to_pinned_tensor_refuses_inside_a_capture():
    with simulated_accelerator("lazy"):
        pinstage.capabilities()
        g = torch.cuda.CUDAGraph()
        # (refused: the graph is empty, which CUDA warns about at capture_end)
        with pytest.warns(UserWarning, match="The CUDA Graph is empty"), torch.cuda.graph(g):
            with pytest.raises(pinstage.CaptureError, match="np_to_pinned_tensor"):
                pinstage.np_to_pinned_tensor(np.arange(4))


@pytest.mark.parametrize("make", ["CpuGpuBuffer", "UvaBuffer"])
def test_share_memory_is_refused_not_diverged(make):
    """torch.multiprocessing moves a tensor it sends into shared memory (share_memory_()):
    a pinstage buffer whose .cpu was moved raises instead of copying pageable memory that
    .np no longer sees."""
    with simulated_accelerator("lazy") as sim:
        if make == "CpuGpuBuffer":
            buf = pinstage.CpuGpuBuffer(8, dtype=torch.int32, device=sim.device)
            use = buf.copy_to_gpu
        else:
            buf = pinstage.UvaBuffer(8, torch.int32, sim.device)
            use = buf.uva
        use()
        buf.cpu.share_memory_()
        with pytest.raises(ValueError, match="share_memory_"):
            use()


def test_pinned_copy_for_another_device_is_fenced_there(quiet_gc):
    """np_to_pinned_tensor's memory may be copied to any device: dropped, it is fenced on
    every device's streams, not only on the current device's (no HazardError)."""
    with simulated_accelerator("lazy", device_count=2) as sim:
        pinstage.capabilities("cuda:1")
        t = pinstage.np_to_pinned_tensor(np.arange(1024))
        with torch.cuda.device(1):
            dst = torch.empty(1024, dtype=torch.int64, device="cuda:1")
            dst.copy_(t, non_blocking=True)  # read later, on device 1's stream
        del t
        gc.collect()
        for _ in range(3):  # reuse the pool on device 0: a freed slab would be rewritten
            pinstage.np_to_pinned_tensor(np.full(1024, 5))
        sim.synchronize()
        assert dst.cpu().tolist() == list(range(1024))


def test_hazard_still_raised_for_a_real_misuse():
    """(The fences are not so wide that the simulator stops seeing misuse.)"""
    with pytest.raises(HazardError):
        with simulated_accelerator("lazy") as sim:
            buf = pinstage.CpuGpuBuffer(8, dtype=torch.int32, device=sim.device)
            buf.copy_to_gpu()
            buf.np[0] = 3
            sim.synchronize()
