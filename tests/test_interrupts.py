"""Interrupts everywhere (issue 20): a ``KeyboardInterrupt`` at any point of a public call
leaves no lock held and no staging memory leaked, and the next call works with the right data.

Two kinds of interrupt:
* injected at every line pinstage executes during a call (tests/interrupts.py: the harshest
  form, between any two lines of pinstage's own modules; the simulator's machinery is left
  out of the injection, it is the device here), one point per run;
* timed signals (``signal.setitimer``), thousands of them, landing where CPython delivers them.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from interrupts import interrupt_at, line_events

import pinstage
from pinstage._host import LOCK
from pinstage.testing import simulated_accelerator

NOT_SIM = lambda fn: "/_sim/" not in fn  # noqa: E731 - (the injector's filter)
TARGETS = ["cpu", "eager", "lazy", "random"]


@contextlib.contextmanager
def target(name: str, **kw: Any) -> Iterator[tuple[torch.device, Callable[[], None]]]:
    if name == "cpu":
        yield torch.device("cpu"), lambda: None
        return
    with simulated_accelerator(name, seed=1, **kw) as sim:
        yield sim.device, sim.synchronize


def _free(lock: Any) -> bool:
    """Whether ``lock`` is free now. The tests run one thread, so a lock left held is held by
    this thread (an ``RLock`` would let it in again: ask it) or by nobody who will release it."""
    is_owned = getattr(lock, "_is_owned", None)
    if is_owned is not None and is_owned():
        return False
    if not lock.acquire(False):
        return False
    lock.release()
    return True


def _in_use(device: torch.device) -> tuple[int, int]:
    stats = pinstage.host_memory_stats(device)
    return stats["in_use_bytes"], stats["requested_bytes"]


def _clean(device: torch.device, sync: Callable[[], None], locks: list[Any],
           held: tuple[int, int] = (0, 0)) -> None:
    """No lock left held; once the device is done, only ``held`` (what live objects hold:
    in-use and requested bytes) is in use."""
    assert _free(LOCK.lock), "pinstage's process lock was left held"
    for lk in locks:
        assert _free(lk), "an object's lock was left held"
    sync()
    pinstage.synchronize(device)
    if _in_use(device) != held:
        gc.collect()  # (only when needed: an interrupted frame may sit in a reference cycle)
        pinstage.synchronize(device)
    assert _in_use(device) == held


def _every_point(call: Callable[[], Any], after: Callable[[], None], limit: int = 2000) -> int:
    """Run ``call`` once per pinstage line it executes, interrupted there; ``after()`` checks
    and resets. Returns how many points were tried."""
    n = min(line_events(call, NOT_SIM), limit)
    after()
    for k in range(1, n + 1):
        interrupt_at(call, k, NOT_SIM)
        after()
    return n


# Raising from a trace function (the injector) inside an ``except`` block leaves CPython's
# exception state stale for the rest of the process (``sys.exc_info()`` in a later test holds
# an old exception, and with it frames and the memory their locals held). The every-line tests
# therefore run in a child process of their own, started by the test below.
_CHILD = os.environ.get("PINSTAGE_INJECTION_CHILD") == "1"
every_line = pytest.mark.skipif(not _CHILD, reason="runs in a child process (see below)")


@pytest.mark.timeout(600)
@pytest.mark.skipif(_CHILD, reason="(the child itself)")
def test_every_line_injection_in_a_child_process():
    env = dict(os.environ, PINSTAGE_INJECTION_CHILD="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          __file__, "-k", "every_line"], capture_output=True, text=True,
                         env=env, timeout=580)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


@every_line
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", TARGETS)
def test_apply_write_interrupted_at_every_line(name):
    with target(name) as (dev, sync):
        swt = pinstage.StagedWriteTensor((8, 8), torch.int32, dev)

        def call() -> None:
            for i in range(3):
                swt.stage_write(i, 0, [i, i + 1, i + 2])
            swt.apply_write()

        def after() -> None:
            _clean(dev, sync, [swt._lock])
            swt.clear_staged_writes()
            swt.stage_write(7, 4, [5, 6])
            swt.apply_write()
            sync()
            assert swt.gpu.cpu()[7, 4:6].tolist() == [5, 6]
            assert swt.num_staged == 0

        assert _every_point(call, after) > 20


@every_line
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", TARGETS)
def test_fused_apply_interrupted_at_every_line(name):
    with target(name) as (dev, sync):
        a = pinstage.StagedWriteTensor((4, 4), torch.int32, dev)
        b = pinstage.StagedWriteTensor(16, torch.int64, dev)
        writer = pinstage.FusedStagedWriter(dev, 8)

        def call() -> None:
            a.stage_write(1, 0, [1, 2])
            b.stage_write(3, 0, [4])
            writer.apply([a, b])

        def after() -> None:
            _clean(dev, sync, [a._lock, b._lock, writer._lock])
            for t in (a, b):
                t.clear_staged_writes()
            a.stage_write(2, 1, [9])
            writer.apply([a, b])
            sync()
            assert int(a.gpu.cpu()[2, 1]) == 9

        _every_point(call, after)


@every_line
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", TARGETS)
def test_uploads_interrupted_at_every_line(name, monkeypatch):
    monkeypatch.setenv("PINSTAGE_STAGING_LIMIT", "16KiB")
    with target(name) as (dev, sync):
        data = np.arange(3000, dtype=np.int64)  # 24 KB: chunked through the 16 KiB cap

        def call() -> None:
            pinstage.async_tensor_h2d([1, 2, 3], dev)
            pinstage.async_tensor_h2d(data, dev)
            pinstage.h2d_many([[1, 2], np.arange(3, dtype=np.int32)], dev)

        def after() -> None:
            _clean(dev, sync, [])
            out = pinstage.async_tensor_h2d(data, dev)
            sync()
            assert torch.equal(out.cpu(), torch.from_numpy(data))

        _every_point(call, after)


@every_line
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["eager", "lazy"])
def test_buffers_and_pools_interrupted_at_every_line(name):
    with target(name) as (dev, sync):
        pool = pinstage.UvaBufferPool(4, torch.int64, max_concurrency=2, device=dev)

        def call() -> None:
            buf = pinstage.CpuGpuBuffer(16, dtype=torch.int32, device=dev)
            buf.np[:] = 3
            buf.copy_to_gpu()
            pool.copy_to_gpu([1, 2, 3, 4])
            pinstage.np_to_pinned_tensor(np.arange(8))

        held = _in_use(dev)  # the pool's slots, held while it lives

        def after() -> None:
            _clean(dev, sync, [], held)
            assert pool.copy_to_gpu([5, 6, 7, 8]).cpu().tolist() == [5, 6, 7, 8]

        _every_point(call, after)


# --------------------------------------------------------------------------------------------
# Timed signals


class _Storm:
    """``KeyboardInterrupt`` in the main thread after a random delay, again and again.

    An interrupt that lands in a callback CPython runs on its own (a ``gc.callbacks`` entry
    such as hypothesis's, a ``weakref.finalize``) is "unraisable": CPython hands it to
    ``sys.unraisablehook``. pytest's hook keeps the exception, and with its traceback the
    frames below it and the buffers their locals hold, until the test ends: memory counts
    would then see live objects. During a storm a hook of ours keeps only where each one
    was raised (:attr:`in_pinstage`: a pinstage frame ran as such a callback, which pinstage
    must never need)."""

    def __init__(self, seed: int, max_delay_s: float) -> None:
        self.rng = np.random.default_rng(seed)
        self.max_delay_s = max_delay_s
        self.old: Any = None
        self.old_hook: Any = None
        self.old_threshold: tuple[int, ...] = ()
        self.unraisable = 0
        self.in_pinstage: list[str] = []

    def _hook(self, u: Any) -> None:
        self.unraisable += 1
        tb = u.exc_traceback
        while tb is not None:
            name = tb.tb_frame.f_code.co_filename
            if f"{os.sep}pinstage{os.sep}" in name:
                self.in_pinstage.append(f"{name}:{tb.tb_lineno} ({u.object!r})")
            tb = tb.tb_next
        del u, tb  # (no reference to the exception or its frames survives the hook)

    def __enter__(self) -> _Storm:
        def fire(signum: int, frame: Any) -> None:
            raise KeyboardInterrupt

        self.old = signal.signal(signal.SIGALRM, fire)
        self.old_hook, sys.unraisablehook = sys.unraisablehook, self._hook
        gc.callbacks.append(self._gc_callback)  # (as hypothesis's is, once it has run)
        self.old_threshold = gc.get_threshold()
        gc.set_threshold(20)  # (collections often, so interrupts do land in the callback)
        return self

    @staticmethod
    def _gc_callback(phase: str, info: dict[str, int]) -> None:
        """Python code at every collection, in whatever pinstage frame triggered it: some
        interrupts land here (and are unraisable), as they do in a process with such
        callbacks."""
        for _ in range(300):
            pass

    def arm(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 1e-6 + float(self.rng.random()) * self.max_delay_s)

    def __exit__(self, *exc: Any) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.old)
        gc.set_threshold(*self.old_threshold)
        gc.callbacks.remove(self._gc_callback)
        sys.unraisablehook = self.old_hook
        assert not self.in_pinstage, f"pinstage code ran as a finalizer: {self.in_pinstage}"


def _storm(body: Callable[[int], None], iterations: int, seed: int, max_delay_s: float) -> int:
    """``body(i)`` ``iterations`` times, each with a timer armed; returns how many were hit."""
    hit = 0
    with _Storm(seed, max_delay_s) as storm:
        for i in range(iterations):
            try:
                storm.arm()
                body(i)
                signal.setitimer(signal.ITIMER_REAL, 0)
            except KeyboardInterrupt:
                hit += 1
    return hit


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", TARGETS)
def test_apply_write_under_a_storm_of_interrupts(name, monkeypatch):
    """Issue 20 finding 1: timed Ctrl-C during stage_write + apply_write with a small staging
    limit: afterwards nothing is in use, a 50,000-element upload works, the table is right."""
    monkeypatch.setenv("PINSTAGE_STAGING_LIMIT", "256KiB")
    with target(name) as (dev, sync):
        swt = pinstage.StagedWriteTensor((64, 32), torch.int32, dev)
        ref = np.zeros((64, 32), dtype=np.int32)

        def body(i: int) -> None:
            row = i % 64
            swt.stage_write(row, 0, list(range(i, i + 32)))
            swt.apply_write()

        hit = _storm(body, 3000, seed=3, max_delay_s=300e-6)
        assert hit > 0
        swt.apply_write()  # whatever is still staged
        _clean(dev, sync, [swt._lock])
        out = pinstage.async_tensor_h2d(np.arange(50_000), dev)
        for row in range(64):  # the last write of each row wins; check it by rewriting
            swt.stage_write(row, 0, list(range(row, row + 32)))
            ref[row] = np.arange(row, row + 32)
        swt.apply_write()
        sync()
        assert torch.equal(out.cpu(), torch.arange(50_000))
        np.testing.assert_array_equal(swt.gpu.cpu().numpy(), ref)
        _clean(dev, sync, [swt._lock])


@pytest.mark.timeout(120)
def test_fused_apply_interrupted_while_waiting_for_a_busy_table():
    """Issue 20 finding 2: Ctrl-C while FusedStagedWriter.apply waits for a table another
    thread is applying releases the locks it already took."""
    small = pinstage.StagedWriteTensor((4, 4), torch.int32, "cpu")
    big = pinstage.StagedWriteTensor((1000, 300), torch.int32, "cpu")
    for r in range(1000):
        for c in range(300):
            big.stage_write(r, c, [c])
    small.stage_write(0, 0, [1])
    busy = threading.Thread(target=big.apply_write)
    writer = pinstage.FusedStagedWriter("cpu", 8)
    with _Storm(0, 0) as storm:
        busy.start()
        while not big._lock.locked():
            time.sleep(0.001)
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(KeyboardInterrupt):
            writer.apply(sorted([small, big], key=id))
        del storm
    busy.join(60)
    assert not small._lock.locked() and not writer._lock.locked()
    small.apply_write()  # works, and the write is there
    assert int(small.gpu[0, 0]) == 1


@pytest.mark.timeout(60)
def test_interrupted_lazy_host_wait_keeps_the_kernel_queued():
    """Issue 20 finding 3: Ctrl-C during a lazy host wait leaves the queued kernel queued: it
    runs at the next wait, as a device would have run it."""
    with simulated_accelerator("lazy") as sim, _Storm(0, 0):
        x = torch.zeros(4, device="cuda")

        def kernel(t: torch.Tensor) -> None:
            time.sleep(0.2)
            t.fill_(1)

        sim.launch(kernel, x, writes=[x])
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(KeyboardInterrupt):
            x.cpu()
        assert sim.pending == 1
        assert x.tolist() == [1.0] * 4


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["eager", "lazy"])
def test_buffers_and_pinned_copies_under_a_storm(name, capfd):
    """Issue 20 finding 6: Ctrl-C in np_to_pinned_tensor and buffer construction keeps the
    counters right (in use 0 once nothing is held) and prints nothing from __del__."""
    with target(name) as (dev, sync):
        def body(i: int) -> None:
            pinstage.np_to_pinned_tensor(np.arange(100 + i))
            buf = pinstage.CpuGpuBuffer(64, dtype=torch.int32, device=dev)
            buf.copy_to_gpu()

        _storm(body, 1500, seed=5, max_delay_s=400e-6)
        _clean(dev, sync, [])
        stats = pinstage.host_memory_stats(dev)
        assert 0 <= stats["in_use_bytes"] <= stats["reserved_bytes"]
        assert stats["requested_bytes"] == 0
    assert "Exception ignored" not in capfd.readouterr().err


@pytest.mark.parametrize("name", ["cpu", "eager", "lazy"])
def test_a_failed_apply_keeps_the_batch_and_releases_its_staging(name, monkeypatch):
    """Issue 20 finding 5: any exception after the metadata is staged keeps num_staged and
    gives back the staging memory it took."""
    import pinstage._staged as staged

    with target(name) as (dev, sync):
        swt = pinstage.StagedWriteTensor((4, 4), torch.int32, dev)
        swt.stage_write(1, 0, [1, 2])

        def broken(*args: Any) -> None:
            raise RuntimeError("launch failed")

        monkeypatch.setattr(staged, "_launch", broken)
        if name != "cpu":
            with pytest.raises(RuntimeError, match="launch failed"):
                swt.apply_write()
            assert swt.num_staged == 2
            _clean(dev, sync, [swt._lock])
        monkeypatch.undo()
        swt.apply_write()
        sync()
        assert swt.gpu.cpu()[1, :2].tolist() == [1, 2]
