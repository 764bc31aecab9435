"""The simulated CUDA: unmodified ``"cuda"`` code runs on the CPU in stream order, and the
async bugs a GPU would turn into garbage become deterministic errors."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import pinstage
from pinstage.testing import MODES, HazardError, simulated_accelerator


@pytest.mark.parametrize("mode", MODES)
def test_the_issue_example_prints_the_right_values(mode, capsys):
    with simulated_accelerator(mode=mode) as sim:
        q = pinstage.CpuGpuBuffer(4, dtype=torch.int64, device=sim.device)
        q.np[:] = [1, 2, 3, 4]
        q.copy_to_gpu()
        y = q.gpu * 2
        sim.synchronize()
        print(y)
    assert capsys.readouterr().out.startswith("tensor([2, 4, 6, 8]")


def test_changing_the_host_buffer_before_the_copy_ran_is_a_hazard():
    with pytest.raises(HazardError, match=r"CpuGpuBuffer\.copy_to_gpu"):
        with simulated_accelerator(mode="lazy") as sim:
            q = pinstage.CpuGpuBuffer(4, dtype=torch.int64, device=sim.device)
            q.np[:] = [1, 2, 3, 4]
            q.copy_to_gpu()
            q.np[0] = 9  # the queued copy has not read it yet
            sim.synchronize()


def test_torch_cuda_answers_for_the_simulated_devices():
    assert not torch.cuda.is_available()
    with simulated_accelerator(device_count=2) as sim:
        assert torch.cuda.is_available() and torch.cuda.device_count() == 2
        assert sim.device == torch.device("cuda", 0)
        assert torch.cuda.current_device() == 0
        with torch.cuda.device(1):
            assert torch.cuda.current_device() == 1
            t = torch.zeros(3, device="cuda")
        assert torch.cuda.current_device() == 0
        assert t.device == torch.device("cuda", 1) and t.is_cuda
        u = torch.ones(2, device=torch.device("cuda", 1))
        v = torch.tensor([1, 2], device="cuda:0")
        assert "simulated" in torch.cuda.get_device_name(0)
        with pytest.raises(RuntimeError, match="same device"):
            u + v
        with pytest.raises(RuntimeError, match="same device"):
            v + torch.ones(2)
        assert (u + u).tolist() == [2.0, 2.0]
        torch.cuda.set_device(1)
        assert torch.empty(1, device="cuda").device.index == 1
        torch.cuda.set_device(0)
    assert not torch.cuda.is_available()  # restored on leaving


@pytest.mark.parametrize("mode", MODES)
def test_moving_tensors_and_host_reads(mode):
    with simulated_accelerator(mode=mode) as sim:
        a = torch.arange(6).reshape(2, 3)
        d = a.cuda()
        e = a.to("cuda", dtype=torch.float32)
        f = torch.empty(2, 3, dtype=torch.int64, device="cuda").copy_(a)
        assert d.device.type == e.device.type == f.device.type == "cuda"
        s = (d * 10 + f)[1]
        assert s.tolist() == [33, 44, 55]
        assert e.sum().item() == 15.0
        assert bool((d == f).all())
        assert torch.equal(d.cpu(), a)
        assert d.to("cpu").is_cuda is False
        assert int(d[1, 2]) == 5 and float(e[0, 1]) == 1.0
        with pytest.raises(TypeError, match="numpy"):
            d.numpy()
        assert d[d > 2].tolist() == [3, 4, 5]  # data-dependent size: the host waits
        assert sim.stats.syncs > 0


def test_pinned_host_memory():
    with simulated_accelerator() as sim:
        p = torch.zeros(4, pin_memory=True)
        q = torch.arange(4).pin_memory()
        assert p.is_pinned() and q.is_pinned() and not torch.arange(4).is_pinned()
        assert torch.zeros(3, pin_memory=pinstage.PIN_MEMORY).is_pinned()
        d = torch.empty(4, dtype=torch.int64, device=sim.device)
        d.copy_(q, non_blocking=True)  # async from pinned memory: no host stall
        assert sim.stats.host_stalls == 0
        assert d.tolist() == [0, 1, 2, 3]
    with simulated_accelerator(pin_memory=False):
        with pytest.raises(RuntimeError):
            torch.zeros(4, pin_memory=True)
        with pytest.raises(RuntimeError):
            torch.zeros(4).pin_memory()


def test_pageable_copies_block_and_count_as_stalls():
    with simulated_accelerator("lazy") as sim:
        torch.ones(4).to("cuda", non_blocking=True)  # pageable: the driver blocks the host
        assert sim.stats.pageable_copies == 1 and sim.stats.host_stalls == 1


def test_work_on_one_stream_runs_in_order_and_waits_at_host_reads():
    with simulated_accelerator("lazy") as sim:
        x = torch.zeros(4, device="cuda")  # a fill kernel
        for _ in range(5):
            x.add_(1)
        assert sim.pending == 6  # nothing ran: the host has not waited yet
        assert x.tolist() == [5.0] * 4  # a host read waits for what it depends on
        assert sim.pending == 0


def _two_stream_step(wait: bool) -> list[int]:
    side = torch.cuda.Stream()
    src = torch.arange(8).pin_memory()
    dst = torch.zeros(8, dtype=torch.int64, device="cuda")  # a fill on the default stream
    side.wait_stream(torch.cuda.current_stream())  # ... which the side stream must wait for
    with torch.cuda.stream(side):
        dst.copy_(src, non_blocking=True)
        dst.mul_(2)
        done = torch.cuda.Event()
        done.record()
    if wait:
        torch.cuda.current_stream().wait_event(done)
    out = dst + 1  # on the default stream
    return out.tolist()


@pytest.mark.parametrize("mode", MODES)
def test_an_event_orders_two_streams(mode):
    for seed in range(20 if mode == "random" else 1):
        with simulated_accelerator(mode, seed=seed):
            assert _two_stream_step(wait=True) == [2 * i + 1 for i in range(8)]


@pytest.mark.parametrize("mode", MODES)
def test_without_the_event_the_other_stream_reads_too_early(mode):
    """The read on the default stream is not ordered after the side stream's writes: the race
    detector raises when it is queued, whatever the schedule (issue 17)."""
    for seed in range(5 if mode == "random" else 1):
        with pytest.raises(HazardError, match=r"read-after-write.*add.*mul_"):
            with simulated_accelerator(mode, seed=seed):
                _two_stream_step(wait=False)


def test_stream_and_event_api():
    with simulated_accelerator("lazy") as sim:
        s = torch.cuda.Stream()
        assert isinstance(s, torch.cuda.Stream)
        assert torch.cuda.current_stream() == torch.cuda.default_stream()
        with torch.cuda.stream(s):
            assert torch.cuda.current_stream() is s
            x = torch.ones(3, device="cuda") * 3
            ev = s.record_event()
        assert not ev.query() and not s.query()
        ev.synchronize()
        assert ev.query() and s.query()
        torch.cuda.current_stream().wait_stream(s)
        x.record_stream(torch.cuda.current_stream())
        assert x.tolist() == [3.0] * 3
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        e.wait()
        torch.cuda.synchronize()
        assert sim.pending == 0


def test_a_long_loop_cannot_grow_the_queue():
    with simulated_accelerator("lazy") as sim:
        x = torch.zeros(1, device="cuda")
        for _ in range(3000):
            x.add_(1)
            assert sim.pending <= 1024
        assert x.item() == 3000


def test_registered_memory_unregistered_while_a_copy_reads_it_is_a_hazard():
    with pytest.raises(HazardError, match="unregistered/freed"):
        with simulated_accelerator("lazy") as sim:
            buf = np.arange(16, dtype=np.int64)
            rt = torch.cuda.cudart()
            assert rt.cudaHostRegister(buf.ctypes.data, buf.nbytes, 0) == 0
            host = torch.from_numpy(buf)
            assert host.is_pinned()
            dst = torch.empty(16, dtype=torch.int64, device="cuda")
            dst.copy_(host, non_blocking=True)
            rt.cudaHostUnregister(buf.ctypes.data)  # freed while the copy is queued
            sim.synchronize()


@pytest.mark.parametrize("mode", MODES)
def test_pinstage_keeps_freed_pinned_memory_until_the_device_read_it(mode):
    """np_to_pinned_tensor temporaries and buffers dropped right after their copy: on CUDA
    the pages would be unregistered at once; pinstage parks them behind an event."""
    import gc

    with simulated_accelerator(mode) as sim:
        outs = []
        for i in range(20):
            x = torch.empty(8, dtype=torch.int64, device=sim.device)
            x.copy_(pinstage.np_to_pinned_tensor(np.arange(8) + i), non_blocking=True)
            outs.append(x)
            buf = pinstage.CpuGpuBuffer(8, dtype=torch.int64, device=sim.device)
            buf.np[:] = i
            outs.append(buf.copy_to_gpu())
            del buf
            gc.collect()
        sim.synchronize()
        for i in range(20):
            assert outs[2 * i].tolist() == list(range(i, i + 8))
            assert outs[2 * i + 1].tolist() == [i] * 8


def test_nonblocking_d2h_destination_is_poisoned_until_the_copy_runs():
    with simulated_accelerator("lazy") as sim:
        d = torch.arange(4, device="cuda")
        f = torch.ones(2, device="cuda")
        out = torch.empty(4, dtype=torch.int64, pin_memory=True)
        fout = torch.empty(2, pin_memory=True)
        out.copy_(d, non_blocking=True)
        fout.copy_(f, non_blocking=True)
        # read too early, through NumPy (a torch op reading it is a HazardError: below)
        assert out.numpy().tolist() == [torch.iinfo(torch.int64).min] * 4
        assert np.isnan(fout.numpy()).all()
        sim.synchronize()
        assert out.tolist() == [0, 1, 2, 3] and fout.tolist() == [1.0, 1.0]


_HOST_OPS = {
    "tolist": lambda h: h.tolist(),
    "print": lambda h: str(h),
    "item": lambda h: h[0].item(),
    "elementwise read": lambda h: h + 1,
    "in-place write": lambda h: h.add_(1),
    "setitem": lambda h: h.__setitem__(0, 7.0),
    "copy into it": lambda h: h.copy_(torch.zeros(4)),
    "copy from it": lambda h: torch.zeros(4).copy_(h),
}
_HOST_WAITS = {
    "synchronize": lambda s, e: torch.cuda.synchronize(),
    "stream.synchronize": lambda s, e: s.synchronize(),
    "event.synchronize": lambda s, e: e.synchronize(),
    "event.query": lambda s, e: [torch.cuda.synchronize(), e.query()],
}


@pytest.mark.parametrize("mode", MODES)
def test_host_access_to_pinned_memory_the_device_may_still_use_is_a_hazard(mode):
    """A host op on pinned memory a queued copy still writes (non-blocking D2H) or reads
    (non-blocking H2D: only the host's writes race) raises when the host makes it, in every
    mode (in eager the copy has run already: on a GPU nothing says it has); once the host
    waited for the copy, the same op is fine."""
    for name, op in _HOST_OPS.items():
        with simulated_accelerator(mode):  # device-to-host: every host access races
            d = torch.arange(4, dtype=torch.float32, device="cuda")
            h = torch.empty(4, pin_memory=True)
            h.copy_(d, non_blocking=True)
            with pytest.raises(HazardError, match=r"host race \((read|write)-after-write\)"):
                op(h)
            torch.cuda.synchronize()
            assert h.tolist() == [0.0, 1.0, 2.0, 3.0], name  # (the failed op lost nothing)
        with simulated_accelerator(mode):  # host-to-device: the host's writes race
            h = torch.arange(4, dtype=torch.float32).pin_memory()
            d = torch.empty(4, device="cuda")
            d.copy_(h, non_blocking=True)
            if name in ("in-place write", "setitem", "copy into it"):
                with pytest.raises(HazardError, match=r"host race \(write-after-read\)"):
                    op(h)
            else:
                op(h)
            assert d.tolist() == [0.0, 1.0, 2.0, 3.0], name
    for wait in _HOST_WAITS.values():
        with simulated_accelerator(mode):
            d = torch.arange(4, dtype=torch.float32, device="cuda")
            h = torch.empty(4, pin_memory=True)
            s = torch.cuda.current_stream()
            h.copy_(d, non_blocking=True)
            e = torch.cuda.Event()
            e.record()
            wait(s, e)
            for op in _HOST_OPS.values():
                op(h)  # (no error: the host waited)
    with simulated_accelerator(mode):  # pageable memory is the host's alone: never a race
        d = torch.arange(4, dtype=torch.float32, device="cuda")
        p = torch.zeros(4)
        p.add_(1)
        assert p.tolist() == [1.0] * 4


def test_host_write_into_a_pending_d2h_destination_is_a_hazard():
    with pytest.raises(HazardError, match="device-to-host"):
        with simulated_accelerator("lazy") as sim:
            d = torch.arange(4, device="cuda")
            out = torch.empty(4, dtype=torch.int64, pin_memory=True)
            out.copy_(d, non_blocking=True)
            out[0] = 7
            sim.synchronize()


def test_duplicate_scatter_positions_land_in_shuffled_order_in_random_mode():
    winners = set()
    for seed in range(20):
        with simulated_accelerator("random", seed=seed):
            x = torch.zeros(2, device="cuda")
            idx = torch.tensor([0, 0, 0, 1], device="cuda")
            x.scatter_(0, idx, torch.tensor([1.0, 2.0, 3.0, 4.0], device="cuda"))
            y = torch.zeros(2, device="cuda")
            y.index_put_((idx,), torch.tensor([1.0, 2.0, 3.0, 4.0], device="cuda"))
            winners.add((x[0].item(), y[0].item()))
    assert len(winners) > 1  # not always the last write, as on a GPU


def test_threads_share_the_simulated_devices():
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for i in range(30):
                x = torch.full((16,), k * 100 + i, device="cuda")
                y = pinstage.async_tensor_h2d(np.full(16, i), "cuda")
                assert (x - y).tolist() == [k * 100] * 16
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    with simulated_accelerator("random", seed=3):
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
    assert not errors, errors


def test_cuda_graph_capture_and_replay():
    with simulated_accelerator("lazy") as sim:
        buf = pinstage.CpuGpuBuffer(4, dtype=torch.float32, device=sim.device)
        out = torch.zeros(4, device="cuda")
        pinstage.capabilities()  # the probe runs before capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            buf.copy_to_gpu()  # a copy between persistent buffers: safe to capture
            out.copy_(buf.gpu * 2)
            with pytest.raises(RuntimeError, match="capture"):
                pinstage.async_tensor_h2d([1, 2, 3], sim.device)  # would replay recycled memory
        assert sim.pending == 0  # captured, not run
        for k in range(3):
            buf.np[:] = k
            g.replay()
            assert out.tolist() == [2.0 * k] * 4


@pytest.mark.parametrize("illegal", ["synchronize", "item"])
def test_a_sync_inside_a_capture_fails_and_invalidates_it(illegal):
    """As on CUDA: the synchronizing call fails at once (``cudaErrorStreamCaptureUnsupported``)
    and the capture is invalidated, so ending it fails too, even if the caller caught the
    first error."""
    with simulated_accelerator("lazy"):
        out = torch.zeros(4, device="cuda")
        pinstage.capabilities()
        g = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="cudaErrorStreamCaptureInvalidated"):
            with torch.cuda.graph(g):
                out.add_(1)
                with pytest.raises(RuntimeError, match="capturing"):
                    torch.cuda.synchronize() if illegal == "synchronize" else out.sum().item()


def test_a_sticky_driver_error_surfaces_unless_cleared():
    with simulated_accelerator(pin_memory=False) as sim:
        rt = torch.cuda.cudart()
        buf = np.zeros(8, np.uint8)
        assert rt.cudaHostRegister(buf.ctypes.data, 8, 0) != 0
        with pytest.raises(RuntimeError, match="sticky"):
            torch.ones(2, device="cuda") + 1
    with simulated_accelerator(pin_memory=False) as sim:
        assert not pinstage.capabilities().pin_memory  # pinstage's probe failed to pin ...
        assert (torch.ones(2, device=sim.device) + 1).tolist() == [2.0, 2.0]  # ... and cleared


def test_audit_sees_syncs_under_the_simulator():
    with simulated_accelerator("lazy"):
        d = torch.arange(4, device="cuda")
        with pinstage.audit() as report:
            d.sum().item()
            d.cpu()
            torch.arange(4).to("cuda", non_blocking=True)
        kinds = {f.kind for f in report.findings}
        assert {"item", "d2h", "pageable-nonblocking"} <= kinds


def test_sim_launch_and_stats():
    with simulated_accelerator("lazy") as sim:
        x = torch.zeros(3, device="cuda")

        def kernel(t: torch.Tensor) -> None:
            t += 5

        sim.launch(kernel, x, writes=(x,))
        assert sim.pending == 2 and sim.stats.launches >= 2  # the zeros fill, the kernel
        assert x.tolist() == [5.0] * 3
        assert set(sim.stats.as_dict()) >= {"copies", "launches", "host_stalls", "syncs"}


def test_one_simulator_at_a_time_and_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        with simulated_accelerator(mode="fast"):
            pass
    with pytest.raises(ValueError, match="device_count"):
        with simulated_accelerator(device_count=0):
            pass
    with simulated_accelerator():
        with pytest.raises(RuntimeError, match="one at a time"):
            with simulated_accelerator():
                pass


def test_hazard_error_names_itself_plainly():
    assert HazardError.__module__ == "pinstage.testing"
    assert "pinstage._errors" not in repr(HazardError("x"))


def test_factories_are_kernels_on_the_current_stream():
    """zeros/arange... write their values on the stream, so a side stream that does not wait
    for the stream that made a tensor can see garbage, and a graph captures the fill."""
    with simulated_accelerator("lazy"):
        side = torch.cuda.Stream()
        x = torch.arange(4, device="cuda")
        with torch.cuda.stream(side), pytest.raises(HazardError, match="read-after-write"):
            x + 1  # no wait_stream: the arange may not have run (a race, found when queued)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = x + 1
        torch.cuda.current_stream().wait_stream(side)
        assert y.tolist() == [1, 2, 3, 4]
        g = torch.cuda.CUDAGraph()
        src = torch.ones(4, device="cuda")
        with torch.cuda.graph(g):
            acc = torch.zeros(4, device="cuda")
            acc += src
        g.replay()
        g.replay()
        assert acc.tolist() == [1.0] * 4  # zeroed again by each replay


def test_reviewer_findings_stay_fixed():
    with simulated_accelerator("lazy"):
        # an upload and a download through one pinned buffer, in stream order: no hazard
        buf = torch.arange(4.0).pin_memory()
        d = torch.empty(4, device="cuda")
        d.copy_(buf, non_blocking=True)
        d.mul_(2)
        buf.copy_(d, non_blocking=True)
        torch.cuda.synchronize()
        assert buf.tolist() == [0.0, 2.0, 4.0, 6.0]
        # polling an event finishes in lazy mode too
        e = torch.cuda.Event()
        torch.ones(1, device="cuda").add_(1)
        e.record()
        spins = 0
        while not e.query():
            spins += 1
        assert spins < 100
        # .to(int) means a CUDA device index; uint8 poison is not 0
        assert torch.ones(2).to(0).device == torch.device("cuda", 0)
        torch.cuda.empty_cache()  # (a cached block would hold its last owner's bytes)
        assert torch.empty(4, dtype=torch.uint8, device="cuda").cpu().tolist() == [255] * 4
        assert d.type(torch.float64).device.type == "cuda"
    with simulated_accelerator(device_count=2, mode="lazy"):
        a = torch.arange(4.0, device="cuda:0")
        b = a.to("cuda:1")
        a.fill_(-1)  # the peer copy is ordered on the source stream too
        torch.cuda.synchronize()
        assert b.tolist() == [0.0, 1.0, 2.0, 3.0]
    with simulated_accelerator():
        with pytest.raises(NotImplementedError, match="autograd"):
            torch.nn.Linear(3, 2).cuda()


def test_a_thread_pool_outlives_one_simulator():
    from concurrent.futures import ThreadPoolExecutor

    with simulated_accelerator():
        pool = ThreadPoolExecutor(2)
        assert pool.submit(lambda: torch.ones(2, device="cuda").sum().item()).result() == 2.0
    with simulated_accelerator():
        assert pool.submit(lambda: torch.ones(3, device="cuda").sum().item()).result() == 3.0
    pool.shutdown()


# -- issue 19: torch.accelerator, torch.Stream/torch.Event, user patches of torch.cuda,
# PyTorch stand-ins for Triton kernels ---------------------------------------------------------

def test_generic_accelerator_api_answers_for_the_simulated_devices():
    real_stream, real_event, real_graph = torch.Stream, torch.Event, torch.accelerator.Graph
    assert not torch.accelerator.is_available()
    with simulated_accelerator(mode="lazy", device_count=2) as sim:
        acc = torch.accelerator
        assert acc.is_available() and acc.device_count() == 2
        assert acc.current_accelerator() == torch.device("cuda")
        assert acc.current_device_index() == 0
        with acc.device_index(1):
            assert acc.current_device_index() == 1 and torch.cuda.current_device() == 1
        assert acc.current_device_index() == 0
        s = torch.Stream("cuda")
        assert isinstance(s, torch.Stream) and isinstance(s, torch.cuda.Stream)
        assert torch.Stream(device=torch.device("cuda", 1)).device_index == 1
        acc.set_stream(s)
        assert acc.current_stream() is s and torch.cuda.current_stream() is s
        x = torch.ones(3, device="cuda")
        x.add_(1)  # queued on s, not run (lazy)
        assert sim.pending > 0
        acc.synchronize()
        assert sim.pending == 0
        e = torch.Event()
        assert isinstance(e, torch.Event) and isinstance(e, torch.cuda.Event)
        x.mul_(3)
        e.record(s)
        e.synchronize()
        assert sim.pending == 0 and x.tolist() == [6.0, 6.0, 6.0]
        acc.set_stream(torch.cuda.default_stream())
        free, total = acc.get_memory_info(0)
        assert 0 < free <= total
        assert acc.memory_allocated(0) == torch.cuda.memory_allocated(0) > 0  # (x: 3 floats)
        assert acc.memory_stats(0)["active.all.current"] == 1
        assert acc.max_memory_allocated(0) >= acc.memory_allocated(0)
        acc.reset_peak_memory_stats(0)
        assert acc.max_memory_allocated(0) == acc.memory_allocated(0)
        s2, g = torch.Stream(), acc.Graph()
        with s2, g:  # (torch.accelerator.Graph captures the current stream)
            assert s2.is_capturing()
            y = x * 2
        assert not s2.is_capturing()
        g.replay()
        assert y.tolist() == [12.0] * 3
        acc.empty_cache()
        assert acc.get_device_capability(0) == {"major": 9, "minor": 0}
        # the host-side classes still build CPU streams/events
        assert type(torch.Event(device="cpu")) is real_event
    assert torch.Stream is real_stream and torch.Event is real_event
    assert torch.accelerator.Graph is real_graph
    assert not torch.accelerator.is_available() and torch.accelerator.device_count() == 0


def test_the_cuda_entry_points_of_torch_C_and_a_cuda_version_while_open():
    """PyTorch's test harness (common_utils.CudaNonDefaultStream) sets streams and devices
    through torch._C's CUDA entry points, and its graph tests are gated on
    torch.version.cuda: they answer for the simulated devices, and leave with it."""
    built = torch.version.cuda  # None on the CPU build this project tests with
    cpu_build = built is None and getattr(torch.version, "hip", None) is None
    with simulated_accelerator(mode="lazy", device_count=2):
        assert torch.version.cuda == ("12.8" if cpu_build else built)  # (a CUDA build: its own)
        s = torch.cuda.Stream(device=1)
        torch._C._cuda_setStream(stream_id=s.stream_id, device_index=s.device_index,
                                 device_type=s.device_type)
        assert torch.cuda.current_stream(1) is s
        assert torch.cuda.current_stream(0) is torch.cuda.default_stream(0)
        torch._C._cuda_setDevice(1)
        assert torch._C._cuda_getDevice() == 1 == torch.cuda.current_device()
        assert torch.ones(2, device="cuda").device == torch.device("cuda", 1)
        torch._C._cuda_setDevice(0)
        assert torch._C._cuda_getDevice() == 0
        assert torch.cuda._is_compiled() == (not cpu_build)  # (it reads _cuda_getDeviceCount)
        with pytest.raises(RuntimeError, match="no simulated stream with id 12345"):
            torch._C._cuda_setStream(stream_id=12345, device_index=0, device_type=1)
    assert torch.version.cuda == built
    assert hasattr(torch._C, "_cuda_setStream") == (not cpu_build)  # (a CPU build has none)


def test_a_torch_cuda_patch_made_before_the_simulator_keeps_working():
    """vLLM replaces torch.cuda.set_stream at import to track its current stream: the
    simulator leaves the patch in place, and both set_stream calls and stream contexts reach
    it (as torch.cuda.stream does on CUDA), in every thread."""
    import threading

    original = torch.cuda.set_stream
    tracked = threading.local()

    def patched(stream):  # type: ignore[no-untyped-def]
        tracked.value = stream
        original(stream)

    torch.cuda.set_stream = patched
    try:
        for _ in range(2):  # two sessions in a row: not clobbered by either
            with simulated_accelerator() as sim:
                assert torch.cuda.set_stream is patched
                s = torch.cuda.Stream()
                torch.cuda.set_stream(s)
                assert tracked.value is s and torch.cuda.current_stream() is s
                other = torch.cuda.Stream()
                seen = []

                def child(other=other, seen=seen):  # type: ignore[no-untyped-def]
                    with torch.cuda.stream(other):
                        seen.append(tracked.value)
                    seen.append(tracked.value)

                t = threading.Thread(target=child)
                t.start()
                t.join()
                assert seen[0] is other
                assert seen[1] is sim.sched.default_stream()
                assert tracked.value is s  # the main thread's is its own
                torch.cuda.set_stream(torch.cuda.default_stream())
            assert torch.cuda.set_stream is patched
    finally:
        torch.cuda.set_stream = original


def test_a_torch_cuda_patch_made_while_open_survives_and_works_in_the_next_simulator():
    calls = []
    torch_own = torch.cuda.synchronize
    with simulated_accelerator():
        prev = torch.cuda.synchronize

        def counting(device=None):  # type: ignore[no-untyped-def]
            calls.append(device)
            prev(device)

        torch.cuda.synchronize = counting
        torch.cuda.synchronize()
    try:
        assert torch.cuda.synchronize is counting  # not put back over the user's patch
        with simulated_accelerator(mode="lazy") as sim2:
            x = torch.zeros(2, device="cuda")
            x.add_(1)
            assert sim2.pending > 0
            torch.cuda.synchronize()  # the patch reaches the *open* simulator
            assert sim2.pending == 0 and len(calls) == 2
        # the dispatcher the patch wrapped falls back to torch's own outside a simulator
        with pytest.raises((AssertionError, RuntimeError, AttributeError)) as info:
            counting()
        assert "simulat" not in str(info.value)
    finally:
        torch.cuda.synchronize = torch_own


class _FakeJit:
    """The launch protocol of Triton's JITFunction: kernel[grid](...) calls kernel.run."""

    def __getitem__(self, grid):  # type: ignore[no-untyped-def]
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=False, **kwargs)

    def run(self, *args, grid, warmup, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("Triton cannot launch without a GPU")


def _add_through_pointer_table(ptrs, n, grid, BLOCK=1):  # noqa: N803
    """A stand-in in the style of vLLM's block-table kernels: per program, the tensor at the
    address in ``ptrs[program]`` gets program + 1 added."""
    from pinstage.testing import tensor_at

    for g, ptr in enumerate(ptrs.tolist()[: grid[0]]):
        tensor_at(ptr, (n,), torch.int32).add_(g + 1)


@pytest.mark.parametrize("mode", ["eager", "lazy", "random"])
def test_register_kernel_runs_a_stand_in_as_one_queued_kernel(mode):
    from pinstage.testing import register_kernel

    kernel = _FakeJit()
    undo = register_kernel(kernel, _add_through_pointer_table)
    try:
        with simulated_accelerator(mode=mode) as sim:
            a = torch.zeros(4, dtype=torch.int32, device="cuda")
            b = torch.zeros(4, dtype=torch.int32, device="cuda")
            ptrs = torch.tensor([a.data_ptr(), b.data_ptr()], dtype=torch.uint64,
                                device="cuda")
            before = sim.stats.launches
            kernel[(2,)](ptrs, 4)
            assert sim.stats.launches >= before + 1
            if mode == "lazy":
                assert sim.pending > 0  # queued, not run
            assert a.tolist() == [1] * 4 and b.tolist() == [2] * 4
        c = torch.zeros(3, dtype=torch.int32)  # the CPU target: runs at once
        kernel[(1,)](torch.tensor([c.data_ptr()], dtype=torch.uint64), 3)
        assert c.tolist() == [1, 1, 1]
    finally:
        undo()
    with pytest.raises(RuntimeError, match="without a GPU"):
        kernel[(1,)](torch.zeros(1, dtype=torch.uint64), 1)


def test_tensor_at_refuses_addresses_it_cannot_vouch_for():
    from pinstage.testing import register_kernel, tensor_at

    t = torch.arange(8, dtype=torch.int32)
    view = tensor_at(t.data_ptr() + 8, (2, 3), torch.int32)
    assert view.tolist() == [[2, 3, 4], [5, 6, 7]]
    view[0, 0] = 99
    assert int(t[2]) == 99  # the same memory
    with pytest.raises(ValueError, match="no live tensor"):
        tensor_at(t.data_ptr() + 8, (10,), torch.int32)  # runs past its end
    with pytest.raises(ValueError, match="aligned"):
        tensor_at(t.data_ptr() + 2, (1,), torch.int32)
    with pytest.raises(ValueError, match="no live tensor"):
        tensor_at(16, (1,), torch.int32)
    with pytest.raises(TypeError):
        tensor_at("0x10", (1,), torch.int32)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="callable"):
        register_kernel(_FakeJit(), 3)  # type: ignore[arg-type]
    with simulated_accelerator() as sim:
        d = torch.arange(4, dtype=torch.int64, device="cuda")
        torch.cuda.synchronize()
        assert sim.tensor_at(d.data_ptr(), (4,), torch.int64).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("mode", ["eager", "lazy", "random"])
