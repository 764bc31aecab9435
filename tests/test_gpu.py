"""Checks on a real CUDA/ROCm device (skipped without one; run by scripts/gpu-check)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import pinstage

pytestmark = pytest.mark.gpu


@pytest.fixture
def dev():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda", torch.cuda.current_device())


def _simulated() -> bool:
    """Running under ``--pinstage-simulate`` (random mode may have run the queue already)."""
    from pinstage import _sim

    return _sim.current() is not None


def _host_did_not_wait(elapsed: float, limit: float) -> bool:
    """On a GPU: the calls took less than ``limit`` seconds while the device was busy. Under
    ``--pinstage-simulate`` (timing means nothing there): no host stall was counted."""
    from pinstage import _sim

    if _sim.current() is not None:
        sim = _sim.current()
        return sim is not None and sim.stats.host_stalls == 0
    return elapsed < limit


_CYCLES_PER_MS: list[float] = []


def _busy(ms: float = 50.0) -> None:
    """Queue about ``ms`` of GPU work on the current stream (spin kernel, calibrated once)."""
    if not _CYCLES_PER_MS:
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000)  # warm up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.cuda._sleep(20_000_000)
        torch.cuda.synchronize()
        _CYCLES_PER_MS.append(20_000_000 / ((time.perf_counter() - t0) * 1e3))
    torch.cuda._sleep(int(ms * _CYCLES_PER_MS[0]))


def test_capabilities_on_gpu(dev):
    caps = pinstage.capabilities(dev)
    assert caps.accelerator and caps.device == dev
    assert caps.pin_memory, caps.reasons
    assert caps.uva, caps.reasons


def test_host_returns_while_gpu_busy(dev):
    data = list(range(256))
    arr = np.arange(4096, dtype=np.float32)
    for _ in range(3):  # warm up the arena, the caching allocator and the events
        pinstage.async_tensor_h2d(data, dev, dtype=torch.int32)
        pinstage.async_tensor_h2d(arr, dev)
        pinstage.h2d_many([data, arr], dev)
    torch.cuda.synchronize()
    _busy(100)
    t0 = time.perf_counter()
    for _ in range(20):
        a = pinstage.async_tensor_h2d(data, dev, dtype=torch.int32)
        b = pinstage.async_tensor_h2d(arr, dev)
        c = pinstage.h2d_many([data, arr], dev)
    elapsed = time.perf_counter() - t0
    busy_now = _simulated() or not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert busy_now and _host_did_not_wait(elapsed, 0.05), f"host waited: {elapsed * 1e3:.1f} ms"
    assert a.cpu().tolist() == data and torch.equal(b.cpu(), torch.from_numpy(arr))
    assert torch.equal(c[1].cpu(), torch.from_numpy(arr))


def test_staged_write_does_not_block(dev):
    swt = pinstage.StagedWriteTensor((256, 64), torch.int32, dev)
    ref = torch.zeros(256, 64, dtype=torch.int32)
    for r in range(256):  # warm up: size the metadata slots
        swt.stage_write(r, 0, [0] * 16)
    swt.apply_write()
    swt.stage_write(0, 0, [0] * 16)
    swt.apply_write()
    torch.cuda.synchronize()
    _busy(100)
    t0 = time.perf_counter()
    for step in range(4):
        for r in range(256):
            swt.stage_write(r, step * 16, list(range(r, r + 16)))
            ref[r, step * 16 : step * 16 + 16] = torch.arange(r, r + 16)
        swt.apply_write()
    elapsed = time.perf_counter() - t0
    busy_now = _simulated() or not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert busy_now and _host_did_not_wait(elapsed, 0.09)
    assert torch.equal(swt.gpu.cpu(), ref)


def test_uva_aliasing_and_coherence(dev):
    buf = pinstage.UvaBuffer(1024, torch.int32, dev)
    view = buf.uva()
    assert view.device == dev
    buf.np[:] = np.arange(1024)
    assert torch.equal(view.sum().cpu(), torch.tensor(int(np.arange(1024).sum())))
    view[:4].fill_(-1)
    torch.cuda.synchronize()
    assert buf.np[:4].tolist() == [-1] * 4


def test_pool_reuse_is_fenced_on_a_real_stream(dev):
    pool = pinstage.UvaBufferPool(1 << 16, torch.int64, max_concurrency=2, device=dev)
    outs = []
    for step in range(6):
        _busy(20)  # keep the device behind the host
        v = pool.copy_to_uva(np.full(1 << 16, step, np.int64))
        outs.append(v.clone())  # the device reads the hand-out later
    torch.cuda.synchronize()
    for step, o in enumerate(outs):
        assert bool((o == step).all()), step


def test_pinned_memory_is_exact_size(dev, quiet_gc):
    before = pinstage.host_memory_stats()["reserved_bytes"]
    buf = pinstage.CpuGpuBuffer(3 * 2**20 + 5, dtype=torch.uint8, device=dev)
    grown = pinstage.host_memory_stats()["reserved_bytes"] - before
    assert buf.cpu.is_pinned()
    assert grown <= 1.05 * (3 * 2**20 + 5)


def test_same_results_as_cpu_target(dev):
    rng = np.random.default_rng(0)
    arr = rng.standard_normal((33, 7)).astype(np.float32)[:, ::2]
    gpu = pinstage.async_tensor_h2d(arr, dev, dtype=torch.float16)
    cpu = pinstage.async_tensor_h2d(arr, "cpu", dtype=torch.float16)
    swt_g = pinstage.StagedWriteTensor((8, 8), torch.bfloat16, dev)
    swt_c = pinstage.StagedWriteTensor((8, 8), torch.bfloat16, "cpu")
    for s in (swt_g, swt_c):
        s.stage_write(3, 2, [1.5, -2.25, 3.0])
        s.stage_write(3, 3, [7.0])
        s.apply_write()
    torch.cuda.synchronize()
    assert torch.equal(gpu.cpu(), cpu)
    assert torch.equal(swt_g.gpu.cpu(), swt_c.gpu)


def test_large_pageable_copy_is_exact(dev):
    src = torch.randn(64 * 2**20 // 4)
    out = pinstage.async_tensor_h2d(src, dev)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), src)


def test_audit_on_cuda(dev):
    x = torch.arange(1024)
    d = torch.empty(1024, device=dev)
    with pinstage.audit() as report:
        d.copy_(x, non_blocking=True)  # pageable
        d.copy_(pinstage.np_to_pinned_tensor(x.numpy()).float(), non_blocking=True)
        pinned = pinstage.np_to_pinned_tensor(np.arange(1024, dtype=np.float32))
        d.copy_(pinned, non_blocking=True)  # fine
        d.sum().item()
        two_d = pinstage.np_to_pinned_tensor(np.ones((32, 64), np.float32))
        torch.empty(32, 32, device=dev).copy_(two_d[:, ::2], non_blocking=True)
        torch.empty(1024, device=dev).copy_(pinned, non_blocking=True)  # fine
        torch.nonzero(d)
    counts = report.counts()
    assert counts.get("data-dependent") == 1
    assert counts.get("noncontiguous-pinned") == 1
    assert counts.get("pageable-nonblocking", 0) >= 1
    assert counts.get("item") == 1
    with pinstage.audit(strict=True):
        pinstage.async_tensor_h2d(list(range(100)), dev)
        pinstage.h2d_many([[1, 2], np.arange(3)], dev)
        swt = pinstage.StagedWriteTensor((4, 4), torch.int32, dev)
        swt.stage_write(1, 0, [1, 2])
        swt.apply_write()
        pinstage.UvaBufferPool(8, torch.int32, device=dev).copy_to_gpu([1, 2, 3])


_TWO_STREAMS = r"""
import sys, numpy as np, torch, pinstage
sim = None
if "--simulate" in sys.argv:
    from pinstage.testing import simulated_accelerator
    cm = simulated_accelerator("lazy"); sim = cm.__enter__()
