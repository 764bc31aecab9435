"""The simulator's direct path (issue 17 item 5): a torch binding seen to be one aten op on the
same arguments goes to that op's handler without the round trip through torch's dispatcher.
It must do what the round trip does: the same values and result types, version counters
bumped for what an op writes, and nothing skipped that a user's own torch mode, or autocast,
would have seen."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from pinstage.testing import MODES, simulated_accelerator

pytestmark = pytest.mark.timeout(300)

CALLS = 3  # the first call of a kind goes through torch (and is learned), the rest direct


def _program(device: str) -> list[object]:
    """Small ops, each called CALLS times, on ``device``: what they give, as host values."""
    out: list[object] = []
    x = torch.arange(6, dtype=torch.float32, device=device)
    y = torch.ones(6, dtype=torch.float32, device=device)
    i = torch.arange(6, device=device)
    m = torch.arange(12.0, device=device).reshape(3, 4)
    for _ in range(CALLS):
        out.append((x + y).tolist())
        out.append((x * 2).tolist())
        out.append((i * 2.5).tolist())  # (an int tensor times a float: promotes)
        out.append(torch.sub(x, y, alpha=3).tolist())
        out.append((x > 2).tolist())
        out.append(torch.where(x > 2, x, y).tolist())
        out.append((x.sum().item(), m.sum(dim=1).tolist(), torch.clamp(x, min=2.0).tolist()))
        x.add_(1)
        y.mul_(2)
        out.append(x.tolist())
        out.append(y.tolist())
        top = m.max(dim=0)
        out.append((type(top).__name__, top.values.tolist(), top.indices.tolist()))
        out.append([t.tolist() for t in m.split(2, dim=1)])
        out.append((x._version, y._version))
    return out


@pytest.mark.parametrize("mode", MODES)
def test_repeated_ops_give_what_cpu_gives(mode):
    """Learned and direct calls give the CPU's values, result types (``max`` a named tuple)
    and version counters (each in-place op bumps its tensor's once)."""
    expected = _program("cpu")
    with simulated_accelerator(mode):
        got = _program("cuda")
    assert got == expected


class _CountingDispatch(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class _CountingFunction(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(getattr(func, "__name__", "?"))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", MODES)
def test_a_users_dispatch_mode_sees_every_call(mode):
    """A dispatch mode the user enters inside the simulator (a FlopCounter, a logging mode,
    CSAN's) sees each op, learned ones too: the direct path steps aside."""
    with simulated_accelerator(mode):
        x = torch.zeros(4, device="cuda")
        for _ in range(CALLS):  # learned before the mode is entered
            x.add_(1)
        with _CountingDispatch() as counting:
            for _ in range(CALLS):
                x.add_(1)
        assert counting.seen.count("add_") == CALLS
        assert x.tolist() == [2.0 * CALLS] * 4


@pytest.mark.parametrize("mode", MODES)
def test_a_users_function_mode_below_the_simulators_sees_every_call(mode):
    """A function mode entered before the simulator opened sits below the simulator's: each
    call still reaches it."""
    with _CountingFunction() as counting:
        with simulated_accelerator(mode):
            x = torch.zeros(4, device="cuda")
            for _ in range(2 * CALLS):
                x.add_(1)
            assert x.tolist() == [2.0 * CALLS] * 4
    assert counting.seen.count("add_") == 2 * CALLS
