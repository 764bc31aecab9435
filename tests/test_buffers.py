"""CpuGpuBuffer, UvaBuffer, NonUvaBuffer, UvaBufferPool, UvaBackedTensor."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from helpers import reference_equal, run_threads

import pinstage
from pinstage import _state
from pinstage.testing import HazardError, simulated_accelerator


def test_cpugpubuffer_round_trip(target):
    buf = pinstage.CpuGpuBuffer(5, 3, dtype=torch.int32, device=target.device)
    assert buf.cpu.shape == buf.gpu.shape == (5, 3)
    assert np.shares_memory(buf.np, buf.cpu.numpy())
    target.sync()
    assert int(buf.gpu.abs().sum()) == 0 and int(buf.cpu.abs().sum()) == 0  # zero-filled
    buf.np[:] = np.arange(15).reshape(5, 3)
    g = buf.copy_to_gpu(3)
    target.sync()
    assert g.shape == (3, 3)
    reference_equal(buf.gpu[:3], np.arange(9).reshape(3, 3))
    reference_equal(buf.gpu[3:], np.zeros((2, 3), np.int32))
    buf.gpu.mul_(2)
    target.sync()
    c = buf.copy_to_cpu()
    target.sync()
    reference_equal(c[:3], 2 * np.arange(9).reshape(3, 3))


def test_cpugpubuffer_pinning_follows_capabilities(target):
    buf = pinstage.CpuGpuBuffer(4, dtype=torch.float32, device=target.device)
    expected = pinstage.capabilities(target.device).pin_memory
    pinned = target.sim.backend.is_pinned(buf.cpu) if target.sim else False
    assert pinned == expected
    unpinned = pinstage.CpuGpuBuffer(4, dtype=torch.float32, device=target.device,
                                     pin_memory=False)
    assert not (target.sim and target.sim.backend.is_pinned(unpinned.cpu))


def test_cpugpubuffer_errors(target):
    with pytest.raises(ValueError, match="with_numpy=False"):
        pinstage.CpuGpuBuffer(4, dtype=torch.bfloat16, device=target.device)
    b = pinstage.CpuGpuBuffer(4, dtype=torch.bfloat16, device=target.device, with_numpy=False)
    assert b.np is None
    with pytest.raises(ValueError):
        pinstage.CpuGpuBuffer(-1, dtype=torch.int32, device=target.device)
    with pytest.raises(TypeError):
        pinstage.CpuGpuBuffer("4", dtype=torch.int32, device=target.device)
    buf = pinstage.CpuGpuBuffer(4, dtype=torch.int32, device=target.device)
    for n in (-1, -5):
        with pytest.raises(ValueError, match="negative"):
            buf.copy_to_gpu(n)
        with pytest.raises(ValueError):
            buf.copy_to_cpu(n)
    with pytest.raises(TypeError):
        buf.copy_to_gpu(1.5)
    assert buf.copy_to_gpu(5).shape == (4,)  # above the size: the whole buffer (slicing)
    if not target.accelerator:
        with pytest.raises(RuntimeError):
            pinstage.CpuGpuBuffer(4, dtype=torch.int32, device=target.device, pin_memory=True)


def test_cpugpubuffer_changing_cpu_before_copy_runs_is_a_hazard():
    with simulated_accelerator("lazy") as sim:
        buf = pinstage.CpuGpuBuffer(4, dtype=torch.int64, device=sim.device)
        buf.np[:] = 1
        buf.copy_to_gpu()
        buf.np[0] = 5  # the copy has not run yet
        with pytest.raises(HazardError, match="CpuGpuBuffer.copy_to_gpu"):
            sim.synchronize()


def test_uva_buffer_aliases_host(target):
    if not pinstage.capabilities(target.device).uva:
        with pytest.raises(RuntimeError, match="UVA"):
            pinstage.UvaBuffer(4, torch.int32, target.device)
        return
    buf = pinstage.UvaBuffer((4, 2), torch.int32, target.device)
    view = buf.uva()
    buf.np[:] = 7  # no copy call
    target.sync()
    reference_equal(view, np.full((4, 2), 7))
    assert buf.uva(2).shape == (2, 2)
    assert buf.uva(5).shape == (4, 2)  # Python slicing, as vLLM's .uva[:n]
    with pytest.raises(ValueError):
        buf.uva(-1)


def test_non_uva_buffer_snapshot(target):
    buf = pinstage.NonUvaBuffer(4, torch.float32, target.device)
    buf.np[:] = [1, 2, 3, 4]
    d = buf.uva(3)
    target.sync()
    reference_equal(d, torch.tensor([1.0, 2, 3]))
    buf.np[:] = 0  # after the copy completed: device memory unchanged
    target.sync()
    reference_equal(d, torch.tensor([1.0, 2, 3]))


def test_pool_copy_to_uva_and_gpu(target):
    pool = pinstage.UvaBufferPool((4, 2), torch.int64, max_concurrency=3,
                                  device=target.device)
    outs = []
    for i in range(7):
        x = np.full((i % 3 + 1, 2), i)
        outs.append((pool.copy_to_gpu(x), x))
    u = pool.copy_to_uva([[1, 2], [3, 4]])
    target.sync()
    for o, x in outs:
        reference_equal(o, x)  # device-resident copies stay valid
    reference_equal(u, [[1, 2], [3, 4]])


def test_pool_grows_to_power_of_two(target):
    pool = pinstage.UvaBufferPool(2, torch.int32, device=target.device)
    v = pool.copy_to_uva(list(range(5)))
    target.sync()
    reference_equal(v, np.arange(5))
    ring = pool._ring()
    slot = ring.slots[ring.curr]
    assert slot is not None and slot.cpu.shape[0] == 8


def test_pool_errors_leave_pool_unchanged(target):
    pool = pinstage.UvaBufferPool((4, 3), torch.float32, device=target.device)
    curr = pool._ring().curr
    with pytest.raises(ValueError, match="trailing"):
        pool.copy_to_uva(np.zeros((2, 2)))
    with pytest.raises(TypeError):
        pool.copy_to_uva("abc")
    with pytest.raises(ValueError):
        pool.copy_to_gpu(np.zeros((2, 3)), out=torch.zeros(3, 3))
    assert pool._ring().curr == curr
    with pytest.raises(ValueError):
        pinstage.UvaBufferPool(4, torch.int32, max_concurrency=0)
    with pytest.raises(TypeError):
        pinstage.UvaBufferPool(4, torch.int32, max_concurrency=1.5)


def test_pool_out_is_written(target):
    pool = pinstage.UvaBufferPool(4, torch.int32, device=target.device)
    out = pinstage.async_tensor_h2d([0, 0, 0], target.device, dtype=torch.int32)
    res = pool.copy_to_gpu([7, 8, 9], out=out)
    target.sync()
    assert res is out
    reference_equal(out, torch.tensor([7, 8, 9], dtype=torch.int32))


@pytest.mark.parametrize("mode", ["lazy", "random"])
@pytest.mark.parametrize("uva", [True, False])
def test_pool_reuse_is_fenced(mode, uva):
    """Readers of each hand-out are enqueued before the next one; the pool must never rewrite a
    slot they still read. In lazy mode nothing runs until the pool waits, so an unfenced pool
    would raise HazardError here."""
    for seed in range(20):
        with simulated_accelerator(mode, seed=seed, uva=uva) as sim:
            pool = pinstage.UvaBufferPool(4, torch.int64, max_concurrency=2, device=sim.device)
            seen = []
            for step in range(10):
                v = pool.copy_to_uva([step, step + 1, step + 2])
                dst = torch.empty(3, dtype=torch.int64)
                sim.launch(lambda s, d: d.copy_(s), v, dst)  # a kernel reading the hand-out
                seen.append(dst)
            sim.synchronize()
            for step, d in enumerate(seen):
                assert d.tolist() == [step, step + 1, step + 2]
            if mode == "lazy":
                assert sim.stats.host_stalls == 8  # hand-outs 3..10 reuse a slot: each waited


def test_unfenced_reuse_would_be_caught():
    """The simulator catches what vLLM's convention-only pool allows: a host rewrite of memory
    a queued kernel still reads."""
    with simulated_accelerator("lazy") as sim:
        buf = pinstage.UvaBuffer(4, torch.int64, sim.device)
        buf.np[:] = 1
        sim.launch(lambda v: v.sum(), buf.uva())
        buf.np[:] = 2  # rewrite without waiting
        with pytest.raises(HazardError, match="kernel"):
            sim.synchronize()


def test_set_default_max_concurrency(target):
    pinstage.set_default_max_concurrency(5)
    assert pinstage.UvaBufferPool(2, torch.int32, device=target.device).max_concurrency == 5
    with pytest.raises(ValueError):
        pinstage.set_default_max_concurrency(0)
    with pytest.raises(TypeError):
        pinstage.set_default_max_concurrency("3")
    assert pinstage.UvaBufferPool(2, torch.int32, device=target.device).max_concurrency == 5


def test_uva_backed_tensor(target):
    t = pinstage.UvaBackedTensor((6, 2), torch.int32, device=target.device)
    target.sync()
    reference_equal(t.gpu, np.zeros((6, 2), np.int32))
    t.np[:4] = np.arange(8).reshape(4, 2)
    g = t.copy_to_uva(4)
    assert g is t.gpu
    t.np[:] = -1  # .cpu is ordinary memory, the upload was staged
    target.sync()
    reference_equal(t.gpu, np.arange(8).reshape(4, 2))
    with pytest.raises(ValueError):
        t.copy_to_uva(-1)


def test_uva_buffer_wraps_a_given_pinned_tensor(target):
    if not pinstage.capabilities(target.device).uva:
        return
    host = pinstage.CpuGpuBuffer(6, dtype=torch.int32, device=target.device).cpu
    buf = pinstage.UvaBuffer(6, torch.int32, target.device, cpu=host)
    assert buf.cpu.data_ptr() == host.data_ptr()  # wrapped, not copied
    host[:] = torch.arange(6, dtype=torch.int32)
    target.sync()
    reference_equal(buf.uva(3), np.arange(3))
    with pytest.raises(ValueError, match="shape"):
        pinstage.UvaBuffer(5, torch.int32, target.device, cpu=host)
    with pytest.raises(TypeError):
        pinstage.UvaBuffer(6, torch.int32, target.device, cpu=[0] * 6)
    if target.accelerator:
        with pytest.raises(ValueError, match="pinned"):
            pinstage.UvaBuffer(6, torch.int32, target.device, cpu=torch.zeros(6, dtype=torch.int32))


def test_copies_say_the_source_is_pinned(sim_target, monkeypatch):
    """Pinnedness is a fact of the buffer, found once: each copy passes it to the backend."""
    backend = sim_target.sim.backend
    seen = []
    original = backend.copy_h2d

    def spy(dst, src, pinned=False):
        seen.append(pinned)
        original(dst, src, pinned=pinned)

    monkeypatch.setattr(backend, "copy_h2d", spy)
    buf = pinstage.CpuGpuBuffer(4, dtype=torch.int32, device=sim_target.device)
    buf.copy_to_gpu()
    nonuva = pinstage.NonUvaBuffer(4, torch.int32, sim_target.device)
    nonuva.uva()
    pin = pinstage.capabilities(sim_target.device).pin_memory
    assert seen == [pin, pin]


def test_pool_fences_each_hand_out_on_its_own_stream(monkeypatch):
    """The event fencing a hand-out is recorded on the stream current at that hand-out (where
    its readers were queued), not on the stream current at the next one: a kernel reading
    hand-out 1 on stream 1 is covered although hand-out 2 happens on stream 2."""
    with simulated_accelerator("lazy") as sim:
        if not (torch.cuda.is_available() and hasattr(torch.cuda, "Stream")):
            pytest.skip("needs the simulated CUDA's streams")
        backend = pinstage._backend.get_backend(sim.device)
        recorded = []
        original = backend.record_event

        def record(event, stream):
            recorded.append(stream)
            return original(event, stream)

        monkeypatch.setattr(backend, "record_event", record)
        pool = pinstage.UvaBufferPool(4, torch.int64, max_concurrency=2, device=sim.device)
        s1, s2 = torch.cuda.Stream(sim.device), torch.cuda.Stream(sim.device)
        seen = torch.zeros(3, dtype=torch.int64, device=sim.device)  # filled on the default
        s1.wait_stream(torch.cuda.current_stream())  # stream: s1 must not overtake the fill
        _state.device_state(backend).collect()  # earlier garbage's fences are not the pool's
        recorded.clear()
        with torch.cuda.stream(s1):
            first = pool.copy_to_uva([1, 2, 3])
            seen.copy_(first)  # a reader of hand-out 1, queued on stream 1
            h1 = backend.current_stream()
        with torch.cuda.stream(s2):
            pool.copy_to_uva([4, 5, 6])
            h2 = backend.current_stream()
        pool.copy_to_uva([7, 8, 9])  # reuses hand-out 1's slot: must wait for stream 1
        assert recorded[:2] == [h1, h2]
        sim.synchronize()
        assert seen.cpu().tolist() == [1, 2, 3]


def test_pool_shared_by_threads_never_returns_another_threads_data(target):
    pool = pinstage.UvaBufferPool((3,), torch.int64, max_concurrency=2, device=target.device)
    steps = 1500 if target.sim is None else 100  # the simulator runs every op in Python
    bad: list[object] = []

    def work(t: int) -> None:
        try:
            for i in range(steps):
                x = [t, i, t * i]
                a = pool.copy_to_uva(x)
                if a.tolist() != x:
                    bad.append(("uva", t, i, a.tolist()))
                g = pool.copy_to_gpu(x)
                if g.tolist() != x:
                    bad.append(("gpu", t, i, g.tolist()))
        except RuntimeError as exc:  # refusing concurrent use is allowed; wrong data is not
            assert "thread" in str(exc)
        except BaseException as exc:  # noqa: BLE001 - reported below
            bad.append(exc)

    run_threads(work, 6)
    assert not bad, bad[:5]


def test_non_uva_buffer_refuses_a_second_thread_inside_uva(monkeypatch):
    with simulated_accelerator("lazy", uva=False) as sim:
        buf = pinstage.NonUvaBuffer(4, torch.int32, sim.device)
        backend = sim.backend
        original = backend.copy_h2d
        outcome = []

        def slow_copy(dst, src, pinned=False):
            def other():
                try:
                    buf.uva()
                    outcome.append("ran")
                except RuntimeError as exc:
                    outcome.append(str(exc))

            th = threading.Thread(target=other)
            th.start()
            th.join()
            original(dst, src, pinned=pinned)

        monkeypatch.setattr(backend, "copy_h2d", slow_copy)
        buf.uva()
        assert len(outcome) == 1 and "two threads" in outcome[0]


def test_buffers_made_under_inference_mode_work_outside(target):
    with torch.inference_mode():
        buf = pinstage.CpuGpuBuffer(4, dtype=torch.int32, device=target.device)
        pool = pinstage.UvaBufferPool(2, torch.int32, device=target.device)
        backed = pinstage.UvaBackedTensor(4, torch.int32, device=target.device)
        nonuva = pinstage.NonUvaBuffer(4, torch.int32, target.device)
    buf.np[:] = [1, 2, 3, 4]
    buf.copy_to_gpu()
    target.sync()
    buf.gpu.add_(1)
    buf.copy_to_cpu()
    g = pool.copy_to_gpu([5, 6, 7])  # grows a slot outside inference mode
    backed.np[:] = 9
    u = backed.copy_to_uva()
    nonuva.np[:] = 3
    d = nonuva.uva()
    target.sync()
    reference_equal(buf.cpu, [2, 3, 4, 5])
    reference_equal(g, [5, 6, 7])
    reference_equal(u, [9, 9, 9, 9])
    reference_equal(d, [3, 3, 3, 3])


def test_a_large_max_concurrency_pins_slots_only_as_they_are_used(target):
    """Issue 20: max_concurrency=10,000 once pinned 10,000 slots up front (3.8 s). Slots past
    the first few are made on first use; the ring still rotates over all of them."""
    import time

    before = pinstage.host_memory_stats()["reserved_bytes"]
    t0 = time.perf_counter()
    pool = pinstage.UvaBufferPool((4,), torch.int64, max_concurrency=10_000, device=target.device)
    assert time.perf_counter() - t0 < 1.0
    grown = pinstage.host_memory_stats()["reserved_bytes"] - before
    assert grown <= 64 * 4096  # a few slots, not 10,000 (each is at least a page when pinned)
    outs = [pool.copy_to_uva([i, i, i, i]) for i in range(20)]
    target.sync()
    assert [o.cpu().tolist() for o in outs] == [[i] * 4 for i in range(20)]
    assert len({o.data_ptr() for o in outs}) == 20  # twenty distinct slots, none reused yet
