"""Kept for one round: the names this module held before it was split by concept.

Pinned memory is now ``_host`` (exact-size regions, accounting, the pinned pool, sizes),
``_arena`` (the staging arena and its limit) and ``_state`` (one ``DeviceState`` per device,
``host_memory_stats``). Import from those; this module only re-exports them, and accepts a
backend where the new classes take its device state.
"""

from __future__ import annotations

from typing import Any

from ._arena import MIN_STAGING_LIMIT, Region, Staging, staging_limit
from ._arena import StagingArena as _StagingArena
from ._capabilities import staging_limit_in_force
from ._device import Backend
from ._host import ALIGN, PAGE, align_up, parse_size
from ._host import HostRegion as _HostRegion
from ._state import DeviceState, device_state, host_memory_stats

__all__ = ["HostRegion", "host_memory_stats", "StagingArena", "Staging", "Region",
           "DeviceState", "device_state", "parse_size", "staging_limit",
           "staging_limit_in_force", "MIN_STAGING_LIMIT", "ALIGN", "PAGE", "align_up"]


class HostRegion(_HostRegion):
    """``_host.HostRegion``; ``backend=``: counted and parked in that backend's device state."""

    def __init__(self, nbytes: int, *, backend: Backend | None = None, **kwargs: Any) -> None:
        if backend is not None:
            state = device_state(backend)
            kwargs.setdefault("account", state.stats)
            kwargs.setdefault("parking", state.parking)
        super().__init__(nbytes, **kwargs)


class StagingArena(_StagingArena):
    """``_arena.StagingArena`` over ``backend``'s device state (drained with it)."""

    def __init__(self, backend: Backend, limit: int, initial: int = 1 << 20) -> None:
        state = device_state(backend)
        super().__init__(state, limit, initial)
        state.extra_arenas.add(self)
