"""The smaller parts of torch.cuda's API that PyTorch's own tests use, on the simulated CUDA
(issue 17 item 4): stream priorities and the CUDA stream protocol, ``Event.device``,
``CUDAGraph.instantiate``/``keep_graph``, the empty-graph warning, ``check_error``,
``get_allocator_backend``, raw streams through ``cudart()``, legacy tensor types,
``torch.cuda.comm`` across two devices, and CUDA's error for host copies during a capture.
Expected values are torch's documented behaviour on CUDA."""

from __future__ import annotations

import ctypes
import re
import warnings

import pytest
import torch

from pinstage.testing import simulated_accelerator

pytestmark = pytest.mark.timeout(120)


def test_stream_priorities_and_protocol():
    with simulated_accelerator("lazy"):
        low, high = torch.cuda.Stream.priority_range()
        assert (low, high) == (0, -3)  # at most 4 levels in PyTorch; lower is higher
        assert torch.cuda.Stream.device_type == 1  # c10's DeviceType::CUDA
        s_low, s_high = torch.cuda.Stream(priority=low), torch.cuda.Stream(priority=high)
        assert (s_low.priority, s_high.priority) == (low, high)
        # outside the range: mapped to the nearest supported priority, as torch documents
        assert torch.cuda.Stream(priority=-100).priority == high
        assert torch.cuda.Stream(priority=7).priority == low
        assert s_low.priority_range() == (low, high) and s_low.device_type == 1
        assert s_high.__cuda_stream__() == (0, s_high.cuda_stream)
        assert torch.cuda.default_stream().__cuda_stream__() == (0, 0)
        assert ctypes.c_void_p(s_high.cuda_stream).value == s_high._as_parameter_.value


def test_event_device_and_handle():
    with simulated_accelerator("lazy", device_count=2):
        e = torch.cuda.Event()
        assert e.device is None and e.cuda_event == 0  # created at its first record
        with torch.cuda.device(1):
            e.record()
        assert e.device == torch.device("cuda", 1)
        assert e.cuda_event != 0 and e.cuda_event == e.cuda_event