def test_events_time_the_queued_work_on_a_simulated_clock(mode):
    """Issue 17: elapsed_time was 0.0 (PyTorch's own get_cycles_per_ms divides by it). Work
    takes simulated time on its stream: _sleep(cycles) at 1e6 cycles per ms, each op a little;
    a stream that waits on an event starts no earlier than that event."""
    with simulated_accelerator(mode, seed=3):
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        torch.cuda._sleep(2_000_000)
        mid.record()
        torch.cuda._sleep(1_000_000)
        end.record()
        end.synchronize()
        assert start.elapsed_time(mid) == pytest.approx(2.0)
        assert mid.elapsed_time(end) == pytest.approx(1.0)
        assert start.elapsed_time(end) > start.elapsed_time(mid) > 0
        side = torch.cuda.Stream()
        side.wait_event(end)  # the side stream's work starts after `end`
        after = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            torch.ones(4, device="cuda").add_(1)
            after.record()
        after.synchronize()
        assert start.elapsed_time(after) > start.elapsed_time(end)
        with pytest.raises(ValueError, match="recorded"):
            torch.cuda.Event(enable_timing=True).elapsed_time(end)
        assert torch.cuda.default_stream().cuda_stream == 0  # as CUDA's default stream
        assert side.cuda_stream != 0


