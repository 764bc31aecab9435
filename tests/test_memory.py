"""Pinned memory accounting and the staging arena."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import pinstage
from pinstage._memory import device_state, parse_size
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
    import mmap

    with simulated_accelerator() as sim:
        pinstage.capabilities(sim.device)  # the probe's own page is pinned first
        before = pinstage.host_memory_stats()
        buf = pinstage.CpuGpuBuffer(1000, dtype=torch.int32, device=sim.device)
        after = pinstage.host_memory_stats()
        assert after["requested_bytes"] - before["requested_bytes"] == 4000
        reserved = after["reserved_bytes"] - before["reserved_bytes"]
        assert 4000 <= reserved <= 4000 + mmap.PAGESIZE  # exact size plus alignment
        del buf
        gc.collect()
        sim.synchronize()  # freed pinned memory waits for the device, if it is fenced
        final = pinstage.host_memory_stats()
        assert after["reserved_bytes"] - final["reserved_bytes"] >= reserved  # given back
        assert final["requested_bytes"] == before["requested_bytes"]


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
        assert device_state(sim.backend).arena().reserved <= 8192
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
        for _ in range(60):
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
            np.testing.assert_array_equal(o.cpu().numpy(), e)


def test_request_larger_than_cap_goes_in_pieces(monkeypatch):
    monkeypatch.setenv("PINSTAGE_STAGING_LIMIT", "4KiB")
    with simulated_accelerator("lazy") as sim:
        data = np.arange(5000, dtype=np.int64)  # 40 KB through a 4 KiB cap
        out = pinstage.async_tensor_h2d(data, sim.device)
        sim.synchronize()
        np.testing.assert_array_equal(out.cpu().numpy(), data)
        assert sim.stats.copies >= 10


def test_ring_arena_directly():
    """Unit test of the ring: regions wrap, never overlap a live one."""
    with simulated_accelerator("lazy") as sim:
        arena = pinstage._memory.StagingArena(sim.backend, limit=4096, initial=4096)
        live = []
        for _ in range(40):
            r = arena.alloc(1000)
            live = [x for x in live if not (x.fenced and x.fence.done())]
            for other in live:
                assert r.end <= other.start or other.end <= r.start
            sim.backend.launch(lambda: None)  # a reader of r
            arena.release(r)
            live.append(r)
        assert arena.reserved == 4096


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
        reserved = device_state(sim.backend).arena().reserved
        for i in range(5, 60):
            step(i)
        assert pinstage.host_memory_stats()["reserved_bytes"] == before
        assert device_state(sim.backend).arena().reserved == reserved
        assert sim.stats.host_stalls == 0


# --------------------------------------------------------------------------------------------
# The staging limit, per-device state, pins, lifetime of pinned memory


@pytest.mark.parametrize("value", ["63", "100", "4095", "1KiB"])
def test_staging_limit_below_the_minimum_raises_naming_it(monkeypatch, value):
    monkeypatch.setenv("PINSTAGE_STAGING_LIMIT", value)
    with simulated_accelerator("eager") as sim:
        with pytest.raises(ValueError, match="minimum.*4096"):
            pinstage.async_tensor_h2d(np.arange(4), sim.device)


def test_staging_limit_is_read_once_per_device(monkeypatch):
    from pinstage._memory import staging_limit_in_force

    monkeypatch.setenv("PINSTAGE_STAGING_LIMIT", "8KiB")
    with simulated_accelerator("lazy") as sim:
        pinstage.async_tensor_h2d(np.arange(10), sim.device)
        monkeypatch.setenv("PINSTAGE_STAGING_LIMIT", "64KiB")  # too late for this device
        assert staging_limit_in_force(sim.device) == 8192
        data = np.arange(3000)  # 24 KB: must still go in pieces through the 8 KiB arena
        out = pinstage.async_tensor_h2d(data, sim.device)
        assert device_state(sim.backend).arena().reserved <= 8192
        sim.synchronize()
        np.testing.assert_array_equal(out.cpu().numpy(), data)


def test_staging_limit_in_force_is_none_without_pinned_staging():
    from pinstage._memory import staging_limit_in_force

    assert staging_limit_in_force("cpu") is None
    with simulated_accelerator(pin_memory=False) as sim:
        assert staging_limit_in_force(sim.device) is None


def test_stats_per_device_and_totals(quiet_gc):
    with simulated_accelerator("lazy") as sim:
        total0 = pinstage.host_memory_stats()
        dev0 = pinstage.host_memory_stats(sim.device)
        assert set(dev0) == set(total0) >= {"reserved_bytes", "in_use_bytes",
                                            "peak_in_use_bytes", "requested_bytes", "waits",
                                            "pins"}
        buf = pinstage.CpuGpuBuffer(1000, dtype=torch.int32, device=sim.device)
        pinstage.async_tensor_h2d(np.arange(100), sim.device)  # staged, not read yet
        total1 = pinstage.host_memory_stats()
        dev1 = pinstage.host_memory_stats(sim.device)
        for key in ("reserved_bytes", "in_use_bytes", "requested_bytes", "pins"):
            grew = dev1[key] - dev0[key]
            assert grew > 0, key
            assert total1[key] - total0[key] == grew, key  # the device's part of the total
        assert dev1["requested_bytes"] - dev0["requested_bytes"] == 4000 + 800
        sim.synchronize()
        del buf


def test_pins_count_every_pinned_allocation(quiet_gc):
    with simulated_accelerator("eager") as sim:
        pinstage.capabilities(sim.device)  # (the probe pins a page of its own)
        pins0 = pinstage.host_memory_stats()["pins"]
        bufs = [pinstage.CpuGpuBuffer(16, dtype=torch.int64, device=sim.device)
                for _ in range(3)]
        assert pinstage.host_memory_stats()["pins"] == pins0 + 3
        del bufs


@pytest.mark.parametrize("mode", ["eager", "lazy", "random"])
def test_np_to_pinned_tensor_pins_nothing_in_steady_state(mode, quiet_gc):
    """200 calls, each result copied to the device, synchronized now and then: after warm-up
    the memory comes from what pinstage already pinned, and every copy is right."""
    with simulated_accelerator(mode, seed=11) as sim:
        pending = []
        pins = None
        pinstage.capabilities(sim.device)  # (the probe's own page is pinned first)
        pins0 = pinstage.host_memory_stats(sim.device)["pins"]  # this device's: not another
        # test's threads or devices
        for i in range(300):
            a = np.arange(1000, dtype=np.int64) + i
            t = pinstage.np_to_pinned_tensor(a)
            assert bool(t.is_pinned()) or sim.backend.is_pinned(t)
            pending.append((a, pinstage.async_tensor_h2d(t, sim.device)))
            del t  # the copy may not have run yet: its memory must wait for it
            if i % 10 == 9:
                pinstage.synchronize(sim.device)
                for expected, out in pending:
                    np.testing.assert_array_equal(out.cpu().numpy(), expected)
                pending.clear()
            if i == 99:  # warm-up: the pool holds what the deepest queue needs
                pins = pinstage.host_memory_stats(sim.device)["pins"]
        if mode == "random":
            # Seeded random progress can make a deeper queue late: the pool grows to cover
            # it, never past one slab per call between synchronizations.
            assert pinstage.host_memory_stats(sim.device)["pins"] <= pins0 + 11
        else:
            assert pinstage.host_memory_stats(sim.device)["pins"] == pins


def test_np_to_pinned_tensor_memory_is_reused_only_after_the_device_read_it():
    with simulated_accelerator("lazy") as sim:
        a = np.arange(512, dtype=np.int64)
        t = pinstage.np_to_pinned_tensor(a)
        out = pinstage.async_tensor_h2d(t, sim.device)  # read in place, later
        ptr = t.data_ptr()
        del t
        b = pinstage.np_to_pinned_tensor(np.full(512, -1, dtype=np.int64))
        assert b.data_ptr() != ptr  # the copy has not read the first one yet
        sim.synchronize()
        np.testing.assert_array_equal(out.cpu().numpy(), a)


def test_pinned_regions_are_private_to_the_process():
    """A forked child writing into pinned memory must not change the parent's."""
    import os

    from pinstage._memory import HostRegion

    if not hasattr(os, "fork"):
        pytest.skip("needs fork")
    region = HostRegion(4096)
    mem = region.as_tensor()
    mem.fill_(1)
    pid = os.fork()
    if pid == 0:
        mem.fill_(2)
        os._exit(0)
    os.waitpid(pid, 0)
    assert bool((mem == 1).all())


