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
def test_reused_memory_has_its_new_owners_layout(mode, seed):
    """A block hands out the tensor it last was for the same layout again: in-place view ops
    of its last owner (unsqueeze_, t_, as_strided_) left that tensor as it was."""
    with simulated_accelerator(mode, seed=seed):
        for _ in range(3):
            x = torch.zeros(6, device="cuda")
            x.unsqueeze_(0)  # (another size)
            m = torch.zeros(3, 3, device="cuda")
            m.t_()  # (the same size, other strides)
            s = torch.zeros(3, 3, device="cuda")
            s.as_strided_((3, 3), (1, 3))
            del x, m, s
            y = torch.ones(6, device="cuda")
            assert y.tolist() == [1.0] * 6
            a = torch.empty(3, 3, device="cuda")
            a.copy_(torch.arange(9.0).reshape(3, 3))
            assert a.as_strided((9,), (1,)).tolist() == [float(i) for i in range(9)]
            z = y.as_strided((3,), (2,)).contiguous()  # (another layout of its own block)
            assert z.tolist() == [1.0] * 3
            del y, z


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


def _segment_view(seg):
    """A snapshot segment without its (host-chosen) address."""
    blocks = [{k: v for k, v in b.items() if k != "address"} for b in seg["blocks"]]
    return {**{k: v for k, v in seg.items() if k != "address"}, "blocks": blocks}


@pytest.mark.parametrize("mode,seed", SCHEDULES)
def test_memory_snapshot_lists_each_block_as_a_segment(mode, seed):
    """memory_snapshot()/_snapshot(): one segment (of one block) per simulated block, in use
    or cached, small-pool up to 1 MiB, with the bytes each allocation asked for."""
    with simulated_accelerator(mode, seed=seed, device_count=2):
        assert torch.cuda.memory_snapshot() == []
        a = torch.ones(1000, device="cuda")  # 4000 bytes: a 4096-byte small block
        big = torch.empty(2 * MiB + 100, dtype=torch.uint8, device="cuda:1")  # 2 MiB + 512
        where = a.data_ptr()
        del a
        gc.collect()
        side = torch.cuda.Stream(device=1)
        with torch.cuda.stream(side):
            c = torch.empty(10, device="cuda:1")  # 40 bytes, a 512-byte block, on side
        segments = torch.cuda.memory_snapshot()
        for d in (0, 1):  # (device by device, by address)
            mine = [s["address"] for s in segments if s["device"] == d]
            assert mine == sorted(mine)
        assert [s["device"] for s in segments] == [0, 1, 1]
        by_size = {s["total_size"]: s for s in segments}
        assert sorted(by_size) == [512, 4096, 2 * MiB + 512]
        assert by_size[4096]["address"] == where == by_size[4096]["blocks"][0]["address"]
        assert _segment_view(by_size[4096]) == {
            "device": 0, "total_size": 4096, "allocated_size": 0, "active_size": 0,
            "requested_size": 0, "stream": 0, "segment_type": "small",
            "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
            "blocks": [{"size": 4096, "requested_size": 0, "state": "inactive",
                        "frames": []}]}
        assert _segment_view(by_size[2 * MiB + 512]) == {
            "device": 1, "total_size": 2 * MiB + 512, "allocated_size": 2 * MiB + 512,
            "active_size": 2 * MiB + 512, "requested_size": 2 * MiB + 100, "stream": 0,
            "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
            "frames": [], "blocks": [{"size": 2 * MiB + 512, "requested_size": 2 * MiB + 100,
                                      "state": "active_allocated", "frames": []}]}
        assert by_size[512]["stream"] == side.cuda_stream != 0
        assert by_size[512]["requested_size"] == 40 and by_size[512]["device"] == 1
        full = torch.cuda.memory._snapshot()
        assert full["segments"] == segments and full["device_traces"] == [[], []]
        torch.cuda.empty_cache()
        assert sorted(s["total_size"] for s in torch.cuda.memory_snapshot()) == [
            512, 2 * MiB + 512]  # the cached block went back
        del big, c