def test_graph_instantiate_keep_graph_and_empty_warning():
    with simulated_accelerator("lazy"):
        x = torch.arange(4.0, device="cuda")
        g = torch.cuda.CUDAGraph(keep_graph=True)
        with pytest.raises(RuntimeError, match="capture_end"):
            g.instantiate()
        with torch.cuda.graph(g):
            y = x * 2
        g.instantiate()
        g.replay()
        assert y.tolist() == [0.0, 2.0, 4.0, 6.0]
        lazy = torch.cuda.CUDAGraph(keep_graph=True)  # replay instantiates it
        with torch.cuda.graph(lazy):
            z = x + 1
        lazy.replay()
        assert z.tolist() == [1.0, 2.0, 3.0, 4.0]
        with pytest.raises(NotImplementedError, match="not a cudaGraph_t"):
            lazy.raw_cuda_graph()
        plain = torch.cuda.CUDAGraph()  # keep_graph=False: capture_end instantiates it
        with torch.cuda.graph(plain):
            w = x - 1
        with pytest.raises(RuntimeError, match=r"instantiate\(\) is intended to be called by "
                                               r"the user only when keep_graph=true"):
            plain.instantiate()
        with pytest.raises(RuntimeError, match="unless CUDAGraph was initialized with "
                                               "keep_graph=true"):
            plain.raw_cuda_graph()
        plain.replay()
        assert w.tolist() == [-1.0, 0.0, 1.0, 2.0]
        with pytest.warns(UserWarning, match="The CUDA Graph is empty"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                pass
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a graph with work: no warning
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                x.add_(1)


def test_errors_backend_and_raw_streams():
    with simulated_accelerator("lazy"):
        assert torch.cuda.get_allocator_backend() == "native"
        torch.cuda.check_error(0)  # cudaSuccess: nothing
        with pytest.raises(torch.cuda.CudaError,
                           match=r"^out of memory \(cudaErrorMemoryAllocation, simulated\) \(2\)$"):
            torch.cuda.check_error(2)
        # PyTorch's test_external_streams makes a raw stream so
        cudart = torch.cuda.cudart()
        handle = ctypes.c_ulonglong(0)
        where = ctypes.cast(ctypes.POINTER(ctypes.c_void_p)(handle), ctypes.c_void_p).value
        assert cudart.cudaStreamCreate(where) == 0
        assert handle.value != 0
        ext = torch.cuda.ExternalStream(handle.value)
        assert ext.cuda_stream == handle.value
        with torch.cuda.stream(ext):
            t = torch.ones(3, device="cuda") * 2
        torch.cuda.synchronize()
        assert t.tolist() == [2.0, 2.0, 2.0]
        assert cudart.cudaStreamDestroy(handle.value) == 0
        assert cudart.cudaStreamDestroy(handle.value) == 400  # cudaErrorInvalidResourceHandle
        for call in (lambda: torch.cuda.set_device("cpu"), lambda: torch.cuda.Stream("cpu"),
                     lambda: torch.cuda.device("cpu"), lambda: torch.cuda.synchronize("cpu")):
            with pytest.raises(ValueError, match="Expected a cuda device, but got: cpu"):
                call()
        with pytest.raises(RuntimeError, match="Invalid device, must be cuda device"):
            torch.ones(2).cuda("cpu")


def test_legacy_tensor_types():
    with simulated_accelerator("lazy"):
        t = torch.cuda.FloatTensor(2, 3)
        assert t.device.type == "cuda" and t.shape == (2, 3) and t.dtype == torch.float32
        assert isinstance(t, torch.cuda.FloatTensor) and not isinstance(t, torch.cuda.LongTensor)
        assert not isinstance(torch.ones(2), torch.cuda.FloatTensor)  # a CPU tensor
        values = torch.cuda.LongTensor([1, 2, 3])
        assert values.dtype == torch.int64 and values.tolist() == [1, 2, 3]
        assert values.type() == "torch.cuda.LongTensor"
        assert torch.cuda.ByteTensor().shape == (0,)
        assert torch.cuda.DoubleTensor([1.5]).dtype == torch.float64


def test_comm_across_two_devices():
    with simulated_accelerator("lazy", device_count=2):
        x = torch.arange(6.0, device="cuda:0")
        copies = torch.cuda.comm.broadcast(x, [0, 1])
        assert [c.device for c in copies] == [torch.device("cuda", 0), torch.device("cuda", 1)]
        assert copies[0] is x and copies[1].tolist() == x.tolist()
        parts = torch.cuda.comm.scatter(x, [0, 1])
        assert [(p.device.index, p.tolist()) for p in parts] == [(0, [0.0, 1.0, 2.0]),
                                                                   (1, [3.0, 4.0, 5.0])]
        uneven = torch.cuda.comm.scatter(x, [1, 0], chunk_sizes=[4, 2])
        assert [(p.device.index, len(p)) for p in uneven] == [(1, 4), (0, 2)]
        back = torch.cuda.comm.gather(parts, destination=1)
        assert back.device == torch.device("cuda", 1) and back.tolist() == x.tolist()
        assert torch.cuda.comm.gather(parts, destination=-1).device.type == "cpu"
        assert torch.cuda.comm.reduce_add(copies, 0).tolist() == (x * 2).tolist()
        with pytest.raises(RuntimeError, match="Exactly one"):
            torch.cuda.comm.broadcast(x)
        y = torch.ones(2, device="cuda:0")
        per_device = torch.cuda.comm.broadcast_coalesced([x, y], [0, 1])
        assert per_device[0][0] is x and per_device[0][1] is y
        assert [t.device.index for t in per_device[1]] == [1, 1]
        assert per_device[1][1].tolist() == [1.0, 1.0]


def test_host_copies_during_capture_raise_cudas_error():
    with simulated_accelerator("lazy"):
        x = torch.ones(4, device="cuda")
        pageable = torch.zeros(4)
        pinned = torch.zeros(4).pin_memory()
        message = "Cannot copy between CPU and CUDA tensors during CUDA graph capture"
        for copy in (lambda: x.cpu(), lambda: pageable.copy_(x), lambda: pageable.cuda()):
            g = torch.cuda.CUDAGraph()
            with pytest.raises(RuntimeError, match=message), warnings.catch_warnings():
                warnings.simplefilter("error")  # (a block that raised: no empty warning)
                with torch.cuda.graph(g):
                    copy()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):  # into pinned memory, non-blocking: allowed, as on CUDA
            pinned.copy_(x * 3, non_blocking=True)
        g.replay()
        torch.cuda.synchronize()
        assert pinned.tolist() == [3.0] * 4