def test_tensor_new_stays_on_the_simulated_device():
    """Issue 17: ``Tensor.new`` on a cuda tensor returned a CPU tensor."""
    with simulated_accelerator("lazy"):
        x = torch.ones(2, device="cuda", dtype=torch.float64)
        sized, data, size_obj, empty = x.new(3), x.new([1, 2, 3]), x.new(torch.Size([2, 2])), \
            x.new()
        for t in (sized, data, size_obj, empty):
            assert t.device == x.device and t.dtype == torch.float64
        assert (sized.shape, size_obj.shape, empty.shape) == ((3,), (2, 2), (0,))
        assert data.tolist() == [1.0, 2.0, 3.0]
        assert x.new(x) is x


@pytest.mark.parametrize("mode", ["eager", "lazy", "random"])
def test_a_spin_kernel_keeps_its_stream_busy_in_every_mode(mode):
    """PyTorch's tests queue torch.cuda._sleep and expect the stream, its events and what
    waits for it to be unfinished until the host waits (eager mode ran it at once, so
    query() was True right after a 50 ms spin). Work behind the spin, and work on another
    stream that waits for it, waits too; other streams run as the mode says."""
    with simulated_accelerator(mode, seed=5) as sim:
        s, other, free = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
        x = torch.zeros(4, device="cuda")
        torch.cuda.synchronize()
        with torch.cuda.stream(s):
            torch.cuda._sleep(50_000_000)  # 50 ms
            x.add_(1)
            e = torch.cuda.Event()
            e.record()
        other.wait_event(e)
        with torch.cuda.stream(other):
            y = x * 2
        with torch.cuda.stream(free):
            z = torch.ones(2, device="cuda") + 1
        for _ in range(5):
            assert not s.query() and not e.query() and not other.query()
        assert sim.pending >= 4  # the spin, the add, the wait, the multiply
        free.synchronize()
        assert z.tolist() == [2.0, 2.0]
        e.synchronize()  # the host waits: the spin and what is behind it run
        assert s.query() and x.tolist() == [1.0] * 4
        other.synchronize()  # (reading y before that is a race the detector names)
        assert y.tolist() == [2.0] * 4
        with torch.cuda.stream(s):
            torch.cuda._sleep(10_000_000)
        for _ in range(100):  # polling: a device gets there eventually
            if s.query():
                break
        assert s.query()


