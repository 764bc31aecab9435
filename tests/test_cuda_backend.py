"""The CUDA backend's host-side logic, on a CPU-only machine, with the runtime calls faked.

The backend as a whole runs on the simulated CUDA (every test target ``sim-*``), and on a
real device in test_gpu.py; these tests check what pinstage itself asks of the CUDA runtime:
exact-size registration with the right flags, unregistration once the memory is dead and the
device is done, the error of a failed registration cleared, the WSL rule, and the probe's
fail-closed paths.
"""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

import pinstage
from pinstage import DriverError, _cuda, _registry, _state
from pinstage._state import device_state


def _probe(backend):
    return backend.probe(lambda n: device_state(backend).alloc_pinned(n, in_use=False))


class FakeCudart:
    def __init__(self, fail: bool = False) -> None:
        self.registered: dict[int, tuple[int, int]] = {}
        self.unregistered: list[int] = []
        self.fail = fail

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        if self.fail:
            return 2  # cudaErrorMemoryAllocation
        self.registered[ptr] = (size, flags)
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.unregistered.append(ptr)
        return 0


class FakeRuntime:
    """``cudaGetLastError`` through ctypes: counts the clears."""

    def __init__(self) -> None:
        self.cleared = 0

    def clear_last_error(self) -> None:
        self.cleared += 1


@pytest.fixture
def fake_cuda(monkeypatch, quiet_gc):
    rt = FakeCudart()
    rt.runtime = FakeRuntime()  # type: ignore[attr-defined]
    monkeypatch.setattr(_cuda, "_get_runtime", lambda: rt.runtime)  # type: ignore[attr-defined]
    # no device here: streams and events are trivially complete
    monkeypatch.setattr(_cuda.CudaBackend, "current_stream", lambda self: "stream")
    monkeypatch.setattr(_cuda.CudaBackend, "new_event", lambda self: object())
    monkeypatch.setattr(_cuda.CudaBackend, "record_event", lambda self, event, stream: None)
    monkeypatch.setattr(_cuda.CudaBackend, "event_done", lambda self, event: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "Fake GPU")
    before = set(_state.all_states())
    yield rt
    # The fake's events (plain objects) must not outlive it: a later test's simulated CUDA
    # fences every device that read pinned memory, this fake one included.
    for state in set(_state.all_states()) - before:
        _state._STATES.pop(state.backend, None)
    _registry.forget_resolved()


def test_pinned_memory_is_registered_exactly_and_released(fake_cuda):
    backend = _cuda.CudaBackend(0)
    before = pinstage.host_memory_stats()["reserved_bytes"]
    t = device_state(backend).alloc_pinned(3 * 4096 + 5)
    assert t.dtype == torch.uint8 and t.numel() == 3 * 4096 + 5
    (ptr, (size, flags)), = fake_cuda.registered.items()
    assert ptr == t.data_ptr() and ptr % 4096 == 0
    assert size == 4 * 4096  # exact size, page-rounded: never a power of two
    assert flags == 0x01 | 0x02  # portable | mapped (UVA needs mapped)
    assert pinstage.host_memory_stats()["reserved_bytes"] - before == 4 * 4096
    view = t[10:20]
    del t
    gc.collect()
    assert fake_cuda.unregistered == []  # a view keeps the registration alive
    del view
    gc.collect()
    assert pinstage.host_memory_stats()["reserved_bytes"] == before  # collects parked memory
    assert fake_cuda.unregistered == [ptr]


def test_failed_registration_raises_and_leaks_nothing(monkeypatch, fake_cuda):
    fake_cuda.fail = True
    before = pinstage.host_memory_stats()["reserved_bytes"]
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        backend = _cuda.CudaBackend(0)
        device_state(backend).alloc_pinned(4096)
    assert pinstage.host_memory_stats()["reserved_bytes"] == before
    assert fake_cuda.runtime.cleared == 1  # the failed call's error is not left set


def test_probe_fails_closed_when_pinning_fails(fake_cuda):
    fake_cuda.fail = True
    probe = _probe(_cuda.CudaBackend(0))
    assert probe.accelerator and not probe.can_pin and not probe.uva
    assert any("pinned host memory unavailable" in r for r in probe.reasons)


def test_probe_turns_uva_off_when_mapping_fails(monkeypatch, fake_cuda):
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a, **k: True)

    def no_runtime():  # what _Runtime raises when no libcudart can be loaded
        raise DriverError("cannot find the libcudart runtime library to map pinned memory")

    monkeypatch.setattr(_cuda, "_get_runtime", no_runtime)
    probe = _probe(_cuda.CudaBackend(0))
    assert probe.can_pin and not probe.uva
    assert any("UVA off" in r and "libcudart" in r for r in probe.reasons)


def test_old_wsl_kernel_turns_pinning_off(monkeypatch, fake_cuda):
    from pinstage import _platform

    monkeypatch.setattr(_cuda, "wsl_info", lambda: _platform.wsl_info("4.19.104-microsoft"))
    probe = _probe(_cuda.CudaBackend(0))
    assert not probe.can_pin and any("WSL" in r for r in probe.reasons)
    assert fake_cuda.registered == {}  # it did not even try (a failed pin can be sticky)


def test_new_wsl_kernel_caps_the_staging_arena(monkeypatch, fake_cuda):
    from pinstage import _platform

    monkeypatch.setattr(_cuda, "wsl_info",
                        lambda: _platform.wsl_info("5.15.153.1-microsoft-standard-WSL2"))
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a, **k: True)
    monkeypatch.setattr(_cuda.CudaBackend, "_coherence_probe", lambda self, buf: True)
    probe = _probe(_cuda.CudaBackend(0))
    assert probe.can_pin and probe.uva
    assert probe.staging_limit == 64 * 2**20


def test_probe_reports_a_bug_instead_of_turning_uva_off(monkeypatch, fake_cuda):
    """Only the driver's own failures mean "unavailable": a bug (here a TypeError inside the
    mapping) propagates instead of silently switching UVA off."""
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a, **k: True)

    def broken(self, host):
        raise TypeError("a bug in pinstage")

    monkeypatch.setattr(_cuda.CudaBackend, "uva_view", broken)
    with pytest.raises(TypeError, match="a bug in pinstage"):
        _probe(_cuda.CudaBackend(0))


def test_device_pointer_errors_are_runtime_errors(monkeypatch):
    def get_pointer(out, ptr, flags):
        return 1  # cudaErrorInvalidValue

    class FakeLib:
        cudaHostGetDevicePointer = staticmethod(get_pointer)  # noqa: N815

    monkeypatch.setattr(_cuda._Runtime, "_load", lambda self: FakeLib())
    rt = _cuda._Runtime()
    with pytest.raises(RuntimeError, match="cudaHostGetDevicePointer failed"):
        rt.device_pointer(0x1000)


def test_copies_pick_async_only_from_pinned_contiguous(monkeypatch):
    calls = []

    class Dst:
        def copy_(self, src, non_blocking=False):
            calls.append(non_blocking)

    backend = _cuda.CudaBackend(0)
    src = torch.arange(8)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a, **k: False)
    backend.copy_h2d(Dst(), src)  # pageable: blocking
    backend.copy_h2d(Dst(), src, pinned=True)  # staging memory: async
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a, **k: True)
    backend.copy_h2d(Dst(), src[::2])  # pinned but strided: blocking
    backend.copy_h2d(Dst(), src)  # pinned, contiguous: async
    assert calls == [False, True, False, True]
