"""Which backend serves a device: providers by device type, and device resolution.

A provider (see :class:`Provider`) serves the devices of one type. Providers are registered by
``pinstage/__init__.py`` (CUDA lazily, the CPU, a fallback for every other type) and pushed on
top by whoever overrides one for a while (the simulated CUDA, while it is open); this module
knows no device type by name. ``device=None`` means the first *default* provider that is
available (an accelerator if there is one, else the host).

Tensor facts: while a provider that stands in for real hardware is open, torch itself cannot
say whether host memory is pinned or where a tensor lives (a CPU-only build knows no pinned
memory); :func:`is_pinned_host` and :func:`device_of` ask the innermost pushed
:class:`TensorFacts` first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from ._device import Backend
from ._errors import UnavailableError

__all__ = ["Provider", "TensorFacts", "register_provider", "set_fallback_provider",
           "push_provider", "pop_provider", "push_tensor_facts", "pop_tensor_facts",
           "resolve_device", "get_backend", "is_pinned_host", "device_of", "provider_for"]


class Provider(Protocol):
    """Serves the devices of one type."""

    def why_unavailable(self, device_type: str) -> str | None:
        """Why devices of this type cannot be used in this process (``None``: they can)."""

    def normalize(self, device: torch.device) -> torch.device:
        """``device`` with its index filled in (``cuda`` -> the current ``cuda:i``)."""

    def current_device(self) -> torch.device:
        """The device ``device=None`` means when this provider is the default one."""

    def backend_for(self, device: torch.device) -> Backend:
        """The backend of a normalized ``device``."""


class TensorFacts(Protocol):
    """Facts about tensors that only a stand-in for real hardware knows."""

    def is_pinned(self, t: torch.Tensor) -> bool | None:
        """Whether host tensor ``t`` is pinned, or ``None`` to let torch answer."""

    def device_of(self, t: torch.Tensor) -> torch.device | None:
        """Where ``t`` lives, or ``None`` to let ``t.device`` answer."""


_LOADERS: dict[str, Callable[[], Provider]] = {}  # device type -> loader (imports lazily)
_LOADED: dict[str, Provider] = {}
_DEFAULTS: list[str] = []  # device types asked, in order, what device=None means
_FALLBACK: list[Callable[[], Provider]] = []
_PUSHED: dict[str, list[Provider]] = {}  # device type -> providers pushed on top
_FACTS: list[TensorFacts] = []
_RESOLVED: dict[Any, Backend] = {}  # device argument -> backend (cleared when providers change)


def register_provider(device_type: str, loader: Callable[[], Provider], *,
                      default: bool = False) -> None:
    """Make ``loader()`` (called on first use) the provider of ``device_type`` devices;
    ``default``: asked, in registration order, what ``device=None`` means."""
    _LOADERS[device_type] = loader
    _LOADED.pop(device_type, None)
    if default and device_type not in _DEFAULTS:
        _DEFAULTS.append(device_type)
    _RESOLVED.clear()


def set_fallback_provider(loader: Callable[[], Provider]) -> None:
    """The provider of every device type nobody registered."""
    _FALLBACK[:] = [loader]
    _RESOLVED.clear()


def push_provider(device_type: str, provider: Provider) -> None:
    """Serve ``device_type`` with ``provider`` until :func:`pop_provider` (innermost wins)."""
    _PUSHED.setdefault(device_type, []).append(provider)
    _RESOLVED.clear()


def pop_provider(device_type: str, provider: Provider) -> None:
    stack = _PUSHED.get(device_type, [])
    if provider in stack:
        stack.remove(provider)
    _RESOLVED.clear()


def forget_resolved() -> None:
    """Resolve every device afresh (in a forked child a provider may have become unusable)."""
    _RESOLVED.clear()


def push_tensor_facts(facts: TensorFacts) -> None:
    _FACTS.append(facts)


def pop_tensor_facts(facts: TensorFacts) -> None:
    if facts in _FACTS:
        _FACTS.remove(facts)


def is_pinned_host(t: torch.Tensor) -> bool:
    """``t.is_pinned()``, answered by a pushed stand-in first."""
    for facts in reversed(_FACTS):
        answer = facts.is_pinned(t)
        if answer is not None:
            return answer
    return bool(t.is_pinned())


def device_of(t: torch.Tensor) -> torch.device:
    """Where ``t`` lives (a stand-in's tensors may report another device to torch)."""
    for facts in reversed(_FACTS):
        answer = facts.device_of(t)
        if answer is not None:
            return answer
    return t.device


def provider_for(device_type: str) -> Provider | None:
    """The provider serving ``device_type`` now (``None``: nobody does)."""
    pushed = _PUSHED.get(device_type)
    if pushed:
        return pushed[-1]
    provider = _LOADED.get(device_type)
    if provider is None:
        loader = _LOADERS.get(device_type) or (_FALLBACK[0] if _FALLBACK else None)
        if loader is None:
            return None
        provider = _LOADED.setdefault(device_type, loader())
    return provider


def _default_device() -> torch.device:
    for device_type in _DEFAULTS:
        provider = provider_for(device_type)
        if provider is not None and provider.why_unavailable(device_type) is None:
            return provider.current_device()
    raise UnavailableError("no device is available: no default provider is registered")


def resolve_device(device: Any = None) -> torch.device:
    """The target for ``device`` (``None``: the current accelerator - a simulated one inside
    ``simulated_accelerator`` - else the CPU), with its index."""
    if device is None:
        return _default_device()
    if isinstance(device, torch.dtype):
        raise TypeError(f"device must be a device, got the dtype {device}: pinstage's order is "
                        "async_tensor_h2d(data, device, dtype, out) (vLLM's older one put "
                        "dtype second); pass them by keyword")
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"device must be a torch.device, a string or an int, got {device!r}")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device {device!r} is not a device: {exc}") from None
    provider = provider_for(dev.type)
    if provider is None:
        raise _unavailable(device, f"no pinstage backend serves {dev.type} devices")
    why = provider.why_unavailable(dev.type)
    if why is not None:
        raise _unavailable(device, why)
    return provider.normalize(dev)


def _unavailable(device: Any, why: str) -> UnavailableError:
    return UnavailableError(f"device {device!r} was asked for, but it is not available: {why}",
                            (why,))


def get_backend(device: Any = None) -> Backend:
    """The backend that serves ``device`` (see :func:`resolve_device`)."""
    if device is not None and type(device) in (str, torch.device):
        hit = _RESOLVED.get(device)
        if hit is not None:
            return hit
        backend = _get_backend(device)
        # a device without an index follows the current device: never cached
        if len(_RESOLVED) < 64 and (backend.device.index is None or
                                    torch.device(device).index is not None):
            _RESOLVED[device] = backend
        return backend
    return _get_backend(device)


def _get_backend(device: Any) -> Backend:
    dev = resolve_device(device)
    provider = provider_for(dev.type)
    if provider is None:  # (resolve_device checked it)
        raise UnavailableError(f"no pinstage backend serves {dev.type} devices")
    return provider.backend_for(dev)
