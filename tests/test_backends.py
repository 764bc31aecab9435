"""The device seam's conformance suite: one set of checks every backend passes.

Backends: the CPU target, the generic backend on ``meta``, the CUDA backend over the
simulated driver in every mode (with and without pinned memory and UVA), and the threaded
asynchronous test device (tests/async_device.py). Each check states what a primitive may
rely on, independently of how the backend does it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from async_device import AsyncDevice

from pinstage import UnavailableError
from pinstage._cpu import CpuBackend, GenericBackend
from pinstage._device import DONE, Backend, Fence
from pinstage._state import device_state
from pinstage.testing import simulated_accelerator

BACKENDS = ["cpu", "meta", "async", *(f"sim-{m}-{c}" for m in ("eager", "lazy", "random")
                                      for c in ("pin-uva", "pin-nouva", "nopin"))]


@dataclass
class Subject:
    backend: Backend
    real_data: bool  # device tensors hold values (not meta)
    can_pin: bool
    uva: bool
    sync: Any


@contextlib.contextmanager
def make(name: str) -> Iterator[Subject]:
    if name == "cpu":
        yield Subject(CpuBackend(), True, False, True, lambda: None)
    elif name == "meta":
        yield Subject(GenericBackend(torch.device("meta")), False, False, False, lambda: None)
    elif name == "async":
        dev = AsyncDevice(max_delay_s=0.0005)
        try:
            yield Subject(dev, True, True, False, dev.synchronize)
        finally:
            dev.close()
    else:
        _, mode, pin, *rest = name.split("-")
        uva = rest == ["uva"]
        with simulated_accelerator(mode, seed=1, pin_memory=pin == "pin", uva=uva) as sim:
            yield Subject(sim.backend, True, pin == "pin", uva, sim.synchronize)


@pytest.fixture(params=BACKENDS)
def subject(request: pytest.FixtureRequest) -> Iterator[Subject]:
    with make(request.param) as s:
        yield s


def _host(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device="cpu")


def test_identity(subject):
    b = subject.backend
    assert isinstance(b.device, torch.device)
    assert isinstance(b.name, str) and b.name
    assert isinstance(b.accelerator, bool) and isinstance(b.asynchronous, bool)
    hash(b.current_stream())  # a stream handle is hashable
    assert b.is_capturing() is False
    assert isinstance(b.deferred_read_changed("x"), Exception)


def test_probe_states_facts_with_reasons(subject):
    state = device_state(subject.backend)
    probe = state.probe()
    assert probe is state.probe()  # run once
    assert probe.accelerator == subject.backend.accelerator
    assert probe.reasons and all(isinstance(r, str) for r in probe.reasons)
    assert probe.can_pin == subject.can_pin
    assert (probe.uva and subject.backend.accelerator) == (subject.uva and subject.can_pin
                                                          and subject.backend.accelerator)


def test_host_device_round_trip(subject):
    b = subject.backend
    src = _host([1, 2, 3, 4])
    dev = b.empty((4,), torch.int64)
    b.copy_h2d(dev, src)
    twice = b.empty((4,), torch.int64)
    b.launch(lambda d, s: d.copy_(s * 2), twice, dev)  # a kernel, in stream order
    other = b.zeros((4,), torch.int64)
    b.copy_d2d(other, twice)
    assert not b.is_device_tensor(src)
    if not subject.real_data:  # meta: shapes only, nothing to copy back
        assert b.is_device_tensor(other) and tuple(other.shape) == (4,)
        return
    back = torch.zeros(4, dtype=torch.int64, device="cpu")
    b.copy_d2h(back, other)
    subject.sync()
    assert back.tolist() == [2, 4, 6, 8]
    if b.device.type == "cuda":
        assert b.is_device_tensor(dev)


def test_fence_completes_after_the_work_it_follows(subject):
    b = subject.backend
    state = device_state(b)
    dev = b.empty((1024,), torch.int64)
    b.copy_h2d(dev, torch.arange(1024, device="cpu"))
    fence = state.fence(b.current_stream())
    assert isinstance(fence, Fence)
    if not b.asynchronous:
        assert fence is DONE
    fence.wait_host()
    assert fence.done()
    assert fence.done()  # and stays done (its event given back once)


def test_events_are_reused_only_once_complete(subject):
    """A fence whose work is done never moves forward: events go back to the free list only
    once seen complete, so a later record cannot re-point an older holder's fence."""
    b = subject.backend
    if not b.asynchronous:
        pytest.skip("nothing to fence: work finishes before each call returns")
    state = device_state(b)
    stream = b.current_stream()
    first = state.fence(stream)
    first.wait_host()
    assert first.done()
    for _ in range(40):  # more work and many more fences since
        b.copy_h2d(b.empty((8,), torch.int64), torch.arange(8, device="cpu"))
        state.fence(stream)
    assert first.done()  # still done: nobody re-recorded its event


def test_pinned_memory_and_views(subject):
    b = subject.backend
    state = device_state(b)
    plain = torch.zeros(16, dtype=torch.uint8, device="cpu")
    assert not b.is_pinned(plain)
    if not subject.can_pin:
        if not b.accelerator or isinstance(b, GenericBackend):
            with pytest.raises(UnavailableError):
                b.register_host(plain.data_ptr(), 16)
        return
    pinned = state.alloc_pinned(4096)
    assert pinned.numel() == 4096 and b.is_pinned(pinned)
    if subject.uva and b.accelerator:
        view = b.uva_view(pinned[:8])
        assert b.is_device_tensor(view)
        pinned[:8].fill_(9)  # a host write is seen through the view, with no copy
        out = b.empty((8,), torch.uint8)
        b.copy_d2d(out, view)
        back = torch.zeros(8, dtype=torch.uint8, device="cpu")
        b.copy_d2h(back, out)
        subject.sync()
        assert back.tolist() == [9] * 8


def test_raw_events_follow_their_stream(subject):
    b = subject.backend
    ev = b.new_event()
    b.copy_h2d(b.empty((4,), torch.int64), _host([1, 2, 3, 4]))
    b.record_event(ev, b.current_stream())
    b.wait_event_host(ev)
    assert b.event_done(ev)