@pytest.mark.parametrize("mode", MODES)
def test_ops_with_every_argument_shape_give_torchs_values(mode):
    # what the simulator's own argument handling must keep (positional, lists of one and of
    # several tensors, None in an index list, keyword arguments, torch.Size, tuple results),
    # against the same calls on CPU tensors
    def calls(t: torch.Tensor, i: torch.Tensor) -> dict:
        return {
            "add_alpha": torch.add(t, t, alpha=2),
            "cat1": torch.cat([t]),
            "cat2": torch.cat([t, t], dim=1),
            "index_none": t[:, i],
            "index_list": t[i, 1:],
            "reshape_size": t.reshape(torch.Size([4, 3])),
            "split": torch.split(t, 2, dim=1),
            "max_dim": t.max(dim=1).values,
        }

    base = torch.arange(12.0).reshape(3, 4)
    idx = torch.tensor([2, 0])
    cpu = calls(base, idx)
    with simulated_accelerator(mode) as sim:
        got = calls(base.to(sim.device), idx.to(sim.device))
        for k, want in cpu.items():
            have = got[k]
            if isinstance(want, tuple):
                assert len(have) == len(want), k
                for h, w in zip(have, want):
                    assert h.device.type == "cuda" and torch.equal(h.cpu(), w), k
            else:
                assert have.device.type == "cuda" and torch.equal(have.cpu(), want), k


