"""Kernel bodies, closing, sessions (issue 17 item 3): what a ``sim.launch`` body does to
device tensors is part of that kernel; device tensors stay readable after their simulator
closes; closing gives back everything that simulator pinned."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

import pinstage
from pinstage.testing import MODES, HazardError, simulated_accelerator

pytestmark = pytest.mark.timeout(300)


# -- kernel bodies ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_ops_in_a_kernel_body_run_when_it_runs_and_read_values(mode):
    """Device tensors the body closes over are the kernel's: its ops run inline, in order,
    and ``.tolist()``/``.item()`` there read the memory as the kernel sees it."""
    seen: list[object] = []
    with simulated_accelerator(mode) as sim:
        x = torch.arange(4.0, device="cuda")
        out = torch.zeros(4, device="cuda")

        def body() -> None:
            out.copy_(x * 2)
            seen.append(out.tolist())
            out.add_(1)
            seen.append(out.sum().item())

        sim.launch(body)
        after = out * 10  # queued after the kernel: sees all it did
        assert after.tolist() == [10.0, 30.0, 50.0, 70.0]
    assert seen == [[0.0, 2.0, 4.0, 6.0], 16.0]


@pytest.mark.parametrize("mode", MODES)
def test_a_kernel_body_completes_before_an_event_recorded_after_it(mode):
    """The body's own host read (a copy from pinned memory inside it) happens when the
    kernel runs, so once an event recorded after the launch has completed the host may
    rewrite that memory (no HazardError: the body was not requeued behind the event)."""
    with simulated_accelerator(mode) as sim:
        pinned = torch.arange(4.0).pin_memory()
        out = torch.zeros(4, device="cuda")

        def body() -> None:
            out.copy_(pinned, non_blocking=True)

        sim.launch(body)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        pinned.fill_(-1.0)  # the kernel has read it: safe to reuse
        assert out.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_kernel_body_reads_a_value_with_item():
    """``.item()`` inside a body (once: "a kernel cannot wait for the device") reads the
    memory as the kernel sees it."""
    with simulated_accelerator("lazy") as sim:
        x = torch.ones(2, device="cuda")
        values: list[float] = []
        sim.launch(lambda: values.append(x.sum().item()))
        torch.cuda.synchronize()
        assert values == [2.0]


# -- after closing ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_device_tensors_keep_their_values_after_close(mode):
    with simulated_accelerator(mode):
        x = torch.arange(4.0, device="cuda") * 2  # lazy: runs at the final synchronize
        s = torch.ones(1, device="cuda") * 5
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = x + 1
    assert x.tolist() == [0.0, 2.0, 4.0, 6.0]
    assert torch.equal(x.cpu(), torch.tensor([0.0, 2.0, 4.0, 6.0]))
    assert x.cpu().device.type == "cpu"
    assert s.item() == 5.0 and float(s) == 5.0
    assert y.tolist() == [1.0, 3.0, 5.0, 7.0]
    assert x.sum().item() == 12.0 and x[1:].tolist() == [2.0, 4.0, 6.0]
    assert x.to("cpu").tolist() == [0.0, 2.0, 4.0, 6.0]
    assert x.device.type == "cuda"  # still reported where it was made
    assert "device='cuda:0'" in repr(x)
    host = x.cpu()
    host.fill_(0)  # a copy, as .cpu() of a device tensor is
    assert x.tolist() == [0.0, 2.0, 4.0, 6.0]


def test_a_closed_simulators_tensor_is_readable_inside_the_next_one():
    with simulated_accelerator("lazy"):
        x = torch.full((3,), 2.0, device="cuda")
    with simulated_accelerator("lazy"):
        assert (x * 2).tolist() == [4.0, 4.0, 4.0]


# -- closing gives back what it pinned -------------------------------------------------------


def test_forty_sessions_of_one_upload_do_not_keep_their_staging_arenas():
    """Each session uploads 8 MiB through pinstage's staging arena; closing gives it back,
    so 40 sessions do not leave 320 MiB reserved (nor anything in use)."""
    gc.collect()
    before = pinstage.host_memory_stats()
    data = torch.randn(2 * 1024 * 1024)  # 8 MiB of float32
    peak_reserved = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for _ in range(40):
            with simulated_accelerator("lazy"):
                y = pinstage.async_tensor_h2d(data, device="cuda")
            stats = pinstage.host_memory_stats()
            peak_reserved = max(peak_reserved, stats["reserved_bytes"])
            assert stats["reserved_bytes"] <= before["reserved_bytes"], stats
            assert stats["in_use_bytes"] <= before["in_use_bytes"], stats
    assert torch.equal(y.cpu(), data)  # (the last upload is still readable after close)
    assert peak_reserved < 16 * 2**20


def test_closing_keeps_pinned_memory_the_caller_still_holds():
    """What the caller holds (a pinned buffer) stays valid after close and is given back
    when dropped."""
    gc.collect()
    before = pinstage.host_memory_stats()["reserved_bytes"]
    with simulated_accelerator("lazy"):
        buf = pinstage.CpuGpuBuffer(1024, dtype=torch.float32, device="cuda")
        buf.cpu.fill_(3.0)
        buf.copy_to_gpu(1024)
    assert buf.cpu.sum().item() == 3.0 * 1024  # host memory still mapped
    assert pinstage.host_memory_stats()["reserved_bytes"] > before
    del buf
    gc.collect()
    assert pinstage.host_memory_stats()["reserved_bytes"] == before


def test_an_error_inside_still_closes_and_gives_back():
    gc.collect()
    before = pinstage.host_memory_stats()["reserved_bytes"]
    with pytest.raises(HazardError):
        with simulated_accelerator("lazy"):
            pinstage.async_tensor_h2d(torch.randn(1 << 20), device="cuda")
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                torch.ones(4, device="cuda") + torch.ones(4, device="cuda")
            x = torch.ones(4, device="cuda")
            with torch.cuda.stream(side):
                x.add_(1)  # x's fill is on the default stream, unordered: a race
    assert pinstage.host_memory_stats()["reserved_bytes"] == before