def test_a_block_held_for_a_recorded_stream_is_pending_free():
    """Freed with record_stream while the stream's work is queued: still active (not
    allocated) until that work is done, as PyTorch keeps it until its events complete."""
    with simulated_accelerator("lazy"):
        main, side = torch.cuda.current_stream(), torch.cuda.Stream()
        a = torch.ones(1000, device="cuda")
        side.wait_stream(main)
        with torch.cuda.stream(side):
            total = a.sum()  # 4 bytes: a 512-byte block, side's
        a.record_stream(side)
        del a
        gc.collect()
        states = {s["total_size"]: s["blocks"][0]["state"] for s in torch.cuda.memory_snapshot()}
        assert states == {4096: "active_pending_free", 512: "active_allocated"}
        stats = torch.cuda.memory_stats()
        assert stats["allocated_bytes.all.current"] == 512
        assert stats["active_bytes.all.current"] == 4096 + 512
        assert stats["requested_bytes.all.current"] == 4000 + 4
        assert stats["allocation.all.current"] == 1 and stats["active.all.current"] == 2
        main.wait_stream(side)
        assert total.item() == 1000.0
        torch.cuda.synchronize()
        states = {s["total_size"]: s["blocks"][0]["state"] for s in torch.cuda.memory_snapshot()}
        assert states == {4096: "inactive", 512: "active_allocated"}
        assert torch.cuda.memory_stats()["active_bytes.all.current"] == 512


@pytest.mark.parametrize("mode,seed", SCHEDULES)
def test_memory_stats_per_pool(mode, seed):
    """memory_stats() per pool (small: blocks up to 1 MiB), the requested bytes, cudaMalloc
    and cudaFree counts and one num_sync_all_streams per empty_cache()."""
    with simulated_accelerator(mode, seed=seed):
        small = torch.empty(MiB, dtype=torch.uint8, device="cuda")  # exactly 1 MiB: small
        large = torch.empty(MiB + 1, dtype=torch.uint8, device="cuda")  # 1 MiB + 512: large
        stats = torch.cuda.memory_stats()
        expect = {"segment.small_pool.current": 1, "segment.large_pool.current": 1,
                  "segment.all.current": 2, "allocation.small_pool.current": 1,
                  "active.large_pool.current": 1, "allocation.all.allocated": 2,
                  "allocated_bytes.small_pool.current": MiB,
                  "allocated_bytes.large_pool.current": MiB + 512,
                  "reserved_bytes.all.current": 2 * MiB + 512,
                  "requested_bytes.large_pool.current": MiB + 1,
                  "requested_bytes.all.current": 2 * MiB + 1,
                  "inactive_split.all.current": 0, "inactive_split_bytes.all.current": 0,
                  "num_device_alloc": 2, "num_device_free": 0, "num_sync_all_streams": 0}
        assert {k: stats[k] for k in expect} == expect
        del large
        gc.collect()
        stats = torch.cuda.memory_stats()
        assert stats["allocated_bytes.large_pool.current"] == 0
        assert stats["allocated_bytes.large_pool.freed"] == MiB + 512
        assert stats["reserved_bytes.large_pool.current"] == MiB + 512  # cached
        assert stats["requested_bytes.all.current"] == MiB
        # a small request takes no large block (PyTorch's pools are apart): a new segment
        half = torch.empty(MiB, dtype=torch.uint8, device="cuda")
        assert torch.cuda.memory_stats()["segment.small_pool.current"] == 2
        torch.cuda.empty_cache()
        stats = torch.cuda.memory_stats()
        assert stats["num_sync_all_streams"] == 1
        assert stats["num_device_alloc"] == 3 and stats["num_device_free"] == 1
        assert stats["segment.large_pool.current"] == 0
        assert stats["reserved_bytes.large_pool.peak"] == MiB + 512
        assert stats["reserved_bytes.all.peak"] == 3 * MiB + 512
        torch.cuda.empty_cache()
        assert torch.cuda.memory_stats()["num_sync_all_streams"] == 2
        torch.cuda.reset_accumulated_memory_stats()
        stats = torch.cuda.memory_stats()
        assert stats["num_sync_all_streams"] == 0
        assert stats["segment.all.allocated"] == 0 == stats["segment.all.freed"]
        assert stats["segment.all.current"] == 2  # (PyTorch's reset keeps current and peak)
        del small, half