def test_an_in_place_method_returns_its_own_tensor():
    # as in torch: x.masked_fill_(...) is x (methods the simulator runs through its cpu
    # view returned a new wrapper object)
    with simulated_accelerator("eager"):
        x = torch.arange(6.0, device="cuda")
        assert x.masked_fill_(x > 2, 0) is x
        assert x.index_fill_(0, torch.tensor([0], device="cuda"), 7) is x
        assert x.tolist() == [7.0, 1.0, 2.0, 0.0, 0.0, 0.0]


def test_a_race_names_the_users_line_of_both_accesses():
    import inspect

    with pytest.raises(HazardError) as err:
        with simulated_accelerator("eager"):
            x = torch.ones(16, device="cuda")
            first = inspect.currentframe().f_lineno + 1
            x.add_(1)
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                second = inspect.currentframe().f_lineno + 1
                x.mul_(2)  # not ordered after the add_ on the default stream
    text = str(err.value)
    assert f"{__file__}:{first}" in text and f"{__file__}:{second}" in text


def _in_place_views(device: str) -> list[object]:
    x = torch.arange(6.0, device=device).reshape(2, 3)
    out: list[object] = []
    for op in (lambda t: t.t_(), lambda t: t.unsqueeze_(0), lambda t: t.squeeze_(0),
               lambda t: t.transpose_(0, 1), lambda t: t.swapdims_(0, 1),
               lambda t: t.as_strided_((2, 2), (1, 2), 1)):
        assert op(x) is x
        out.append((tuple(x.shape), x.stride(), x.tolist(), (x * 2).tolist(),
                    x.contiguous().view(-1).tolist()))
    return out


