"""What this process can do for a device (probe) and what pinstage will use (policy).

Probes are the backend's (cached per device, run on first ask, never at import); the policy
(``PINSTAGE_PIN_MEMORY`` / ``PINSTAGE_UVA``: ``auto``, ``0`` or ``1``) is read on every call.

A decision that puts an accelerator on a slower path (no pinned staging, no UVA, a platform cap
on the staging arena) is logged once per process and reason, at ``WARNING``, on the logger
named ``pinstage`` (printed as ``pinstage: warning: ...`` where no logging is configured; see
``_logging``).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

from ._arena import staging_limit
from ._device import Backend
from ._errors import UnavailableError
from ._logging import warn
from ._registry import get_backend
from ._state import device_state, on_fork_child

__all__ = ["Capabilities", "capabilities", "capabilities_for", "check_policies",
           "is_pin_memory_available", "is_uva_available", "staging_limit_in_force"]

_POLICY_VALUES = ("auto", "0", "1")

_logged: set[tuple[str, str]] = set()  # (kind, reason) already logged in this process
_logged_lock = threading.Lock()


def _reset_after_fork() -> None:
    """A forked child is a new process: a fresh lock (the parent's may be held) and log again."""
    global _logged_lock
    _logged_lock = threading.Lock()
    _logged.clear()


on_fork_child(_reset_after_fork)


def _log_fallback(kind: str, reason: str, message: str) -> None:
    """Log ``message`` at WARNING unless (``kind``, ``reason``) was logged before."""
    key = (kind, reason)
    with _logged_lock:
        if key in _logged:
            return
        _logged.add(key)
    warn(message)


def _log_fallbacks(device: torch.device, pin: bool, pin_why: str, uva: bool, uva_why: str,
                   cap: int | None, cap_why: str) -> None:
    """Say once per reason that ``device`` runs on a slower path (see the module docstring)."""
    if device.type == "meta":
        return  # a stand-in for tests: no data moves, nothing is slower
    if not pin:
        _log_fallback("pin_memory", pin_why,
                      f"pinned staging is off for {device}: copies from host memory block the "
                      f"host and UVA views are off too ({pin_why})")
    elif not uva:
        _log_fallback("uva", uva_why,
                      f"UVA is off for {device}: UvaBufferPool and StagedWriteTensor use "
                      f"device memory and one copy per hand-out (NonUvaBuffer) ({uva_why})")
    if pin and cap is not None:
        _log_fallback("staging_cap", str(cap),
                      f"pinned staging for {device} is capped at {cap / 2**20:g} MiB by the "
                      f"platform; larger uploads are staged in pieces ({cap_why})")


@dataclass(frozen=True)
class Capabilities:
    """What pinstage will do for ``device``; ``reasons`` says why, one line per decision."""

    device: torch.device
    accelerator: bool
    can_pin: bool
    pin_memory: bool
    uva: bool
    reasons: tuple[str, ...]
    backend: str = "cpu"
    staging_limit: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The fields as JSON-able values (``pinstage doctor --json``'s ``capabilities``)."""
        return {
            "device": str(self.device), "accelerator": self.accelerator,
            "can_pin": self.can_pin, "pin_memory": self.pin_memory, "uva": self.uva,
            "reasons": list(self.reasons), "backend": self.backend,
            "staging_limit": self.staging_limit,
        }


def _policy(name: str) -> str:
    raw = os.environ.get(name, "auto")
    value = raw.strip().lower() or "auto"
    if value not in _POLICY_VALUES:
        raise ValueError(f"{name}={raw!r} is not a valid setting: expected 'auto', '0' or '1'")
    return value


def check_policies() -> None:
    """Raise ``ValueError`` naming the first invalid ``PINSTAGE_PIN_MEMORY``/``PINSTAGE_UVA``."""
    _policy("PINSTAGE_PIN_MEMORY")
    _policy("PINSTAGE_UVA")


_ENV_NAMES = ("PINSTAGE_PIN_MEMORY", "PINSTAGE_UVA", "PINSTAGE_STAGING_LIMIT")
_ENV_KEYS = tuple(os.fsencode(n) for n in _ENV_NAMES)


def _env_key() -> tuple[Any, ...]:
    """The policy variables as they are now. Copies call this every time, so it reads
    CPython's own dict behind ``os.environ`` (kept in step by every ``os.environ`` change)
    where there is one: ~0.1 us instead of ~1 us per variable."""
    data = getattr(os.environ, "_data", None)
    if type(data) is dict and os.name == "posix":
        return (data.get(_ENV_KEYS[0]), data.get(_ENV_KEYS[1]), data.get(_ENV_KEYS[2]))
    return tuple(os.environ.get(n) for n in _ENV_NAMES)


def capabilities_for(backend: Backend) -> Capabilities:
    """Apply the environment policy to ``backend``'s probe (memoised per environment)."""
    key = _env_key()  # probes are fixed per device; only the policy can change
    state = device_state(backend)
    hit = state.caps
    if hit is not None and hit[0] == key:
        return hit[1]  # type: ignore[no-any-return]
    caps = _decide(backend)
    state.caps = (key, caps)
    return caps


def _decide(backend: Backend) -> Capabilities:
    pin_policy = _policy("PINSTAGE_PIN_MEMORY")
    uva_policy = _policy("PINSTAGE_UVA")
    probe = device_state(backend).probe()
    reasons = list(probe.reasons)

    if not probe.accelerator:
        if pin_policy == "1":
            raise UnavailableError("PINSTAGE_PIN_MEMORY=1 but the target is the CPU (no "
                               "accelerator): pinned memory is meaningless there")
        if pin_policy == "0":
            reasons.append("PINSTAGE_PIN_MEMORY=0 in the environment (no effect on the CPU)")
        if uva_policy == "0":
            reasons.append("PINSTAGE_UVA=0 in the environment is ignored on the CPU target: "
                           "host memory is device memory there")
        return Capabilities(backend.device, False, False, False, True, tuple(reasons),
                            backend.name, None)

    pin = probe.can_pin
    # a probe stops at the first thing that fails, so its last line says why (the key of the
    # once-per-reason log: the same failure on several devices is logged once)
    pin_why = uva_why = probe.reasons[-1] if probe.reasons else "the probe found no way"
    if pin_policy == "0":
        pin = False
        pin_why = "PINSTAGE_PIN_MEMORY=0 in the environment"
        reasons.append("PINSTAGE_PIN_MEMORY=0 in the environment: pinned staging is off; "
                       "copies from host memory block the host")
    elif pin_policy == "1":
        if not probe.can_pin:
            raise UnavailableError("PINSTAGE_PIN_MEMORY=1 but pinned memory cannot be "
                                   f"allocated for {backend.device}: "
                                   + "; ".join(probe.reasons), probe.reasons)
        reasons.append("PINSTAGE_PIN_MEMORY=1 in the environment")
    elif not probe.can_pin:
        reasons.append("pinned memory unavailable: copies from host memory block the host")

    uva = probe.uva and pin
    if uva_policy == "0":
        uva = False
        uva_why = "PINSTAGE_UVA=0 in the environment"
        reasons.append("PINSTAGE_UVA=0 in the environment: UVA views are off (buffers use "
                       "device memory and copies instead)")
    elif uva_policy == "1":
        if not (probe.uva and pin):
            why = ("it needs pinned memory, which is off" if probe.uva else
                   "the device cannot map pinned host memory here")
            raise UnavailableError(f"PINSTAGE_UVA=1 but UVA is impossible for "
                                   f"{backend.device}: {why}", probe.reasons)
        reasons.append("PINSTAGE_UVA=1 in the environment")
    elif probe.uva and not pin:
        reasons.append("UVA off: it needs pinned memory, which is off")
    limit = staging_limit(probe.staging_limit) if pin else None
    platform_cap = (limit if pin and probe.staging_limit is not None
                    and not os.environ.get("PINSTAGE_STAGING_LIMIT", "").strip() else None)
    cap_why = "; ".join(r for r in probe.reasons if "cap" in r) or "; ".join(probe.reasons)
    _log_fallbacks(backend.device, pin, pin_why, uva, uva_why, platform_cap, cap_why)
    return Capabilities(backend.device, True, probe.can_pin, pin, uva, tuple(reasons),
                        backend.name, limit)


def capabilities(device: Any = None) -> Capabilities:
    """What this process can do for ``device`` (default: the simulator inside
    ``simulated_accelerator``, else the current accelerator, else the CPU)."""
    return capabilities_for(get_backend(device))


def is_pin_memory_available(device: Any = None) -> bool:
    """Shorthand for ``capabilities(device).pin_memory``."""
    return capabilities(device).pin_memory


def is_uva_available(device: Any = None) -> bool:
    """Shorthand for ``capabilities(device).uva``."""
    return capabilities(device).uva


def staging_limit_in_force(device: Any = None) -> int | None:
    """The staging cap ``device``'s arena uses (read once, at its first use; made now if it
    was not used yet), or ``None`` where pinned staging is off. For ``pinstage doctor``."""
    backend = get_backend(device)
    if not capabilities_for(backend).pin_memory:
        return None
    return device_state(backend).arena().limit