dev = torch.device("cuda", 0)
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    torch.cuda._sleep(200_000_000)  # the side stream is far behind
    first = pinstage.async_tensor_h2d(np.full(4, 7, np.int64), dev)
rest = [pinstage.async_tensor_h2d(np.full(256, i, np.int64), dev) for i in range(300)]
torch.cuda.synchronize()
assert first.cpu().tolist() == [7] * 4, first.cpu().tolist()
assert all(r.cpu().tolist() == [i] * 256 for i, r in enumerate(rest))
if sim is not None:
    cm.__exit__(None, None, None)
print("ok")
"""


def _run_script(code: str, *args: str, env: dict[str, str] | None = None) -> str:
    import os
    import subprocess
    import sys

    from pinstage import _sim

    if _sim.current() is not None:  # this suite runs under --pinstage-simulate: so does the child
        args = (*args, "--simulate")
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_two_streams_with_a_delayed_first_stream(dev):
    """A staging region read by a copy on a delayed side stream is not reused by uploads from
    the default stream until that copy ran (a 64 KiB ring wraps many times meanwhile)."""
    assert "ok" in _run_script(_TWO_STREAMS, env={"PINSTAGE_STAGING_LIMIT": "64KiB"})


def test_freeing_buffers_with_copies_in_flight(dev):
    import gc

    _busy(100)
    outs = []
    for i in range(20):
        buf = pinstage.CpuGpuBuffer(4096, dtype=torch.int64, device=dev)
        buf.np[:] = i
        outs.append(buf.copy_to_gpu())
        x = torch.empty(4096, dtype=torch.int64, device=dev)
        x.copy_(pinstage.np_to_pinned_tensor(np.full(4096, -i)), non_blocking=True)
        outs.append(x)
        del buf
        gc.collect()  # on CUDA the pages would be unregistered now without pinstage's parking
    torch.cuda.synchronize()
    for i in range(20):
        assert bool((outs[2 * i] == i).all()) and bool((outs[2 * i + 1] == -i).all())


def test_steady_state_calls_make_no_sync_in_sync_debug_mode(dev):
    """torch.cuda.set_sync_debug_mode("error") raises on any synchronizing CUDA call."""
    data, arr = list(range(256)), np.arange(1024, dtype=np.float32)
    buf = pinstage.CpuGpuBuffer(256, dtype=torch.int32, device=dev)
    swt = pinstage.StagedWriteTensor((64, 16), torch.int32, dev)
    pool = pinstage.UvaBufferPool(256, torch.int32, max_concurrency=3, device=dev)

    def step(k: int) -> None:
        pinstage.async_tensor_h2d(data, dev, dtype=torch.int32)
        pinstage.async_tensor_h2d(arr, dev)
        pinstage.h2d_many([data, arr], dev)
        buf.copy_to_gpu(128)
        for r in range(64):
            swt.stage_write(r, k % 16, [r])
        swt.apply_write()
        pool.copy_to_uva(data)
        pool.copy_to_gpu(data)

    for k in range(3):  # warm up: arena, pools, events, caching allocator
        step(k)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for k in range(20):
            step(k)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_a_child_forked_after_pinstage_was_used(dev):
    """A child forked after the parent used pinstage on the GPU can use pinstage (on the CPU
    target: CUDA itself cannot be used after fork) and exits cleanly: no CUDA call from its
    exit hooks on the parent's pinned memory."""
    import multiprocessing as mp

    pinstage.async_tensor_h2d(list(range(100)), dev)
    buf = pinstage.CpuGpuBuffer(64, dtype=torch.int32, device=dev)
    buf.copy_to_gpu()
    ctx = mp.get_context("fork")
    proc = ctx.Process(target=_child)
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0


def _child() -> None:
    out = pinstage.async_tensor_h2d([1, 2, 3], "cpu")
    assert out.tolist() == [1, 2, 3]
    pinstage.host_memory_stats()