def test_small_names_put_back_on_close():
    real = (torch.cuda.FloatTensor, torch.cuda.check_error, torch.cuda.comm.broadcast,
            torch.cuda.get_allocator_backend, torch.cuda.ExternalStream)
    with simulated_accelerator("lazy"):
        assert torch.cuda.FloatTensor is not real[0]
    assert (torch.cuda.FloatTensor, torch.cuda.check_error, torch.cuda.comm.broadcast,
            torch.cuda.get_allocator_backend, torch.cuda.ExternalStream) == real


def test_tensor_type_with_legacy_types_moves_as_torch_does():
    """``Tensor.type(T)``: a ``torch.cuda.*Tensor`` (name or type) is that dtype on the
    device, a ``torch.*Tensor`` that dtype on the CPU, a dtype keeps the device."""
    with simulated_accelerator("lazy"):
        x = torch.arange(3, device="cuda")
        host = torch.arange(3)
        for target in ("torch.cuda.DoubleTensor", torch.cuda.DoubleTensor):
            y = x.type(target)
            assert (y.device.type, y.dtype, y.tolist()) == ("cuda", torch.float64, [0, 1, 2])
            z = host.type(target)
            assert (z.device.type, z.dtype) == ("cuda", torch.float64)
        for target in ("torch.DoubleTensor", torch.DoubleTensor):
            y = x.type(target)
            assert (y.device.type, y.dtype, y.tolist()) == ("cpu", torch.float64, [0, 1, 2])
        assert x.type(torch.float16).device.type == "cuda"
        assert x.type() == "torch.cuda.LongTensor" and host.type() == "torch.LongTensor"
        assert host.type(torch.float16).device.type == "cpu"


# -- what PyTorch's test_cuda.py found next (the outside harness's failures) -----------------

def test_out_of_memory_is_cudas_error_before_any_host_memory_is_taken():
    """An allocation larger than the device fails with CUDA's message (PyTorch's
    test_out_of_memory, test_graph_capture_oom), not the host allocator's, and leaves the
    device usable."""
    with simulated_accelerator("lazy"):
        t = torch.zeros(1024, device="cuda")
        with pytest.raises(torch.cuda.OutOfMemoryError,
                           match=r"Tried to allocate 800000000\.00 GiB\. GPU 0 has a total "
                                 r"capacity of 80\.00 GiB"):
            torch.empty(1024 ** 3 * 800000000, dtype=torch.int8, device="cuda")
        with pytest.raises(torch.cuda.OutOfMemoryError, match="more than 1EB memory"):
            torch.empty(1024 ** 3 * 8000000000, dtype=torch.int8, device="cuda")
        with pytest.raises(torch.cuda.OutOfMemoryError, match="out of memory"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                torch.zeros(2 ** 40, device="cuda")  # 4 TiB of float32
        t.fill_(1)
        assert bool((t == 1).all())
        assert torch.cuda.memory_stats()["num_ooms"] == 3
        big = torch.full((512, 1024), 3.0, device="cuda")  # (over a MiB: memory taken first)
        assert big.sum().item() == 3.0 * 512 * 1024


def test_small_apis_pytorch_tests_use():
    with simulated_accelerator("lazy", device_count=2):
        s = torch.cuda.Stream()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):
            assert not s.is_capturing()
            g.capture_begin()
            assert s.is_capturing()
            torch.ones(2, device="cuda").add_(1)
            g.capture_end()
        assert not s.is_capturing()
        e = torch.cuda.Event()
        assert e.event_id == 0 == e.cuda_event  # (no CUDA event until the first record)
        e.record()
        assert e.event_id != 0 and e.event_id == e.cuda_event
        u0, u1 = (torch.cuda.get_device_properties(i).uuid for i in (0, 1))
        assert len(str(u0)) == 36 and len(u0.bytes) == 16 and u0 != u1
        torch.cuda.nvtx.range_push("step")
        torch.cuda.nvtx.mark("here")
        torch.cuda.nvtx.range_pop()
        torch.cuda.nvtx.range_end(torch.cuda.nvtx.range_start("r"))
        torch._C._cuda_clearCublasWorkspaces()
        torch._C._host_emptyCache()
        with pytest.raises(RuntimeError, match=r"Device index value 2 is out of index range"):
            torch.accelerator.current_stream(2)
        handle = torch.cuda.current_stream().cuda_stream
        assert torch.cuda.get_stream_from_external(handle) is torch.cuda.current_stream()
    with pytest.raises(RuntimeError, match="NVTX functions not installed"):
        torch.cuda.nvtx.range_push("after")  # (torch's own stub again)


