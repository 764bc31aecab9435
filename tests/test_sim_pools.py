"""Private memory pools on the simulated CUDA (issue 17 items 2 and 4): ``graph_pool_handle()``,
``CUDAGraph.pool()``, graphs that share a pool reusing each other's freed memory as PyTorch's
caching allocator does, ``torch.cuda.MemPool`` and ``use_mem_pool``."""

from __future__ import annotations

import gc

import pytest
import torch

from pinstage.testing import simulated_accelerator

pytestmark = pytest.mark.timeout(120)
SHARING = ["no sharing", "via pool()", "via graph_pool_handle()", "via MemPool"]


@pytest.mark.parametrize("mode", ["eager", "lazy"])
@pytest.mark.parametrize("share", SHARING)
def test_graphs_sharing_a_pool_reuse_its_freed_memory(mode, share):
    """PyTorch's test_graph_three_successive: ``c`` is freed while ``g1`` is captured, so a
    later capture into the same pool (``g2``'s ``f``) gets its memory. Replayed in capture
    order all is well; replayed as g0, g2, g1, ``g1`` reads ``f``'s values where ``c`` was
    (e = f + 3 = 10), which only a shared pool does."""
    size = 1000
    with simulated_accelerator(mode):
        a = torch.ones(size, device="cuda")
        g0, g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        mempool = torch.cuda.MemPool()
        first = {"via graph_pool_handle()": (torch.cuda.graph_pool_handle(),),
                 "via MemPool": (mempool.id,)}.get(share, ())
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            g0.capture_begin(*first)
            b = a.clone()
            c = b + 1
            d = b + 2
            g0.capture_end()
            later = (g0.pool(),) if share == "via pool()" else first
            g1.capture_begin(*later)
            e = c + 3
            del c
            g1.capture_end()
            g2.capture_begin(*later)
            f = d + 4
            g2.capture_end()
        torch.cuda.current_stream().wait_stream(s)
        g0.replay()
        g1.replay()
        g2.replay()
        assert e.sum().item() == size * 5 and f.sum().item() == size * 7
        g0.replay()
        g2.replay()
        g1.replay()
        assert f.sum().item() == size * 7
        assert e.sum().item() == (size * 5 if share == "no sharing" else size * 10)
        if share != "no sharing":
            assert g1.pool() == g2.pool() == g0.pool()
        else:
            assert len({g0.pool(), g1.pool(), g2.pool()}) == 3


def test_pool_memory_goes_back_when_its_users_are_gone():
    with simulated_accelerator("lazy"):
        s = torch.cuda.Stream()
        x = torch.ones(1000, device="cuda")  # one 4096-byte block
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            tmp = x * 2  # 4096 bytes in the graph's pool
            out = tmp + 1
            del tmp
        torch.cuda.synchronize()
        assert torch.cuda.memory_reserved() == 3 * 4096
        torch.cuda.empty_cache()  # a live graph's pool keeps its free blocks, as in torch
        assert torch.cuda.memory_reserved() == 3 * 4096
        del g
        gc.collect()
        assert torch.cuda.memory_reserved() == 2 * 4096  # tmp's block went back
        del out
        gc.collect()
        assert torch.cuda.memory_reserved() == 4096  # out's too, once freed
        with pytest.raises(RuntimeError, match="pool"):
            torch.cuda.CUDAGraph().pool()  # no capture yet
        with pytest.raises(TypeError, match="memory pool"), torch.cuda.stream(s):
            torch.cuda.CUDAGraph().capture_begin(pool="mine")
        assert not torch.cuda.is_current_stream_capturing()


def test_use_mem_pool_routes_this_threads_allocations():
    with simulated_accelerator("lazy"):
        pool = torch.cuda.MemPool()
        assert isinstance(pool, torch.cuda.MemPool) and pool.allocator is None
        assert pool.use_count() == 1
        with torch.cuda.use_mem_pool(pool):
            assert pool.use_count() == 2
            x = torch.ones(1000, device="cuda")
            where = x.data_ptr()
            del x
            gc.collect()
            y = torch.zeros(1000, device="cuda")
            assert y.data_ptr() == where  # freed in the pool: reused by the pool
        assert pool.use_count() == 1
        del y
        gc.collect()
        z = torch.zeros(1000, device="cuda")
        assert z.data_ptr() != where  # outside the pool: not its memory
        assert torch.cuda.memory_reserved() == 2 * 4096
        with torch.cuda.use_mem_pool(pool):
            w = torch.zeros(1000, device="cuda")
            assert w.data_ptr() == where
        del w, pool
        gc.collect()
        assert torch.cuda.memory_reserved() == 4096  # the pool's block went back
        with pytest.raises(TypeError, match="MemPool"):
            with torch.cuda.use_mem_pool((1, 0)):
                pass
        with pytest.raises(NotImplementedError, match="allocator"):
            torch.cuda.MemPool(allocator=object())
        assert z.sum().item() == 0


