"""The simulated caching allocator (issue 17 item 2): per-stream reuse of freed device
memory, the reuse hazard that a missing ``record_stream`` leaves, the memory counters, and a
device-memory limit."""

from __future__ import annotations

import gc

import pytest
import torch

from pinstage.testing import HazardError, simulated_accelerator

pytestmark = pytest.mark.timeout(120)
SCHEDULES = [("eager", 0), ("lazy", 0), *(("random", s) for s in range(3))]
MiB = 2**20


def test_counters_follow_allocations_and_frees():
    with simulated_accelerator("lazy"):
        assert torch.cuda.memory_allocated() == 0 and torch.cuda.memory_reserved() == 0
        x = torch.ones(1000, device="cuda")  # 4000 bytes: one 4096-byte block
        assert torch.cuda.memory_allocated() == 4096
        assert torch.cuda.memory_reserved() == 4096
        del x
        gc.collect()
        assert torch.cuda.memory_allocated() == 0
        assert torch.cuda.memory_reserved() == 4096  # cached, as PyTorch keeps it
        assert torch.cuda.max_memory_allocated() == 4096
        y = torch.zeros(1000, device="cuda")  # reuses the cached block
        assert torch.cuda.memory_reserved() == 4096
        stats = torch.cuda.memory_stats()
        assert stats["allocated_bytes.all.current"] == 4096
        assert stats["reserved_bytes.all.peak"] == 4096
        assert stats["num_ooms"] == 0
        free, total = torch.cuda.mem_get_info()
        assert total - free == 4096
        del y
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() == 0
        torch.cuda.reset_peak_memory_stats()
        assert torch.cuda.max_memory_allocated() == 0


@pytest.mark.parametrize("mode,seed", SCHEDULES)
def test_reuse_on_the_same_stream_keeps_values_right(mode, seed):
    """Blocks go around a loop on one stream: stream order keeps every value right (a
    queued reader of the old owner runs before the new owner's writer)."""
    with simulated_accelerator(mode, seed=seed):
        x = torch.zeros(64, device="cuda")
        y = torch.ones(64, device="cuda")
        for _ in range(50):
            x = x + y
        assert x.tolist() == [50.0] * 64
        assert torch.cuda.memory_reserved() <= 4 * 512


@pytest.mark.parametrize("mode,seed", SCHEDULES)
def test_a_missing_record_stream_is_a_hazard_at_reuse(mode, seed):
    with simulated_accelerator(mode, seed=seed):
        main, side = torch.cuda.current_stream(), torch.cuda.Stream()
        a = torch.ones(1000, device="cuda")
        side.wait_stream(main)
        with torch.cuda.stream(side):
            total = a.sum()  # queued on side; a is freed below without record_stream
        del a
        gc.collect()
        with pytest.raises(HazardError, match=r"write-after-read.*record_stream"):
            torch.full((1000,), 3.0, device="cuda")  # reuses a's block on main
        main.wait_stream(side)
        assert total.item() == 1000.0


@pytest.mark.parametrize("mode,seed", SCHEDULES)
def test_record_stream_makes_the_reuse_safe(mode, seed):
    with simulated_accelerator(mode, seed=seed):
        main, side = torch.cuda.current_stream(), torch.cuda.Stream()
        a = torch.ones(1000, device="cuda")
        side.wait_stream(main)
        with torch.cuda.stream(side):
            total = a.sum()
        a.record_stream(side)
        del a
        gc.collect()
        b = torch.full((1000,), 3.0, device="cuda")  # a's block only if side's work is done
        main.wait_stream(side)
        assert total.item() == 1000.0 and b.sum().item() == 3000.0
        del b
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        c = torch.full((1000,), 4.0, device="cuda")  # ... once it is done, reused
        assert torch.cuda.memory_reserved() == reserved
        assert c.sum().item() == 4000.0


def test_a_device_memory_limit_raises_out_of_memory():
    with simulated_accelerator("lazy", memory="1MiB"):
        assert torch.cuda.mem_get_info() == (1 * MiB, 1 * MiB)
        keep = torch.empty(MiB // 2, dtype=torch.uint8, device="cuda")
        with pytest.raises(torch.cuda.OutOfMemoryError, match="CUDA out of memory"):
            torch.empty(MiB, dtype=torch.uint8, device="cuda")
        assert torch.cuda.memory_stats()["num_ooms"] == 1
        del keep
        gc.collect()
        torch.empty(MiB, dtype=torch.uint8, device="cuda")  # the cache gives back first


def test_the_memory_argument_is_checked():
    with pytest.raises(ValueError, match="memory"):
        with simulated_accelerator("lazy", memory=0):
            pass
    with pytest.raises(TypeError):
        with simulated_accelerator("lazy", memory=True):
            pass


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_memory_a_graph_captured_is_never_handed_out_again(mode):
    """A temporary freed inside a capture is the graph's (its replays write it): a later
    allocation on the capture stream gets other memory, so replays corrupt nothing."""
    with simulated_accelerator(mode):
        capture = torch.cuda.Stream()
        static_in = torch.ones(256, device="cuda")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=capture):
            tmp = static_in * 2
            static_out = tmp + 1
            del tmp
        gc.collect()
        with torch.cuda.stream(capture):
            mine = torch.full((256,), 7.0, device="cuda")  # same size as tmp
        torch.cuda.current_stream().wait_stream(capture)
        g.replay()
        torch.cuda.synchronize()
        assert static_out.tolist() == [3.0] * 256
        assert mine.tolist() == [7.0] * 256


def test_the_cache_is_bounded():
    """Free blocks beyond the cache's bound are given back (host memory, here)."""
    from pinstage._sim import _alloc

    with simulated_accelerator("lazy"):
        for n in range(1, 21):  # 16 MiB .. 320 MiB, each freed at once: all different sizes
            torch.empty(n * 16 * MiB, dtype=torch.uint8, device="cuda")
        gc.collect()
        assert torch.cuda.memory_allocated() == 0
        assert torch.cuda.memory_reserved() <= _alloc.CACHE_KEEP