def test_raw_allocations_and_accumulated_stats():
    """caching_allocator_alloc/delete count in memory_allocated (PyTorch's
    test_memory_allocation); reset_accumulated_memory_stats zeroes the running totals and
    active.all.current counts the blocks in use."""
    with simulated_accelerator("eager"):
        prev = torch.cuda.memory_allocated()
        ptr = torch.cuda.caching_allocator_alloc(1)
        assert torch.cuda.memory_allocated() > prev
        assert torch.cuda.memory_stats()["active.all.current"] == 1
        torch.cuda.caching_allocator_delete(ptr)
        assert torch.cuda.memory_allocated() == prev
        with pytest.raises(ValueError, match="not an address"):
            torch.cuda.caching_allocator_delete(ptr)
        with pytest.raises(TypeError, match="stream argument"):
            torch.cuda.caching_allocator_alloc(8, stream="s")
        keep = torch.ones(4, device="cuda")
        stats = torch.cuda.memory_stats()
        assert stats["active.all.current"] == 1 == stats["allocation.all.current"]
        assert (stats["allocation.all.allocated"], stats["allocation.all.freed"]) == (2, 1)
        torch.cuda.reset_accumulated_memory_stats()  # (PyTorch: allocated, freed = 0, 0)
        stats = torch.cuda.memory_stats()
        assert (stats["allocation.all.allocated"], stats["allocation.all.freed"]) == (0, 0)
        assert stats["allocation.all.current"] == 1 and stats["num_ooms"] == 0
        assert stats["active_bytes.all.freed"] == 0  # (1 block of 16 bytes held, rounded)
        held = stats["active_bytes.all.current"]
        assert stats["active_bytes.all.allocated"] == 0 < held
        del keep
        stats = torch.cuda.memory_stats()
        assert stats["active_bytes.all.current"] == 0
        assert stats["active_bytes.all.freed"] == held == stats["allocated_bytes.all.freed"]
        assert stats["allocation.all.allocated"] == 0 and stats["allocation.all.freed"] == 1


