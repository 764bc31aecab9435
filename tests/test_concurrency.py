"""The staging arena under threads, interrupts and fork.

Two kinds of device run here: the CPU target and the simulator (through the public API), and
``AsyncDevice`` (tests/async_device.py): a small thread-safe device with one worker thread per
stream that runs queued copies late and in its own time. It drives the arena (``StagingArena``,
through the device seam) under real concurrency, where a region reused before its copy ran
shows up as a wrong result, and an event recorded on the wrong stream as well.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from async_device import AsyncDevice
from helpers import run_threads

import pinstage
from pinstage._memory import StagingArena
from pinstage.testing import simulated_accelerator

SIM_MODES = ["eager", "lazy", "random"]


@pytest.fixture
def async_device() -> Iterator[AsyncDevice]:
    dev = AsyncDevice()
    yield dev
    dev.close()


# --------------------------------------------------------------------------------------------
# Stress: N threads x M uploads x random sizes x tiny caps


def _stage_upload(arena: StagingArena, dev: AsyncDevice, data: np.ndarray) -> torch.Tensor:
    """What async_tensor_h2d does through the seam: fill a region, queue its copy, release."""
    out = torch.full((data.size,), -1, dtype=torch.int64)
    with arena.staging(data.nbytes) as region:
        staged = region.tensor(data.nbytes).view(torch.int64)
        staged.copy_(torch.from_numpy(data))
        dev.copy_h2d(out, staged, pinned=True)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cap", [4096, 16384])
def test_arena_threads_on_an_asynchronous_device(async_device, cap):
    """8 threads on two streams stage random sizes through a tiny arena while the device runs
    the copies late: every result matches its input (a region reused before its copy ran, or
    fenced on the wrong stream, would not), nothing hangs, and everything comes back."""
    dev = async_device
    arena = StagingArena(dev, limit=cap, initial=cap)
    results: list[list[tuple[np.ndarray, torch.Tensor]]] = [[] for _ in range(8)]

    def worker(i: int) -> None:
        dev.use_stream(i % 2)
        rng = np.random.default_rng(i)
        for k in range(150):
            n = int(rng.integers(1, cap // 8 // 2))
            data = rng.integers(-2**40, 2**40, n)
            results[i].append((data, _stage_upload(arena, dev, data)))
            if k % 50 == 49:
                arena.drain()

    run_threads(worker, 8, timeout_s=90)
    dev.synchronize()
    assert not dev.errors()
    for per_thread in results:
        for data, out in per_thread:
            np.testing.assert_array_equal(out.numpy(), data)
    arena.drain()
    assert arena.live == 0
    assert arena.reserved <= cap


@pytest.mark.timeout(120)
def test_arena_threads_wait_for_regions_being_filled(async_device):
    """A thread that finds the arena full of regions other threads are still filling waits
    for them (counted in ``waits``) instead of failing."""
    dev = async_device
    arena = StagingArena(dev, limit=4096, initial=4096)
    filling = threading.Event()
    waits0 = arena.state.stats.waits

    def slow(_: int) -> None:
        with arena.staging(4096) as region:  # the whole arena
            filling.set()
            time.sleep(0.3)
            region.tensor().fill_(1)

    def eager(_: int) -> None:
        filling.wait(5)
        with arena.staging(64) as region:
            region.tensor().fill_(2)

    t = threading.Thread(target=slow, args=(0,), daemon=True)
    t.start()
    run_threads(eager, 4, timeout_s=30)
    t.join(10)
    assert not t.is_alive()
    assert arena.state.stats.waits > waits0


def _upload_target(device: Any, rng: np.random.Generator, cap: int) -> tuple[Any, Any]:
    n = int(rng.integers(1, max(2, cap // 8)))
    data = rng.integers(-1000, 1000, n)
    if rng.integers(3) == 0:
        parts = [data, data[: n // 2 + 1].astype(np.int32), list(range(int(rng.integers(1, 9))))]
        return parts, pinstage.h2d_many(parts, device)
    if rng.integers(2) == 0:
        return data, pinstage.async_tensor_h2d(data, device)
    return data.tolist(), pinstage.async_tensor_h2d(data.tolist(), device, dtype=torch.int64)


def _check(expected: Any, got: Any) -> None:
    if isinstance(got, tuple):
        for e, g in zip(expected, got):
            np.testing.assert_array_equal(g.cpu().numpy(), np.asarray(e))
    else:
        np.testing.assert_array_equal(got.cpu().numpy(), np.asarray(expected))


def _stress(device: Any, sync: Callable[[], None], cap: int, threads: int = 8,
            uploads: int = 60) -> None:
    results: list[list[tuple[Any, Any]]] = [[] for _ in range(threads)]

    def worker(i: int) -> None:
        rng = np.random.default_rng(1000 + i)
        for _ in range(uploads):
            results[i].append(_upload_target(device, rng, cap))

    run_threads(worker, threads, timeout_s=90)
    sync()
    for per_thread in results:
        for expected, got in per_thread:
            _check(expected, got)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cap", ["4KiB", "16KiB"])
def test_stress_cpu_target(monkeypatch, cap):
    monkeypatch.setenv("PINSTAGE_STAGING_LIMIT", cap)
    _stress("cpu", lambda: pinstage.synchronize("cpu"), pinstage._memory.parse_size(cap))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cap", ["4KiB", "16KiB"])
@pytest.mark.parametrize("mode", SIM_MODES)
def test_stress_simulator_threads(monkeypatch, mode, cap):
    monkeypatch.setenv("PINSTAGE_STAGING_LIMIT", cap)
    with simulated_accelerator(mode, seed=3) as sim:
        _stress(sim.device, sim.synchronize, pinstage._memory.parse_size(cap))
        sim.synchronize()
        assert pinstage.host_memory_stats(sim.device)["in_use_bytes"] == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", SIM_MODES)
def test_stress_simulator_one_thread(monkeypatch, mode):
    """The same random uploads from one thread through a 4 KiB cap on the simulator."""
    monkeypatch.setenv("PINSTAGE_STAGING_LIMIT", "4KiB")
    with simulated_accelerator(mode, seed=5) as sim:
        _stress(sim.device, sim.synchronize, 4096, threads=1, uploads=300)
        pinstage.synchronize(sim.device)
        assert pinstage.host_memory_stats(sim.device)["in_use_bytes"] == 0


# --------------------------------------------------------------------------------------------
# Interrupts


class _Interrupter:
    """Fires ``KeyboardInterrupt`` in the main thread after a random delay (a timer signal)."""

    def __init__(self, seed: int, max_delay_s: float) -> None:
        self.rng = random.Random(seed)
        self.max_delay_s = max_delay_s
        self.fired = 0

    def _handler(self, signum: int, frame: Any) -> None:
        self.fired += 1
        raise KeyboardInterrupt

    def __enter__(self) -> _Interrupter:
        self.old = signal.signal(signal.SIGALRM, self._handler)
        return self

    def arm(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 1e-6 + self.rng.random() * self.max_delay_s)

    def disarm(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)

    def __exit__(self, *exc: Any) -> None:
        self.disarm()
        signal.signal(signal.SIGALRM, self.old)


needs_alarm = pytest.mark.skipif(not hasattr(signal, "setitimer") or
                                 threading.current_thread() is not threading.main_thread(),
                                 reason="needs SIGALRM timers in the main thread")


def _interrupted_loop(body: Callable[[int], None], iterations: int, seed: int,
                      max_delay_s: float) -> int:
    caught = 0
    with _Interrupter(seed, max_delay_s) as intr:
        for i in range(iterations):
            try:
                intr.arm()
                body(i)
                intr.disarm()
            except KeyboardInterrupt:
                caught += 1
            finally:
                try:
                    intr.disarm()
                except KeyboardInterrupt:
                    caught += 1
        # one still pending from the last arm would land here
        try:
            time.sleep(0.001)
        except KeyboardInterrupt:
            caught += 1
    gc.collect()  # owners of interrupted calls that sit in reference cycles
    return caught


@needs_alarm
@pytest.mark.timeout(180, method="thread")
def test_interrupts_leak_no_staging_on_an_asynchronous_device(async_device):
    """KeyboardInterrupt at random points of staged uploads leaks no region: afterwards the
    arena takes everything back and still works."""
    dev = async_device
    arena = StagingArena(dev, limit=4096, initial=4096)
    rng = np.random.default_rng(0)

    def body(i: int) -> None:
        data = rng.integers(0, 100, int(rng.integers(1, 200)))
        out = _stage_upload(arena, dev, data)
        dev.synchronize()
        np.testing.assert_array_equal(out.numpy(), data)

    caught = _interrupted_loop(body, 3000, seed=1, max_delay_s=40e-6)
    assert caught > 100  # the interrupts did land
    dev.synchronize()
    arena.drain()
    assert arena.live == 0
    data = np.arange(500)
    out = _stage_upload(arena, dev, data)  # still works, in full
    dev.synchronize()
    np.testing.assert_array_equal(out.numpy(), data)


@needs_alarm
@pytest.mark.timeout(180, method="thread")
@pytest.mark.parametrize("mode", SIM_MODES)
def test_interrupts_leak_no_staging_memory(monkeypatch, mode):
    """KeyboardInterrupt at random points of async_tensor_h2d / h2d_many / np_to_pinned_tensor
    on the simulator: after synchronize nothing is in use and the arena still works."""
    monkeypatch.setenv("PINSTAGE_STAGING_LIMIT", "4KiB")
    with simulated_accelerator(mode, seed=7) as sim:
        base = pinstage.host_memory_stats(sim.device)["in_use_bytes"]
        rng = np.random.default_rng(1)

        def body(i: int) -> None:
            data = rng.integers(0, 100, int(rng.integers(1, 300)))
            k = i % 3
            if k == 0:
                pinstage.async_tensor_h2d(data, sim.device)
            elif k == 1:
                pinstage.h2d_many([data, data[:5]], sim.device)
            else:
                pinstage.np_to_pinned_tensor(data)

        caught = _interrupted_loop(body, 1500, seed=2, max_delay_s=60e-6)
        assert caught > 50
        sim.synchronize()
        pinstage.synchronize(sim.device)
        assert pinstage.host_memory_stats(sim.device)["in_use_bytes"] == base
        data = np.arange(2000)  # larger than the cap: goes in pieces, so the ring is usable
        out = pinstage.async_tensor_h2d(data, sim.device)
        sim.synchronize()
        np.testing.assert_array_equal(out.cpu().numpy(), data)


def test_exception_inside_staging_releases_the_region(async_device):
    arena = StagingArena(async_device, limit=4096, initial=4096)
    with pytest.raises(ZeroDivisionError):
        with arena.staging(4096):
            raise ZeroDivisionError
    with arena.staging(4096):  # the whole arena again: the first region came back
        pass
    arena.drain()
    assert arena.live == 0


def test_owner_that_dies_without_releasing_gives_its_region_back(async_device):
    """The safety net behind interrupt safety: a Staging that dies without ``__exit__`` (an
    interrupt landed where it could not run) hands its region back."""
    arena = StagingArena(async_device, limit=4096, initial=4096)
    holder = arena.staging(4096)
    holder.__enter__()  # and never __exit__
    del holder
    with arena.staging(4096):  # would wait forever if the region were lost
        pass
    arena.drain()
    assert arena.live == 0


def test_same_thread_holding_the_arena_raises_instead_of_hanging(async_device):
    arena = StagingArena(async_device, limit=4096, initial=4096)
    region = arena.alloc(4096)
    with pytest.raises(RuntimeError, match="has not released"):
        arena.alloc(64)
    arena.release(region)
    arena.release(arena.alloc(64))


# --------------------------------------------------------------------------------------------
# Streams


@pytest.mark.timeout(60)
def test_fence_is_on_the_stream_that_read_the_region(async_device):
    """A region released on stream 1 is reused only after stream 1's copy ran, even when
    stream 0 is current when the arena needs the space."""
    dev = async_device
    arena = StagingArena(dev, limit=4096, initial=4096)
    s1 = dev.streams[1]
    with s1.lock:
        s1.paused = True
    dev.use_stream(1)
    data = np.arange(512)  # 4 KiB: the whole arena
    out = _stage_upload(arena, dev, data)  # its copy waits on the paused stream 1
    dev.use_stream(0)
    arena.drain()  # must fence on stream 1, not on the current stream 0
    got: list[torch.Tensor] = []

    def second(_: int) -> None:
        dev.use_stream(0)
        got.append(_stage_upload(arena, dev, np.full(512, 7)))

    t = threading.Thread(target=second, args=(0,), daemon=True)
    t.start()
    t.join(0.3)
    assert t.is_alive(), "the region was reused while stream 1 had not read it"
    with s1.lock:
        s1.paused = False
        s1.cond.notify_all()
    t.join(10)
    assert not t.is_alive()
    dev.synchronize()
    np.testing.assert_array_equal(out.numpy(), data)
    assert set(dev.records) >= {1}


# --------------------------------------------------------------------------------------------
# fork


def _wait_child(pid: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"forked child {pid} still running after {timeout_s} s (hung)")


def _fork_while(hammer: Callable[[threading.Event, int], None],
                child: Callable[[], bool], forks: int = 50) -> None:
    assert child()  # warm up in the parent: lazy imports done before threads race to them
    stop = threading.Event()
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            hammer(stop, i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    try:
        for _ in range(forks):
            time.sleep(0.002)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the child: one upload, checked, then out without cleanup
                ok = False
                try:
                    ok = child()
                finally:
                    os._exit(0 if ok else 1)
            assert _wait_child(pid, 20) == 0, "the forked child's upload failed"
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]


needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


@needs_fork
@pytest.mark.timeout(240)
def test_fork_while_threads_stage_on_an_asynchronous_device(async_device):
    """Fork 50 times while 4 threads stage through an arena (holding its lock much of the
    time): each child stages, copies and checks an upload on a device of its own."""
    dev = async_device
    arena = StagingArena(dev, limit=16384, initial=16384)

    def hammer(stop: threading.Event, i: int) -> None:
        dev.use_stream(i % 2)
        rng = np.random.default_rng(i)
        while not stop.is_set():
            data = rng.integers(0, 100, int(rng.integers(1, 300)))
            _stage_upload(arena, dev, data)
            arena.drain()

    def child() -> bool:
        mine = AsyncDevice(max_delay_s=0)
        try:
            a = StagingArena(mine, limit=4096, initial=4096)
            data = np.arange(300)
            out = _stage_upload(a, mine, data)
            mine.synchronize()
            b = pinstage.host_memory_stats()  # the process-wide lock is usable too
            return bool(np.array_equal(out.numpy(), data)) and b["in_use_bytes"] >= 0
        finally:
            mine.close()

    _fork_while(hammer, child)


@needs_fork
@pytest.mark.timeout(240)
def test_fork_while_threads_upload_on_the_cpu_target():
    def hammer(stop: threading.Event, i: int) -> None:
        rng = np.random.default_rng(i)
        while not stop.is_set():
            _check(*_upload_target("cpu", rng, 4096))
            pinstage.host_memory_stats()

    def child() -> bool:
        data = np.arange(100)
        out = pinstage.async_tensor_h2d(data, "cpu")
        many = pinstage.h2d_many([data, [1, 2]], "cpu")
        return bool(np.array_equal(out.numpy(), data) and many[1].tolist() == [1, 2])

    _fork_while(hammer, child)


@needs_fork
@pytest.mark.timeout(240)
def test_fork_while_threads_upload_on_the_simulator(monkeypatch):
    monkeypatch.setenv("PINSTAGE_STAGING_LIMIT", "16KiB")
    with simulated_accelerator("eager") as sim:
        def hammer(stop: threading.Event, i: int) -> None:
            rng = np.random.default_rng(i)
            while not stop.is_set():
                _upload_target(sim.device, rng, 16384)

        parent = [True]

        def child() -> bool:
            """In the parent (the warm-up) the simulated CUDA works; in a forked child it is
            in a bad fork, as CUDA is: its calls raise, pinstage says why and works on the
            CPU target."""
            data = np.arange(100)
            if parent[0]:
                parent[0] = False
                out = pinstage.async_tensor_h2d(data, sim.device)
                sim.synchronize()
                return bool(np.array_equal(out.cpu().numpy(), data))
            try:
                torch.cuda.current_stream()
            except RuntimeError as exc:
                if "forked subprocess" not in str(exc):
                    return False
            else:
                return False
            try:
                pinstage.async_tensor_h2d(data, "cuda")
            except pinstage.UnavailableError as exc:
                if "forked" not in str(exc):
                    return False
            else:
                return False
            target = pinstage.capabilities().device  # the default target: the CPU now
            out = pinstage.async_tensor_h2d(data, target)
            return target.type == "cpu" and bool(np.array_equal(out.numpy(), data))

        _fork_while(hammer, child)


@needs_fork
@pytest.mark.timeout(240)
def test_objects_made_before_a_fork_work_in_the_child():
    """Issue 20: a table, a fused writer, a non-UVA buffer and a pool that parent threads are
    using at the moment of the fork work in the child: their locks are made anew there (the
    threads that held them are not in the child)."""
    table = pinstage.StagedWriteTensor((8, 64), torch.int32, "cpu")
    other = pinstage.StagedWriteTensor((8, 64), torch.int32, "cpu")
    writer = pinstage.FusedStagedWriter("cpu", max_writes=64)
    buf = pinstage.NonUvaBuffer((256,), torch.int64, "cpu")
    pool = pinstage.UvaBufferPool((64,), torch.int64, max_concurrency=2, device="cpu")

    def hammer(stop: threading.Event, i: int) -> None:
        rows = list(range(1, 8))
        while not stop.is_set():
            if i % 3 == 0:
                for r in rows:
                    table.stage_write(r, 0, list(range(64)))
                table.apply_write()
            elif i % 3 == 1:
                other.stage_write(1 + i % 7, 0, [i] * 64)
                writer.apply([table, other])
            else:
                with contextlib.suppress(RuntimeError):  # two hammers share buf: busy is fine
                    buf.uva()
                pool.copy_to_uva(list(range(64)))

    def child() -> bool:
        table.stage_write(0, 0, [7] * 64)
        table.apply_write()
        other.stage_write(0, 0, [5] * 64)
        writer.apply([table, other])
        buf.cpu[:3] = torch.tensor([1, 2, 3])
        up = buf.uva(3)
        got = pool.copy_to_uva([9, 8])
        return (table.gpu[0].tolist() == [7] * 64 and other.gpu[0].tolist() == [5] * 64
                and up.tolist() == [1, 2, 3] and got.tolist() == [9, 8])

    _fork_while(hammer, child, forks=60)