@pytest.mark.parametrize("mode", MODES)
def test_in_place_view_ops_change_the_tensors_own_metadata(mode):
    """t_, unsqueeze_, squeeze_, transpose_, swapdims_, as_strided_ change the simulated
    tensor's shape and strides, at once (as views are made), as on a CPU tensor."""
    expected = _in_place_views("cpu")
    with simulated_accelerator(mode):
        assert _in_place_views("cuda") == expected


def _restrided(device: str) -> list[object]:
    out: list[object] = []
    x = torch.arange(16.0, device=device).reshape(1, 4, 2, 2)
    out.append(x.resize_(1, 4, 2, 2, memory_format=torch.channels_last).stride())
    out.append(x.is_contiguous(memory_format=torch.channels_last))
    out.append(x.resize_(1, 4, 2, 2).stride())  # (no memory_format: strides kept)
    out.append(x.resize_(1, 4, 2, 2, memory_format=torch.contiguous_format).stride())
    t = torch.arange(6.0, device=device).reshape(3, 2).t()
    out.append(t.resize_as_(torch.empty(2, 3, device=device)).stride())
    try:
        x.resize_(1, 4, 2, 2, memory_format=torch.preserve_format)
    except RuntimeError as exc:
        out.append(str(exc))
    y = torch.zeros(1, 4, 2, 2, device=device)
    y.resize_(1, 4, 2, 2, memory_format=torch.channels_last)
    y.copy_(torch.arange(16.0, device=device).reshape(1, 4, 2, 2))
    out.append((y.stride(), y.tolist()))
    return out


