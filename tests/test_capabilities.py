"""capabilities(): probes, policy overrides, WSL rule."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pinstage
from pinstage._platform import wsl_info
from pinstage.testing import simulated_accelerator


def test_cpu_target():
    caps = pinstage.capabilities("cpu")
    assert caps.device == torch.device("cpu")
    assert not caps.accelerator and not caps.can_pin and not caps.pin_memory and caps.uva
    assert any("CPU" in r for r in caps.reasons)
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.uva = False  # type: ignore[misc]


def test_default_device_without_gpu_is_cpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert pinstage.capabilities().device == torch.device("cpu")
    assert pinstage.is_pin_memory_available() is False
    assert pinstage.is_uva_available() is True
    assert pinstage.PIN_MEMORY is False


@pytest.mark.parametrize("var", ["PINSTAGE_PIN_MEMORY", "PINSTAGE_UVA"])
def test_off_switch_is_explained(monkeypatch, var):
    monkeypatch.setenv(var, "0")
    with simulated_accelerator():
        caps = pinstage.capabilities()
        assert caps.uva is False
        if var == "PINSTAGE_PIN_MEMORY":
            assert caps.pin_memory is False and caps.can_pin is True
        assert any(f"{var}=0" in r for r in caps.reasons)


def test_force_on_where_impossible_raises(monkeypatch):
    monkeypatch.setenv("PINSTAGE_UVA", "1")
    with simulated_accelerator(uva=False):
        with pytest.raises(RuntimeError, match="UVA"):
            pinstage.capabilities()
    monkeypatch.setenv("PINSTAGE_UVA", "auto")
    monkeypatch.setenv("PINSTAGE_PIN_MEMORY", "1")
    with simulated_accelerator(pin_memory=False):
        with pytest.raises(RuntimeError, match="PIN_MEMORY"):
            pinstage.capabilities()
    with pytest.raises(RuntimeError):
        pinstage.capabilities("cpu")
    with simulated_accelerator():
        assert pinstage.capabilities().pin_memory


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_bad_policy_value(monkeypatch, value):
    monkeypatch.setenv("PINSTAGE_PIN_MEMORY", value)
    with pytest.raises(ValueError, match="PINSTAGE_PIN_MEMORY"):
        pinstage.capabilities("cpu")


def test_policy_is_read_on_each_call(monkeypatch):
    with simulated_accelerator():
        assert pinstage.PIN_MEMORY is True
        monkeypatch.setenv("PINSTAGE_PIN_MEMORY", "0")
        assert pinstage.PIN_MEMORY is False
        assert pinstage.is_uva_available() is False


def test_uva_needs_pinned_memory(monkeypatch):
    monkeypatch.setenv("PINSTAGE_PIN_MEMORY", "0")
    monkeypatch.setenv("PINSTAGE_UVA", "1")
    with simulated_accelerator():
        with pytest.raises(RuntimeError, match="pinned"):
            pinstage.capabilities()


def test_wsl_detection():
    assert wsl_info("6.1.0-18-amd64") is None
    new = wsl_info("5.15.153.1-microsoft-standard-WSL2")
    assert new is not None and new.pinning_works
    old = wsl_info("4.19.104-microsoft-standard")
    assert old is not None and not old.pinning_works


def test_bad_device():
    with pytest.raises(TypeError):
        pinstage.capabilities(3.5)
    with pytest.raises(ValueError):
        pinstage.capabilities("nodevice")


def test_meta_device_is_an_accelerator_without_pinning():
    caps = pinstage.capabilities("meta")
    assert caps.accelerator and not caps.pin_memory and not caps.uva


def test_unavailable_devices_are_refused_clearly():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    for dev in ("cuda", "cuda:0"):
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            pinstage.capabilities(dev)
        with pytest.raises(RuntimeError):
            pinstage.async_tensor_h2d([1], dev)