def test_the_per_process_memory_fraction_limits_what_may_be_reserved():
    had = (hasattr(torch._C, "_cuda_getMemoryFraction"),
           hasattr(torch._C, "_cuda_memorySnapshot"))
    with simulated_accelerator("lazy", memory="1MiB"):
        assert torch.cuda.get_per_process_memory_fraction() == 1.0
        torch.cuda.set_per_process_memory_fraction(0.5)
        assert torch.cuda.get_per_process_memory_fraction() == 0.5
        assert torch.cuda.get_per_process_memory_fraction(0) == 0.5
        keep = torch.empty(MiB // 4, dtype=torch.uint8, device="cuda")
        with pytest.raises(torch.cuda.OutOfMemoryError, match="may reserve 512.00 KiB"):
            torch.empty(MiB // 2, dtype=torch.uint8, device="cuda")  # 256 + 512 KiB > 512
        assert torch.cuda.mem_get_info() == (3 * MiB // 4, MiB)  # the device's, unchanged
        torch.cuda.set_per_process_memory_fraction(1.0)
        again = torch.empty(MiB // 2, dtype=torch.uint8, device="cuda")
        torch.cuda.set_per_process_memory_fraction(0.0)
        with pytest.raises(torch.cuda.OutOfMemoryError):
            torch.empty(1, device="cuda")
        del keep, again
    with simulated_accelerator("lazy"):  # a new simulator: the whole device again
        assert torch.cuda.get_per_process_memory_fraction() == 1.0
    assert (hasattr(torch._C, "_cuda_getMemoryFraction"),
            hasattr(torch._C, "_cuda_memorySnapshot")) == had


@pytest.mark.parametrize("mode,seed", SCHEDULES)
def test_host_memory_stats_count_pinned_blocks(mode, seed):
    """torch.cuda.host_memory_stats(): each pinned block, its size rounded up to a power of
    two as PyTorch's host allocator does; nothing is cached, so a freed block goes back at
    once (num_host_free) and empty_cache() changes nothing."""
    with simulated_accelerator(mode, seed=seed):
        stats = torch.cuda.host_memory_stats()
        assert stats["allocations.current"] == stats["num_host_alloc"] == 0
        t1 = torch.ones(10 * 1024, pin_memory=True)  # 40 KiB: a 64 KiB block
        t2 = torch.zeros(3000, dtype=torch.uint8).pin_memory()  # 3000 bytes: 4 KiB
        torch.empty(0, pin_memory=True)  # no bytes: no block
        assert t1.is_pinned() and t2.is_pinned()
        torch._C._host_emptyCache()
        stats = torch.cuda.host_memory_stats()
        for key in ("allocations", "active_requests"):
            assert [stats[f"{key}.{k}"] for k in ("current", "peak", "allocated", "freed")] \
                == [2, 2, 2, 0]
        for key in ("allocated_bytes", "active_bytes"):
            assert stats[f"{key}.current"] == stats[f"{key}.peak"] == 64 * 1024 + 4096
        assert stats["num_host_alloc"] == stats["host_alloc_time.count"] == 2
        assert stats["num_host_free"] == stats["host_free_time.count"] == 0
        del t1
        gc.collect()
        stats = torch.cuda.host_memory_stats()
        assert stats["allocated_bytes.current"] == 4096
        assert stats["allocated_bytes.freed"] == 64 * 1024
        assert stats["allocations.peak"] == 2 and stats["num_host_free"] == 1
        torch.cuda.reset_peak_host_memory_stats()
        torch.cuda.reset_accumulated_host_memory_stats()
        stats = torch.cuda.host_memory_stats()
        assert stats["allocated_bytes.peak"] == 4096 and stats["allocations.freed"] == 0
        assert stats["allocated_bytes.allocated"] == 0  # (PyTorch's reset: totals from 0)
        assert stats["allocated_bytes.current"] == 4096
        assert stats["num_host_alloc"] == stats["num_host_free"] == 0
        del t2
    if not torch.cuda.is_available():  # (a CPU build's answer again, the simulator closed)
        assert torch.cuda.host_memory_stats() == {}


@pytest.mark.parametrize("mode", ["eager", "lazy", "random"])
def test_empty_cache_waits_for_recorded_streams_and_gives_their_blocks_back(mode):
    """As PyTorch's emptyCache, empty_cache() first waits for the work of the streams a freed
    block was recorded for, so that block goes back to the device too (in lazy mode that work
    is still queued: before, the block stayed reserved)."""
    with simulated_accelerator(mode):
        s1 = torch.cuda.Stream()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_reserved()
        x = torch.ones(1 << 18, device="cuda")  # 1 MiB
        s1.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s1):
            y = x * 2
        x.record_stream(s1)
        del x
        gc.collect()
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() == base + (1 << 20)  # (y's block only)
        torch.cuda.current_stream().wait_stream(s1)
        assert y.sum().item() == 2 * (1 << 18)


def test_device_properties_report_the_simulated_memory_size():
    """get_device_properties().total_memory is the device's size, as mem_get_info says."""
    with simulated_accelerator("lazy", memory="8GiB"):
        assert torch.cuda.get_device_properties(0).total_memory == 8 * 2**30
        assert torch.cuda.mem_get_info()[1] == 8 * 2**30
    with simulated_accelerator("lazy"):
        assert torch.cuda.get_device_properties(0).total_memory == 80 * 2**30