def test_reseeding_during_a_capture_must_keep_the_seed():
    """CUDA's generator refuses a new seed while its stream captures (the kernels captured
    took the old one): PyTorch's test_graph_manual_seed_mismatch_raises. The same seed is
    accepted."""
    with simulated_accelerator("lazy"):
        torch.cuda.manual_seed(0)
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            torch.cuda.manual_seed(0)
            torch.rand(2, device="cuda")
        with pytest.raises(RuntimeError, match="set_current_seed can be called during stream "
                                               "capture only if new seed is the same"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                torch.cuda.manual_seed(1)
        torch.cuda.manual_seed(1)  # (outside a capture: fine)
        assert torch.cuda.initial_seed() == 1


@pytest.mark.parametrize("mode", ["eager", "lazy", "random"])
def test_external_events_recorded_in_a_graph_time_each_replay(mode):
    """An external event recorded during a capture is a node of the graph: each replay
    records it again, so elapsed_time covers the replayed work (PyTorch's test_graph_timing;
    it was 0.0, the capture's own times)."""
    with simulated_accelerator(mode, seed=2):
        x = torch.ones(8, device="cuda")
        start = torch.cuda.Event(enable_timing=True, external=True)
        end = torch.cuda.Event(enable_timing=True, external=True)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            start.record()
            torch.cuda._sleep(3_000_000)  # 3 ms
            y = x + 1
            end.record()
        torch.cuda.synchronize()
        g.replay()
        torch.cuda.synchronize()
        assert end.query() and start.elapsed_time(end) == pytest.approx(3.001)
        assert y.tolist() == [2.0] * 8
        internal = torch.cuda.Event(enable_timing=True)
        with pytest.raises(RuntimeError, match="capturing"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                internal.record()
                x.add_(1)
            internal.query()  # (recorded in a capture and not external: not a node)


def test_saving_a_simulated_tensor_says_what_to_do():
    """torch.save of a simulated tensor failed deep in pickle ("cannot pickle
    '_thread.RLock' object"); it says what is not supported and what works. copy.deepcopy
    (of a module's buffers, say) failed the same way: it copies on the device."""
    import io
    import pickle

    with simulated_accelerator("lazy"):
        t = torch.arange(4.0, device="cuda")
        with pytest.raises(TypeError, match="cannot be pickled or saved with torch.save"):
            torch.save(t, io.BytesIO())
        with pytest.raises(TypeError, match=r"save t\.cpu\(\)"):
            pickle.dumps([t])
        import copy

        pair = copy.deepcopy({"a": t, "b": t})  # (a copy on the device, shared once)
        assert pair["a"] is pair["b"] and pair["a"] is not t
        assert pair["a"].device == t.device and pair["a"].tolist() == [0.0, 1.0, 2.0, 3.0]
        t.add_(1)  # (the copy is its own memory)
        assert pair["a"].tolist() == [0.0, 1.0, 2.0, 3.0]
        buf = io.BytesIO()
        torch.save(t.cpu(), buf)  # what works
        buf.seek(0)
        assert torch.load(buf, map_location="cpu").cuda().tolist() == [1.0, 2.0, 3.0, 4.0]


def test_simulated_streams_and_events_are_torch_stream_and_event_subclasses():
    """PyTorch's test_generic_stream_event: a torch.cuda stream or event is a subclass of the
    generic torch.Stream/torch.Event (in its MRO), and torch.cuda.Stream(stream_id=...)
    names an existing stream."""
    real_stream, real_event = torch.Stream, torch.Event
    with simulated_accelerator("lazy"):
        generic = torch.Stream("cuda")
        same = torch.cuda.Stream(stream_id=generic.stream_id,
                                 device_index=generic.device_index,
                                 device_type=generic.device_type)
        assert same is generic and same != torch.cuda.current_stream()
        for obj, cls, cuda_cls in ((same, torch.Stream, torch.cuda.Stream),
                                   (torch.cuda.Event(), torch.Event, torch.cuda.Event)):
            assert isinstance(obj, cls) and issubclass(type(obj), cls)
            assert cls in type(obj).mro()
            assert issubclass(type(obj), cuda_cls) and issubclass(cuda_cls, cuda_cls)
            assert not issubclass(int, cls) and not issubclass(int, cuda_cls)
        cpu = torch.Stream("cpu")  # other devices: torch's own, still a torch.Stream
        assert type(cpu) is real_stream and isinstance(cpu, torch.Stream)
        assert issubclass(real_stream, torch.Stream)
    assert torch.Stream is real_stream and torch.Event is real_event


@pytest.mark.parametrize("mode", ["eager", "lazy", "random"])
def test_sync_batchnorm_statistics_kernels_cuda_has_and_a_cpu_build_lacks(mode):
    """torch.batch_norm_stats / _gather_stats(_with_counts) / _elemt (SyncBatchNorm's
    kernels; PyTorch's test_batch_norm_gather_stats) run on simulated tensors, with the
    whole batch's statistics of torch's CPU ops as the reference."""
    torch.manual_seed(0)
    x = torch.randn(6, 3, 4, 5, dtype=torch.float64)
    mean_ref, var_ref = x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False)
    with simulated_accelerator(mode):
        xc = x.cuda()
        mean, invstd = torch.batch_norm_stats(xc, 1e-5)
        assert torch.allclose(mean.cpu(), mean_ref)
        assert torch.allclose(invstd.cpu(), (var_ref + 1e-5).rsqrt())
        parts = [torch.batch_norm_stats(p, 1e-5) for p in (xc[:2], xc[2:])]  # 40 and 80 each
        means = torch.stack([m for m, _ in parts])
        invstds = torch.stack([s for _, s in parts])
        run_mean = torch.zeros(3, dtype=torch.float64, device="cuda")
        run_var = torch.ones(3, dtype=torch.float64, device="cuda")
        counts = torch.tensor([40.0, 80.0], dtype=torch.float64, device="cuda")
        g_mean, g_invstd = torch.batch_norm_gather_stats_with_counts(
            xc, means, invstds, run_mean, run_var, 0.1, 1e-5, counts)
        assert torch.allclose(g_mean.cpu(), mean_ref)
        assert torch.allclose(g_invstd.cpu(), (var_ref + 1e-5).rsqrt())
        assert torch.allclose(run_mean.cpu(), 0.1 * mean_ref)
        assert torch.allclose(run_var.cpu(), 0.9 + 0.1 * x.var((0, 2, 3), unbiased=True))
        y = torch.batch_norm_elemt(xc, None, None, g_mean, g_invstd, 1e-5)
        ref = torch.nn.functional.batch_norm(x, None, None, training=True, eps=1e-5)
        assert torch.allclose(y.cpu(), ref)
        m, s = torch.batch_norm_gather_stats(torch.randn(1, 3, 3, 3, device="cuda"),
                                             torch.ones(2, 3, device="cuda"),
                                             torch.ones(2, 3, device="cuda"),
                                             None, None, 0.1, 1e-5, 2)
        assert m.device.type == "cuda" and m.tolist() == [1.0] * 3 and s.tolist() == [1.0] * 3


def test_comm_checks_its_arguments_as_cuda_does_and_keeps_the_layout():
    """torch.cuda.comm's argument errors are CUDA's (PyTorch's TestCudaComm asserts them);
    a scattered channels_last batch stays channels_last on each device and when gathered;
    a device-to-device .to() keeps a dense tensor's strides (preserve_format)."""
    with simulated_accelerator("lazy", device_count=2):
        x = torch.arange(24.0).reshape(6, 4).cuda()
        outs = [torch.empty(3, 4, device="cuda:0"), torch.empty(3, 4, device="cuda:1")]
        cases = [
            (lambda: torch.cuda.comm.broadcast(x, (0, 1), out=outs),
             "Exactly one of 'devices' and 'out'"),
            (lambda: torch.cuda.comm.broadcast(x, out=[x, x.cpu()]),
             "output tensor at index 1 has device 'cpu'"),
            (lambda: torch.cuda.comm.scatter(x, (0, 1), out=outs),
             "'devices' must not be specified"),
            (lambda: torch.cuda.comm.scatter(x, (0, 1, 0), chunk_sizes=(2, 4)),
             "Expected devices and chunk_sizes to be of same length"),
            (lambda: torch.cuda.comm.scatter(x, ()), "at least one device"),
            (lambda: torch.cuda.comm.scatter(x, out=[]), "at least one output tensor"),
            (lambda: torch.cuda.comm.scatter(x, out=[outs[0], outs[1][1:]]),
             "Total size for output tensors along scatter dim 0"),
            (lambda: torch.cuda.comm.scatter(x, out=[outs[0].unsqueeze(0), outs[1]]),
             "Output tensor at index 0 has incorrect shape"),
            (lambda: torch.cuda.comm.gather(outs, destination="cpu", out=torch.empty(6, 4)),
             "'destination' must not be specified"),
            (lambda: torch.cuda.comm.gather(()), "at least one tensor to gather"),
            (lambda: torch.cuda.comm.gather((outs[0].cpu(), outs[1])),
             "Expected all input tensors to be CUDA tensors"),
            (lambda: torch.cuda.comm.gather((outs[0], outs[1][:, 1:])),
             "Input tensor at index 1 has invalid shape"),
        ]
        for call, message in cases:
            with pytest.raises(RuntimeError, match=re.escape(message)):
                call()
        assert [p.tolist() for p in torch.cuda.comm.scatter(x, out=outs)] == \
            [x[:3].tolist(), x[3:].tolist()]
        nhwc = torch.randn(4, 3, 2, 2).contiguous(memory_format=torch.channels_last)
        parts = torch.cuda.comm.scatter(nhwc, (0, 1))
        cl = torch.channels_last
        assert [(p.device.index, p.is_contiguous(memory_format=cl)) for p in parts] == \
            [(0, True), (1, True)]
        assert torch.cuda.comm.gather(parts).is_contiguous(memory_format=cl)
        assert parts[1].to("cuda:0").stride() == parts[1].stride()
        assert torch.equal(torch.cuda.comm.gather(parts).cpu(), nhwc)


def test_a_torch_cuda_device_object_names_its_device():
    """memory_allocated(torch.cuda.device(1)) is device 1's (PyTorch's
    test_cuda_device_memory_allocated; it was a TypeError)."""
    with simulated_accelerator("lazy", device_count=2):
        before = [torch.cuda.memory_allocated(torch.cuda.device(i)) for i in range(2)]
        keep = torch.ones(1000, device="cuda:1")
        after = [torch.cuda.memory_allocated(torch.cuda.device(i)) for i in range(2)]
        assert after[0] == before[0] and after[1] > before[1]
        del keep