def test_pool_names_put_back_on_close():
    real = (torch.cuda.MemPool, torch.cuda.use_mem_pool, torch.cuda.graph_pool_handle,
            torch.cuda.memory.MemPool)
    with simulated_accelerator("lazy"):
        assert torch.cuda.MemPool is not real[0]
        handle = torch.cuda.graph_pool_handle()
        assert isinstance(handle, tuple) and len(handle) == 2
        assert torch.cuda.graph_pool_handle() != handle  # each a new id
    assert (torch.cuda.MemPool, torch.cuda.use_mem_pool, torch.cuda.graph_pool_handle,
            torch.cuda.memory.MemPool) == real


@pytest.mark.parametrize("share", ["no sharing", "via pool()"])
def test_concurrent_replays_of_graphs_sharing_a_pool_race(share):
    """PyTorch's test_graph_concurrent_replay: two graphs replayed on two unordered streams
    corrupt each other's temporaries only when they share a pool (CUDA gives wrong sums);
    the simulator's race detector names the conflicting accesses instead."""
    from pinstage.testing import HazardError

    def temps(t: torch.Tensor, val: float) -> torch.Tensor:
        return (t.clone() + val) + (t.clone() + val)

    with simulated_accelerator("lazy"):
        a = torch.ones(1000, device="cuda")
        g0, g1 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        s, s0, s1 = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            g0.capture_begin()
            b = a.clone()
            for _ in range(3):
                b = temps(b, 1)
            g0.capture_end()
            g1.capture_begin(*((g0.pool(),) if share == "via pool()" else ()))
            c = a.clone()
            for _ in range(3):
                c = temps(c, 2)
            g1.capture_end()
        torch.cuda.synchronize()
        with torch.cuda.stream(s0):
            g0.replay()
        if share == "via pool()":
            with pytest.raises(HazardError, match="stream race"), torch.cuda.stream(s1):
                g1.replay()
            torch.cuda.synchronize()
            return
        with torch.cuda.stream(s1):
            g1.replay()
        torch.cuda.current_stream().wait_stream(s0)
        torch.cuda.current_stream().wait_stream(s1)
        assert b.sum().item() == 1000 * 22  # ((1+1)*2 = 4, (4+1)*2 = 10, 22)
        assert c.sum().item() == 1000 * 36  # ((1+2)*2 = 6, 16, 36)


@pytest.mark.parametrize("mode", ["eager", "lazy", "random"])
def test_a_stream_that_waits_for_a_capture_is_captured_too(mode):
    """CUDA's fork: s2 waits for an event of s1's capture, so its work is part of the graph
    (captured, not run: nothing changes until a replay, and each replay runs it again) until
    the capture ends."""
    with simulated_accelerator(mode):
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        x, y = torch.zeros(4, device="cuda"), torch.zeros(4, device="cuda")
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s1):
            g.capture_begin()
            x.add_(1)
            s2.wait_stream(s1)
            with torch.cuda.stream(s2):
                assert s2.is_capturing() and torch.cuda.is_current_stream_capturing()
                y.add_(10)
            s1.wait_stream(s2)
            g.capture_end()
        assert not s2.is_capturing()
        torch.cuda.synchronize()
        assert x.tolist() == [0.0] * 4 and y.tolist() == [0.0] * 4
        g.replay()
        g.replay()
        torch.cuda.synchronize()
        assert x.tolist() == [2.0] * 4 and y.tolist() == [20.0] * 4


def _reclaim(reuse: str) -> tuple[int, int, int]:
    """data1, used on s2 (record_stream) and freed during a capture on s1; data2 allocated
    before s1 joins s2, data3 after: their addresses."""
    torch.cuda.memory._set_allocator_settings(f"graph_capture_record_stream_reuse:{reuse}")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.stream(s1):
        g.capture_begin()
        sink = torch.empty(8, device="cuda")
        data1 = torch.empty(8, device="cuda")
        p1 = data1.data_ptr()
        s2.wait_stream(s1)
        with torch.cuda.stream(s2):
            out = data1 + 2
            data1.record_stream(s2)
        del data1
        data2 = torch.empty(8, device="cuda")
        s1.wait_stream(s2)
        sink.fill_(1.0)
        data3 = torch.empty(8, device="cuda")
        g.capture_end()
    torch.cuda.synchronize()
    del out
    return p1, data2.data_ptr(), data3.data_ptr()


