"""A user's script as ``mypy --strict`` sees it: pinstage's public types, checked by
tests/test_typing.py (and against the installed package by scripts/check_installed.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import torch

import pinstage
from pinstage.testing import HazardError, SimStats, Simulator, simulated_accelerator


def upload(values: list[int], device: torch.device) -> torch.Tensor:
    return pinstage.async_tensor_h2d(values, device=device, dtype=torch.int32)


def main() -> int:
    pinned: bool = pinstage.PIN_MEMORY
    caps: pinstage.Capabilities = pinstage.capabilities("cpu")
    stats: dict[str, int] = pinstage.host_memory_stats()
    buf = pinstage.CpuGpuBuffer(8, dtype=torch.int32, device="cpu")
    buf.np[:] = 1  # the README's line: an ndarray, not Optional
    arr: npt.NDArray[np.int32] = buf.np
    plain = pinstage.CpuGpuBuffer(8, dtype=torch.int32, device="cpu", with_numpy=False)
    nothing: None = plain.np
    try:
        with simulated_accelerator(mode="lazy") as sim:
            s: Simulator = sim
            counters: SimStats = sim.stats
            copies: int = sim.stats.copies
            out = upload([1, 2, 3], sim.device)
            sim.synchronize()
    except HazardError:
        return 1
    if TYPE_CHECKING:
        reveal_type(buf.np)  # noqa: F821 - mypy only
        reveal_type(plain.np)  # noqa: F821
        reveal_type(pinstage.PIN_MEMORY)  # noqa: F821
        reveal_type(sim)  # noqa: F821
        reveal_type(sim.stats)  # noqa: F821
    del pinned, caps, stats, arr, nothing, s, counters, copies, out
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
