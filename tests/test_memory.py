"""Pinned memory accounting and the staging arena."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import pinstage
from pinstage._memory import parse_size
from pinstage.testing import HazardError, simulated_accelerator


def test_parse_size():
    assert parse_size("64MiB") == 64 * 2**20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size(4096) == 4096
    assert parse_size("4096") == 4096
    for bad in ("lots", "-1", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(TypeError):
        parse_size(1.5)  # type: ignore[arg-type]


def test_exact_size_accounting_for_buffers(quiet_gc):
    with simulated_accelerator() as sim:
        before = pinstage.host_memory_stats()
        buf = pinstage.CpuGpuBuffer(1000, dtype=torch.int32, device=sim.device)
        after = pinstage.host_memory_stats()
        assert after["requested_bytes"] - before["requested_bytes"] == 4000
        reserved = after["reserved_bytes"] - before["reserved_bytes"]
        assert 4000 <= reserved <= 4000 + 64  # exact size plus alignment, no power of two
        del buf
        gc.collect()
        assert pinstage.host_memory_stats()["reserved_bytes"] == before["reserved_bytes"]


def test_staging_regions_are_released_after_the_device_read_them():
    with simulated_accelerator("lazy") as sim:
        pinstage.async_tensor_h2d(np.arange(100), sim.device)
        s = pinstage.host_memory_stats()
        assert s["in_use_bytes"] >= 800  # the device has not read it yet
        sim.synchronize()
        s2 = pinstage.host_memory_stats()
        assert s2["in_use_bytes"] <= s["in_use_bytes"] - 800
        assert s2["peak_in_use_bytes"] >= s["in_use_bytes"]


def test_full_arena_waits_and_counts(monkeypatch):
    monkeypatch.setenv("PINSTAGE_STAGING_LIMIT", "8KiB")
    with simulated_accelerator("lazy") as sim:
        waits0 = pinstage.host_memory_stats()["waits"]
        outs = [pinstage.async_tensor_h2d(np.full(256, i, np.int64), sim.device)
                for i in range(12)]  # 2 KiB each: the 8 KiB ring fills
        assert pinstage.host_memory_stats()["waits"] > waits0
        assert sim.stats.host_stalls > 0
        assert sim.backend.arena().reserved <= 8192
        sim.synchronize()
        for i, o in enumerate(outs):
            assert bool((o == i).all())


@pytest.mark.parametrize("seed", range(25))
def test_arena_never_hands_out_memory_the_device_may_read(monkeypatch, seed):
    """Random sizes through a tiny ring, random interleaving: a reused region that the device
    had not read yet would raise HazardError (the simulator snapshots each staged source)."""
    monkeypatch.setenv("PINSTAGE_STAGING_LIMIT", "4KiB")
    rng = np.random.default_rng(seed)
    with simulated_accelerator("random", seed=seed) as sim:
        expected, outs = [], []
        for i in range(60):
            n = int(rng.integers(1, 200))
            data = rng.integers(-1000, 1000, n)
            if rng.integers(2):
                outs.append(pinstage.async_tensor_h2d(data, sim.device))
                expected.append(data)
            else:
                many = pinstage.h2d_many([data, data[:3]], sim.device)
                outs.extend(many)
                expected.extend([data, data[:3]])
        sim.synchronize()
        for e, o in zip(expected, outs):
            np.testing.assert_array_equal(o.numpy(), e)


def test_request_larger_than_cap_goes_in_pieces(monkeypatch):
    monkeypatch.setenv("PINSTAGE_STAGING_LIMIT", "4KiB")
    with simulated_accelerator("lazy") as sim:
        data = np.arange(5000, dtype=np.int64)  # 40 KB through a 4 KiB cap
        out = pinstage.async_tensor_h2d(data, sim.device)
        sim.synchronize()
        np.testing.assert_array_equal(out.numpy(), data)
        assert sim.stats.copies >= 10


def test_ring_arena_directly():
    """Unit test of the ring: regions wrap, never overlap a live one."""
    with simulated_accelerator("lazy") as sim:
        arena = pinstage._memory.StagingArena(sim.backend, limit=4096, initial=4096)
        live = []
        for i in range(40):
            r = arena.alloc(1000)
            live = [x for x in live if not (x.fenced and sim.backend.event_done(x.event))]
            for other in live:
                assert r.end <= other.start or other.end <= r.start
            sim.backend.launch(lambda: None)  # a reader of r
            arena.release(r)
            live.append(r)
        assert arena.reserved == 4096
        assert sim.stats.host_stalls > 0  # the ring wrapped onto unread regions and waited


def test_stats_shape():
    s = pinstage.host_memory_stats()
    assert set(s) >= {"reserved_bytes", "in_use_bytes", "peak_in_use_bytes", "requested_bytes",
                      "waits"}
    assert all(isinstance(v, int) and v >= 0 for v in s.values())


def test_hazard_error_is_runtime_error():
    assert issubclass(HazardError, RuntimeError)


@pytest.mark.parametrize("mode", ["eager", "random"])
def test_steady_state_allocates_no_pinned_memory(mode, quiet_gc):
    """After warm-up, engine-like steps reuse the arena and the pools: nothing new is pinned."""
    with simulated_accelerator(mode, seed=4) as sim:
        swt = pinstage.StagedWriteTensor((64, 32), torch.int32, sim.device)
        pool = pinstage.UvaBufferPool((64,), torch.int64, device=sim.device)
        buf = pinstage.CpuGpuBuffer(64, dtype=torch.int32, device=sim.device)

        def step(i):
            pinstage.async_tensor_h2d(list(range(64)), sim.device, dtype=torch.int32)
            pinstage.async_tensor_h2d(np.arange(100) + i, sim.device)
            pinstage.h2d_many([[i] * 8, np.arange(5)], sim.device)
            for r in range(64):
                swt.stage_write(r, i % 28, [r, i, r, i])
            swt.apply_write()
            pool.copy_to_uva(np.arange(40) + i)
            buf.copy_to_gpu(32)
            sim.synchronize()  # the engine reads this step's results

        for i in range(5):
            step(i)
        before = pinstage.host_memory_stats()["reserved_bytes"]
        reserved = sim.backend.arena().reserved
        for i in range(5, 60):
            step(i)
        assert pinstage.host_memory_stats()["reserved_bytes"] == before
        assert sim.backend.arena().reserved == reserved
        assert sim.stats.host_stalls == 0