@pytest.mark.filterwarnings("ignore::FutureWarning")  # (torch deprecates the setter's name)
@pytest.mark.parametrize("mode", ["eager", "lazy", "random"])
def test_memory_freed_in_a_capture_waits_for_the_streams_that_used_it(mode):
    """PyTorch's test_graph_capture_reclaim_2_streams: a block freed during a capture with
    another stream's recorded use is not handed out again while captures are underway (by
    default), or, with graph_capture_record_stream_reuse:True, until the allocating stream
    has joined that stream in the capture."""
    with simulated_accelerator(mode):
        p1, p2, p3 = _reclaim("False")
        assert p1 != p2 and p1 != p3
        p1, p2, p3 = _reclaim("True")
        assert p1 != p2 and p1 == p3
        with pytest.raises(ValueError, match="graph_capture_record_stream_reuse"):
            torch.cuda.memory._set_allocator_settings("graph_capture_record_stream_reuse:1")


@pytest.mark.parametrize("mode", ["eager", "lazy", "random"])
def test_a_fork_not_joined_back_fails_the_capture(mode):
    """CUDA refuses to end a capture while a stream that joined it has work the capturing
    stream never waited for (cudaErrorStreamCaptureUnjoined); joined, it ends."""
    with simulated_accelerator(mode):
        s1, s2, s3 = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
        x = torch.zeros(4, device="cuda")
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s1):
            g.capture_begin()
            s2.wait_stream(s1)
            s3.wait_stream(s2)  # (a fork of the fork)
            with torch.cuda.stream(s3):
                x.add_(1)
            s1.wait_stream(s2)  # (s3's work is not joined)
            with pytest.raises(RuntimeError, match="unjoined work.*stream 3"):
                g.capture_end()
        assert not (s1.is_capturing() or s2.is_capturing() or s3.is_capturing())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s1):
            g.capture_begin()
            s2.wait_stream(s1)
            s3.wait_stream(s2)
            with torch.cuda.stream(s3):
                x.add_(1)
            s2.wait_stream(s3)
            s1.wait_stream(s2)  # (joined through s2)
            g.capture_end()
        g.replay()
        torch.cuda.synchronize()
        assert x.tolist() == [1.0] * 4


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_a_pools_snapshot_is_its_segments(mode):
    """MemPool.snapshot() and memory_snapshot(pool.id): the segments of that pool only, cached
    ones included; a graph's segments carry its pool's id."""
    with simulated_accelerator(mode):
        pool, other = torch.cuda.MemPool(), torch.cuda.MemPool()
        assert pool.snapshot() == [] and torch.cuda.memory_snapshot(pool.id) == []
        outside = torch.ones(1000, device="cuda")  # 4096 bytes, the default pool's
        with torch.cuda.use_mem_pool(pool):
            a = torch.ones(1000, device="cuda")
            b = torch.ones(3000, device="cuda")  # 12000 bytes: 12288
            del a  # cached in the pool
            gc.collect()
            torch.cuda.empty_cache()  # (a pool's cached blocks stay while it has users)
        with torch.cuda.use_mem_pool(other):
            c = torch.ones(10, device="cuda")
        mine = pool.snapshot()
        assert mine == torch.cuda.memory_snapshot(pool.id)
        assert sorted((s["total_size"], s["blocks"][0]["state"]) for s in mine) == [
            (4096, "inactive"), (12288, "active_allocated")]
        assert {s["segment_pool_id"] for s in mine} == {pool.id}
        assert [s["total_size"] for s in other.snapshot()] == [512]
        everything = torch.cuda.memory_snapshot()
        assert len(everything) == 4
        assert [s["segment_pool_id"] for s in everything].count((0, 0)) == 1
        s = torch.cuda.Stream()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            out = outside * 2
        assert [x["total_size"] for x in torch.cuda.memory_snapshot(g.pool())] == [4096]
        pool_id = pool.id
        del pool
        gc.collect()  # its users gone: its cached block goes back, the one in use stays
        assert [(x["total_size"], x["blocks"][0]["state"])
                for x in torch.cuda.memory_snapshot(pool_id)] == [(12288, "active_allocated")]
        del b, c, out