@pytest.mark.parametrize("mode", MODES)
def test_restriding_past_a_tensors_memory_is_refused(mode):
    """resize_(its shape, memory_format=...) of an expanded tensor needs more memory than
    it has (torch grows the storage): refused as a resize to another storage, not torch's
    internal setStorage error."""
    with simulated_accelerator(mode):
        e = torch.ones(1, 3, device="cuda").expand(2, 3)
        with pytest.raises(NotImplementedError, match="another shape or storage"):
            e.resize_(2, 3, memory_format=torch.contiguous_format)
        assert e.stride() == (0, 1) and e.tolist() == [[1.0] * 3] * 2


@pytest.mark.parametrize("mode", MODES)
def test_resizing_to_its_own_shape_in_another_memory_format_restrides(mode):
    """resize_(its shape, memory_format=channels_last) gives channels-last strides (and
    later ops see them), without memory_format keeps them, preserve_format is torch's error,
    as on CPU."""
    expected = _restrided("cpu")
    with simulated_accelerator(mode):
        assert _restrided("cuda") == expected


@pytest.mark.parametrize("mode", MODES)
def test_resizing_a_device_tensor_to_another_shape_is_refused(mode):
    """resize_ to its own shape is nothing; to another the simulator refuses (the tensor's
    size would stay wrong), naming what to do instead."""
    with simulated_accelerator(mode):
        x = torch.zeros(2, 3, device="cuda")
        assert x.resize_(2, 3) is x and x.resize_as_(torch.empty(2, 3)) is x
        for bad in (lambda: x.resize_(6), lambda: x.resize_as_(torch.empty(3)),
                    lambda: x.set_(torch.zeros(4, device="cuda"))):
            with pytest.raises(NotImplementedError, match="allocate a tensor of the new size"):
                bad()
        assert x.shape == (2, 3) and x.tolist() == [[0.0] * 3] * 2
        a = torch.ones(2, 3, device="cuda")
        out = torch.empty(0, device="cuda")
        with pytest.raises(NotImplementedError, match="out= tensor of the result's shape"):
            torch.add(a, a, out=out)  # (torch would resize out)
        assert out.shape == (0,)
        right = torch.empty(2, 3, device="cuda")
        assert torch.add(a, a, out=right) is right and right.tolist() == [[2.0] * 3] * 2
