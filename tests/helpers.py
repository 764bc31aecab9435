"""Test helpers: the targets every primitive is run on (CPU, and the simulator in every mode,
with and without pinned memory and UVA)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

import pinstage
from pinstage.testing import Simulator, simulated_accelerator

SIM_CONFIGS = [
    (mode, pin, uva)
    for mode in ("eager", "lazy", "random")
    for pin, uva in ((True, True), (True, False), (False, False))
]


@dataclass
class Target:
    name: str
    device: torch.device
    sim: Simulator | None

    def sync(self) -> None:
        pinstage.synchronize(self.device)

    @property
    def accelerator(self) -> bool:
        return self.sim is not None


TARGET_IDS = ["cpu"] + [f"sim-{m}-{'pin' if p else 'nopin'}-{'uva' if u else 'nouva'}"
                        for m, p, u in SIM_CONFIGS]


@contextlib.contextmanager
def make_target(name: str, seed: int = 0) -> Iterator[Target]:
    if name == "cpu":
        yield Target("cpu", torch.device("cpu"), None)
        return
    _, mode, pin, uva = name.split("-")
    with simulated_accelerator(mode=mode, seed=seed, pin_memory=pin == "pin",
                               uva=uva == "uva") as sim:
        yield Target(name, sim.device, sim)


def reference_equal(actual: torch.Tensor, expected: Any) -> None:
    exp = torch.as_tensor(expected)
    assert actual.shape == exp.shape, (actual.shape, exp.shape)
    assert torch.equal(actual.cpu().to(exp.dtype), exp), (actual, exp)


def run_threads(work: Any, n: int, timeout_s: float = 60.0) -> None:
    """Run ``work(i)`` on ``n`` threads with a tiny switch interval (to interleave them often);
    fail if any is still running after ``timeout_s`` seconds (a hang fails, never passes), and
    re-raise the first error a thread had."""
    import sys
    import threading
    import time

    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=body, args=(t,), daemon=True) for t in range(n)]
        for th in threads:
            th.start()
        deadline = time.monotonic() + timeout_s
        for th in threads:
            th.join(max(0.0, deadline - time.monotonic()))
    finally:
        sys.setswitchinterval(old)
    hung = [th.name for th in threads if th.is_alive()]
    assert not hung, f"threads still running after {timeout_s} s (deadlock?): {hung}"
    if errors:
        raise errors[0]