def _unowned_view(ptr, n):
    """A tensor over ``n`` bytes at ``ptr`` that does not keep their owner alive (as a real
    device's queued copy does not)."""
    import ctypes

    return torch.from_numpy(np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr)))


class _FenceLog:
    """Events that complete only when told, to see when parked memory is given back."""

    def __init__(self):
        from async_device import AsyncDevice

        self.dev = AsyncDevice(streams=2)
        self.unpinned = []

    def region(self, n=4096):
        from pinstage._memory import HostRegion

        return HostRegion(n, unpin=lambda ptr, size: self.unpinned.append(ptr),
                          backend=self.dev)


def test_dropped_pinned_memory_waits_for_the_device(quiet_gc):
    """A region dropped while a copy on another stream still reads it is unpinned only after
    that copy completed: fences go on the stream current at the drop and on every stream
    pinstage fenced on."""
    from pinstage._memory import StagingArena, device_state

    log = _FenceLog()
    dev = log.dev
    try:
        arena = StagingArena(dev, limit=4096, initial=4096)
        dev.use_stream(1)
        with arena.staging(64):
            pass
        arena.drain()  # pinstage has now fenced on stream 1
        s1 = dev.streams[1]
        with s1.lock:
            s1.paused = True
        region = log.region()
        region.as_tensor().fill_(5)
        dst = torch.zeros(4096, dtype=torch.uint8)
        dev.copy_h2d(dst, _unowned_view(region.ptr, 4096))  # queued on the paused stream 1
        ptr = region.ptr
        dev.use_stream(0)  # dropped while stream 0 is current
        reserved = pinstage.host_memory_stats(dev.device)  # noqa: F841 - (another device)
        del region
        gc.collect()
        state = device_state(dev)
        state.collect()
        assert log.unpinned == []  # stream 1 has not read it yet
        with s1.lock:
            s1.paused = False
            s1.cond.notify_all()
        dev.synchronize()
        state.collect()
        assert log.unpinned == [ptr]
        assert bool((dst == 5).all())
    finally:
        dev.close()


def test_dropped_pinned_memory_is_released_at_exit():
    """At interpreter exit pinstage waits for the device, then unpins what is parked."""
    import subprocess
    import sys

    code = (
        "import sys; sys.path.insert(0, 'tests')\n"
        "import torch\n"
        "from async_device import AsyncDevice\n"
        "from pinstage._memory import HostRegion\n"
        "from test_memory import _unowned_view\n"
        "dev = AsyncDevice(streams=1)\n"
        "s = dev.streams[0]\n"
        "s.paused = True\n"
        "def unpin(ptr, size): print('unpinned after', s.done, 'of', s.queued, flush=True)\n"
        "r = HostRegion(4096, unpin=unpin, backend=dev)\n"
        "dst = torch.zeros(4096, dtype=torch.uint8)\n"
        "dev.copy_h2d(dst, _unowned_view(r.ptr, 4096))\n"
        "del r\n"
        "import threading\n"
        "threading.Timer(0.2, lambda: setattr(s, 'paused', False)).start()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=str(__import__("pathlib").Path(__file__).parents[1]))
    assert proc.returncode == 0, proc.stderr
    assert "unpinned after 1 of 1" in proc.stdout, (proc.stdout, proc.stderr)
