"""The simulator's lanes (issue 17 item 5): a call of the direct path seen once (its binding,
shapes, strides, dtypes, numbers and device) goes straight to its allocation, race check and
queue the next time; and the allocator hands the one block just freed back without pooling
it; and the race checker takes an access whose memory only one stream has touched in fewer
steps. All are shortcuts of the general path, so the reference here is the general path itself:
the same random programs run with the shortcuts off and on must give the same values, the
same addresses, the same ``memory_stats()``, the same counters and the same race errors."""

from __future__ import annotations

import contextlib
import inspect
import random
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from pinstage._sim import _alloc, _ops, _races, _sched, _tensor
from pinstage.testing import HazardError, simulated_accelerator

pytestmark = pytest.mark.timeout(300)

SIZES = (4, 6)


def _step_kinds() -> list[str]:
    return ["add", "mul", "add_", "mul_", "copy_", "index", "setitem", "fill_", "free",
            "new", "stream", "event", "sync"]


def _program(seed: int, n: int = 60) -> list[tuple[Any, ...]]:
    """A random program: ``n`` steps over a few device tensors, two streams, events."""
    rng = random.Random(seed)
    kinds = _step_kinds()
    steps: list[tuple[Any, ...]] = []
    for _ in range(n):
        kind = rng.choice(kinds)
        steps.append((kind, rng.randrange(6), rng.randrange(6), rng.choice(SIZES),
                      rng.choice((0.5, 2, -1.25, 3)), rng.random() < 0.3))
    return steps


def _run(steps: list[tuple[Any, ...]], mode: str, seed: int) -> dict[str, Any]:
    """Run ``steps``; what a user could observe: values, addresses, stats, errors."""
    seen: list[Any] = []
    blocks: dict[int, int] = {}  # address -> the order it was first seen in (a run's own)

    def where(t: torch.Tensor) -> int:
        return blocks.setdefault(t.data_ptr(), len(blocks))

    with simulated_accelerator(mode, seed=seed) as sim:
        side = torch.cuda.Stream()
        streams = [torch.cuda.current_stream(), side]
        live: list[torch.Tensor | None] = [
            torch.arange(size, dtype=torch.float32, device="cuda") for size in SIZES * 3]
        idx = {size: torch.arange(0, size, 2, device="cuda") for size in SIZES}
        for t in live:
            where(t)
        event = torch.cuda.Event()

        def pick(i: int, size: int) -> torch.Tensor:
            for k in range(len(live)):
                t = live[(i + k) % len(live)]
                if t is not None and t.numel() == size:
                    return t
            t = torch.zeros(size, device="cuda")
            live.append(t)
            return t

        for kind, i, j, size, number, on_side in steps:
            stream = streams[1 if on_side else 0]
            try:
                with torch.cuda.stream(stream):
                    a, b = pick(i, size), pick(j, size)
                    if kind == "add":
                        live[i] = a + b
                    elif kind == "mul":
                        live[j] = a * number
                    elif kind == "add_":
                        a.add_(number)
                    elif kind == "mul_":
                        a.mul_(b)
                    elif kind == "copy_":
                        a.copy_(b)
                    elif kind == "index":
                        live[i] = a[idx[size]]
                    elif kind == "setitem":
                        a[1:3] = number
                    elif kind == "fill_":
                        a.fill_(number)
                    elif kind == "free":
                        live[i] = None
                    elif kind == "new":  # (not empty: its garbage differs run to run)
                        live[i] = torch.full((size,), float(number), device="cuda")
                    elif kind == "stream":
                        streams[0].wait_stream(side) if on_side else side.wait_stream(streams[0])
                    elif kind == "event":
                        event.record()
                        streams[0 if on_side else 1].wait_event(event)
                    elif kind == "sync":
                        torch.cuda.synchronize()
                    got = live[i] if kind in ("add", "index", "new") else \
                        live[j] if kind == "mul" else a
                    if got is not None:
                        seen.append((kind, where(got), got._version))
            except HazardError as exc:
                seen.append(("race", re.sub(r"0x[0-9a-f]+", "0x?", str(exc))))
                torch.cuda.synchronize()  # (then the program goes on, ordered again)
        torch.cuda.synchronize()
        values = [t.tolist() if t is not None else None for t in live]
        return {"seen": seen, "values": values, "stats": torch.cuda.memory_stats(),
                "counters": sim.stats.as_dict()}


def _general(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every call on the general path: no lanes, no basic assignment's fill queued directly,
    no recycled block, no race check by the one-stream shortcut."""
    monkeypatch.setattr(_tensor, "_lane_key", lambda func, args: None)
    monkeypatch.setattr(_races.RaceTracker, "_solo", lambda self, *a: False)
    monkeypatch.setattr(_tensor, "_fill_basic", lambda self, view, value: False)
    monkeypatch.setattr(_alloc.Allocator, "_recycle", lambda self, size, stream, req: None)


def _lanes_made() -> int:
    return sum(isinstance(v, _ops._Lane) for v in _tensor._LANES.values())


@pytest.mark.parametrize("mode", ["eager", "lazy", "random"])
@pytest.mark.parametrize("seed", range(6))
def test_lanes_change_nothing_a_user_sees(mode, seed, monkeypatch):
    """A random program gives the same values, addresses, version counters, memory stats,
    counters and race errors with the shortcuts as on the general path."""
    steps = _program(seed)
    _tensor.forget_lanes()
    fast = _run(steps, mode, seed)
    if mode != "random":
        assert _lanes_made() > 0
    with monkeypatch.context() as m:
        _general(m)
        _tensor.forget_lanes()
        slow = _run(steps, mode, seed)
    assert fast["seen"] == slow["seen"]
    assert fast["values"] == slow["values"]
    assert fast["stats"] == slow["stats"]
    assert fast["counters"] == slow["counters"]


def test_the_programs_race_and_reuse_memory():
    """(The programs above exercise what they are meant to: races, and blocks reused.)"""
    races = reused = 0
    for seed in range(6):
        got = _run(_program(seed), "eager", seed)
        races += sum(1 for s in got["seen"] if s[0] == "race")
        ptrs = [s[1] for s in got["seen"] if s[0] in ("add", "index", "new", "mul")]
        reused += len(ptrs) - len(set(ptrs))
    assert races > 0
    assert reused > 0


def _twice(fn: Callable[[], Any]) -> Any:
    fn()  # (learned)
    return fn()  # (its lane, where one is made)


def test_each_common_call_gets_a_lane():
    """``x + y``, ``x.add_(0.5)``, ``z.copy_(y)``, ``x[idx]`` each get a lane the first time
    (a float argument too: torch's parser passes it on as a new object of the same value);
    ``x[1:3] = 2.0`` needs none (its fill is queued directly)."""
    with simulated_accelerator("eager"):
        x = torch.arange(6.0, device="cuda")
        y = torch.ones(6, device="cuda")
        z = torch.empty(6, device="cuda")
        idx = torch.tensor([0, 2, 5], device="cuda")
        _tensor.forget_lanes()
        for fn in (lambda: x + y, lambda: x.add_(0.5), lambda: z.copy_(y), lambda: x[idx]):
            before = _lanes_made()
            _twice(fn)
            assert _lanes_made() == before + 1
        before = _lanes_made()
        _twice(lambda: x.__setitem__(slice(1, 3), 2.0))
        assert _lanes_made() == before
        assert x.tolist() == [1.0, 2.0, 2.0, 4.0, 5.0, 6.0]  # (0..5, +0.5 twice, [1:3] = 2)
        assert x[idx].tolist() == [1.0, 2.0, 6.0]
        assert z.tolist() == [1.0] * 6


def test_a_lane_races_as_the_general_path_does():
    """A race on the second call of a kind (its lane) is found, naming both lines."""
    with simulated_accelerator("eager"):
        x = torch.arange(6.0, device="cuda")
        y = torch.ones(6, device="cuda")
        _twice(lambda: x + y)
        torch.cuda.synchronize()  # (the reads so far are done)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            x.add_(1)  # the write
        with pytest.raises(HazardError, match="test_sim_lanes.py") as err:
            x + y  # the read, unordered after it
        assert "add_" in str(err.value) and "add" in str(err.value)


@pytest.fixture
def no_inference_tensor_yet() -> Iterator[None]:
    """As if no inference tensor had been made in this process before (a lane looks for them
    only once one has)."""
    made = _tensor.INFERENCE_MADE
    was, made[0] = made[0], False
    try:
        yield
    finally:
        made[0] = made[0] or was


@pytest.mark.usefixtures("no_inference_tensor_yet")
def test_a_lane_leaves_inference_tensors_to_torch():
    """An in-place op on an inference tensor outside inference mode raises torch's error,
    also where that kind of call has a lane."""
    with simulated_accelerator("eager"):
        u = torch.ones(4, device="cuda")
        _twice(lambda: u.add_(1))
        with torch.inference_mode():
            t = torch.ones(4, device="cuda")
        for _ in range(2):
            with pytest.raises(RuntimeError, match="[Ii]nference"):
                t.add_(1)
        assert u.tolist() == [3.0] * 4


def test_a_lane_is_not_taken_while_a_graph_captures():
    """A call captured into a graph is recorded there (its lane would run it at once)."""
    with simulated_accelerator("eager"):
        x = torch.arange(4.0, device="cuda")
        y = torch.ones(4, device="cuda")
        _twice(lambda: x + y)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            with torch.cuda.graph(g):
                out = x + y
        x.fill_(10.0)
        g.replay()
        assert out.tolist() == [11.0] * 4


def test_a_lane_inside_a_kernel_body_runs_inline():
    """``x + y`` in ``sim.launch``'s body is part of that kernel (run there, readable)."""
    with simulated_accelerator("lazy") as sim:
        x = torch.arange(4.0, device="cuda")
        y = torch.ones(4, device="cuda")
        _twice(lambda: x + y)
        got: list[Any] = []

        def body() -> None:
            got.append((x + y).tolist())

        sim.launch(body)
        torch.cuda.synchronize()
        assert got == [[1.0, 2.0, 3.0, 4.0]]


def test_a_new_handler_drops_the_lanes():
    """Registering a handler forgets every lane (each was made by the handler before)."""
    with simulated_accelerator("eager"):
        x = torch.arange(4.0, device="cuda")
        _twice(lambda: x + x)
        assert _lanes_made() > 0
        aten_copy = torch.ops.aten.copy_
        _tensor.register_op(aten_copy)(_tensor.OPS[aten_copy])  # (the same one again)
        assert _lanes_made() == 0


def test_a_recycled_block_keeps_the_cache_trim():
    """A block freed while the cache holds more than CACHE_KEEP bytes is not simply handed
    back: freeing it trims the cache first (the biggest free block goes), as the general
    path does."""
    mib = 2**20
    assert _alloc.CACHE_KEEP == 256 * mib
    with simulated_accelerator("eager"):
        c = torch.empty(210 * mib, dtype=torch.uint8, device="cuda")
        del c  # (cached: 210 MiB, under the limit)
        b = torch.empty(100 * mib, dtype=torch.uint8, device="cuda")  # (c's block too big)
        assert torch.cuda.memory_reserved() == 310 * mib
        del b  # 310 MiB cached: the 210 MiB block goes back to the device
        again = torch.empty(100 * mib, dtype=torch.uint8, device="cuda")  # b's block
        assert torch.cuda.memory_reserved() == 100 * mib
        assert torch.cuda.memory_allocated() == again.numel()


def _lane_of(func: Any) -> Any:
    """The one lane of ``func`` (the caller forgot the others first)."""
    lanes = [v for k, v in _tensor._LANES.items() if k[0] is func and v]
    assert len(lanes) == 1
    return lanes[0]


@contextlib.contextmanager
def _failing_add(error: type[BaseException], nth: int) -> Iterator[Any]:
    """(x, y, calls): ``x + y`` has a lane (in the open simulator, made and synchronized
    here) whose kernel raises ``error`` the ``nth`` time it runs; ``calls`` counts its runs."""
    x = torch.arange(4.0, device="cuda")
    y = torch.ones(4, device="cuda")
    _tensor.forget_lanes()
    _twice(lambda: x + y)
    torch.cuda.synchronize()
    lane = _lane_of(torch.Tensor.add)
    calls: list[int] = []
    real = lane.into

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == nth:
            raise error("stop")
        return real(*args, **kwargs)

    lane.into = flaky
    try:
        yield x, y, calls
    finally:
        lane.into = real


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_a_lane_interrupted_or_failing_in_its_kernel(error):
    """Ctrl-C while a lane's kernel runs (eager) leaves it queued, to run again at the next
    wait, as the general path does; an error it raises retires it, and the stream goes on."""
    with simulated_accelerator("eager") as sim, _failing_add(error, 1) as (x, y, calls):
        with pytest.raises(error):
            x + y
        assert sim.pending == (1 if error is KeyboardInterrupt else 0)
        torch.cuda.synchronize()
        assert sim.pending == 0
        assert torch.cuda.current_stream().query()  # (all it was given has run)
        assert len(calls) == (2 if error is KeyboardInterrupt else 1)
        assert (x + y).tolist() == [1.0, 2.0, 3.0, 4.0]


def _totals_after_reset() -> dict[str, int]:
    with simulated_accelerator("eager"):
        x = torch.arange(16.0, device="cuda")
        y = torch.ones(16, device="cuda")
        for _ in range(5):
            out = x + y  # (each frees the last one's block, recycled)
        del out
        torch.cuda.reset_accumulated_memory_stats()
        for _ in range(3):
            out = x + y
        stats = torch.cuda.memory_stats()
        assert out.numel() == 16  # (the last one still held)
        return {k: stats[k] for k in ("allocation.all.allocated", "allocation.all.freed",
                                      "allocated_bytes.all.allocated",
                                      "allocated_bytes.all.freed",
                                      "allocation.all.current", "allocation.all.peak")}


def test_recycled_blocks_count_in_the_running_totals_after_a_reset(monkeypatch):
    """reset_accumulated_memory_stats() forgets the recycles before it (they are counted
    apart until read), and counts those after: 3 allocations, 2 frees, as the general
    path counts them."""
    fast = _totals_after_reset()
    with monkeypatch.context() as m:
        _general(m)
        slow = _totals_after_reset()
    assert fast == slow
    block = 512  # (16 floats: the smallest block)
    assert fast["allocation.all.allocated"] == 3 and fast["allocation.all.freed"] == 3 - 1
    assert fast["allocated_bytes.all.allocated"] == 3 * block
    assert fast["allocated_bytes.all.freed"] == 2 * block


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_queued_kernels_interrupted_or_failing_at_a_wait(error):
    """Lazy mode: kernels queued by lanes run at the host's wait; Ctrl-C in one leaves it
    (and those after) queued, to run at the next wait; an error retires it and the wait
    raises it, the rest run at the next."""
    with simulated_accelerator("lazy") as sim, _failing_add(error, 2) as (x, y, calls):
        outs = [x + y for _ in range(3)]
        assert sim.pending == 3
        with pytest.raises(error):
            torch.cuda.synchronize()
        assert sim.pending == (2 if error is KeyboardInterrupt else 1)
        torch.cuda.synchronize()
        assert sim.pending == 0 and torch.cuda.current_stream().query()
        assert len(calls) == (4 if error is KeyboardInterrupt else 3)
        assert outs[0].tolist() == outs[2].tolist() == [1.0, 2.0, 3.0, 4.0]


def _overlapping_assignment(device: str) -> list[str]:
    out = []
    for dtype in (torch.float32, torch.float16):  # (1e40: float32 refuses it, float16 inf)
        x = torch.ones(1, dtype=dtype, device=device).expand(4)
        for value in (2.0, 1e40, torch.zeros(2, dtype=dtype, device=device)):
            try:
                x[0:2] = value
                out.append("assigned")
            except RuntimeError as exc:
                out.append(str(exc))
        x[0:1] = 3.0  # (one element: no two in one place)
        out.append(str(x.tolist()))
    return out


@pytest.mark.parametrize("mode", ["eager", "lazy", "random"])
def test_an_assignment_into_an_expanded_tensor_raises_at_the_call(mode):
    """An assignment into elements that share memory raises torch's error where it is made
    (not at a later wait), as on CPU; into one element of them it is made."""
    expected = _overlapping_assignment("cpu")
    with simulated_accelerator(mode):
        assert _overlapping_assignment("cuda") == expected


def test_a_lane_of_an_earlier_simulator_with_more_devices_is_not_taken():
    """A tensor of cuda:1 kept from a 2-device simulator, used in a 1-device one: CUDA's
    invalid-ordinal error, as on the general path (its lane was of the earlier one)."""
    with simulated_accelerator("eager", device_count=2):
        a = torch.ones(4, device="cuda:1")
        for _ in range(3):
            a + a
            a.add_(1)
    with simulated_accelerator("eager", device_count=1):
        for op in (lambda: a + a, lambda: a.add_(1)):
            with pytest.raises(RuntimeError, match="invalid device ordinal"):
                op()


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_a_write_on_one_stream_supersedes_its_reads(mode):
    """x read then written on one stream (the one-stream shortcut each time): another
    stream's unordered write races with that write, not with the read it superseded
    (CSAN's report: the last write), and the read is forgotten."""
    with simulated_accelerator(mode) as sim:
        x = torch.arange(6.0, device="cuda")
        y = torch.ones(6, device="cuda")
        torch.cuda.synchronize()
        for _ in range(3):  # (the last time each through its lane)
            x + y  # read of x
            x.add_(1)  # write of x, on the same stream
        held = getattr(x._inner, _races._SPAN)[4]
        assert [p[_races._WHAT] for p in held[2]] == []  # (the reads it covers are gone)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            with pytest.raises(HazardError, match=r"write-after-write.*add_ on the default"):
                x.mul_(2)
        sim.synchronize()


def test_a_lane_behind_queued_work_names_the_users_line():
    """Eager mode, work still queued ahead (a long ``_sleep``): the lane's call is queued
    the general way, and its race still names the user's line of each access."""
    with simulated_accelerator("eager"):
        x = torch.arange(6.0, device="cuda")
        y = torch.ones(6, device="cuda")
        _twice(lambda: x + y)
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            x.add_(1)
            line_w = inspect.currentframe().f_lineno - 1  # type: ignore[union-attr]
        torch.cuda._sleep(10**9)  # (stays queued: a lane's kernel cannot run now)
        with pytest.raises(HazardError) as err:
            x + y
        line_r = err.traceback[0].lineno + 1
        msg = str(err.value)
        assert f"test_sim_lanes.py:{line_r}" in msg and f"test_sim_lanes.py:{line_w}" in msg
        torch.cuda.synchronize()


def _python_keys_excluded() -> tuple[bool, bool]:
    excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
    return (excluded(torch._C.DispatchKey.Python),
            excluded(torch._C.DispatchKey.PythonTLSSnapshot))


def test_a_lanes_kernel_leaves_the_dispatch_keys_as_they_were():
    """Eager mode runs a lane's kernel with the dispatcher's Python keys off (the
    simulator's dispatch mode need not see a host op): on again after it, also after a
    kernel that raised."""
    with simulated_accelerator("eager"):
        x = torch.arange(6.0, device="cuda")
        y = torch.ones(6, device="cuda")
        _twice(lambda: x + y)
        assert _python_keys_excluded() == (False, False)
        good = torch.tensor([0, 5], device="cuda")
        _twice(lambda: x[good])
        bad = torch.tensor([0, 9], device="cuda")
        with pytest.raises((IndexError, RuntimeError), match="out of bounds|index"):
            x[bad]
        assert _python_keys_excluded() == (False, False)
        assert (x + y).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


@pytest.mark.usefixtures("no_inference_tensor_yet")
@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_a_view_is_a_view_of_its_base_and_keeps_its_inference_status(mode):
    """A view op on one simulated tensor (the handler's short way): a view of it (``_base``,
    one version counter), an inference tensor if and only if its base is one, in and out of
    inference mode, for one result or several."""
    with simulated_accelerator(mode):
        x = torch.arange(6.0, device="cuda")
        v = x.view(2, 3)
        assert v._base is x and not v.is_inference()
        v.add_(1)
        assert x._version == v._version == 1
        with torch.inference_mode():
            w = x.view(3, 2)
            t = torch.ones(6, device="cuda")
        assert not w.is_inference() and w._base is x
        assert t.view(2, 3).is_inference()
        parts = t.split(3)
        assert len(parts) == 2 and all(p.is_inference() for p in parts)
        assert all(not p.is_inference() for p in x.split(2))
        assert x.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


def test_a_stream_of_a_closed_simulator_is_refused_on_the_short_way_too():
    """``set_stream`` of a stream another simulator made: the calls that have a lane, and a
    basic assignment, raise the general path's error instead of queuing there."""
    with simulated_accelerator("eager"):
        old = torch.cuda.Stream()
    with simulated_accelerator("eager"):
        x = torch.arange(4.0, device="cuda")
        y = torch.ones(4, device="cuda")
        for _ in range(3):  # (their lanes made)
            x + y
            x.add_(1)
            x[1:3] = 2.0
        torch.cuda.synchronize()
        torch.cuda.set_stream(old)
        for call in (lambda: x + y, lambda: x.add_(1), lambda: x.__setitem__(slice(1, 3), 5.0)):
            with pytest.raises(RuntimeError, match="belongs to a simulator that has closed"):
                call()
        torch.cuda.set_stream(torch.cuda.default_stream())
        assert x.tolist() == [3.0, 2.0, 2.0, 6.0]  # (0..3, then 3 times +1 and [1:3] = 2)


@pytest.mark.parametrize("nth", [1, 2, 3, 4])
def test_an_interrupt_between_the_dispatch_key_switches_leaves_them_on(nth, monkeypatch):
    """An interrupt delivered right after any one of the four switches of an eager kernel's
    Python dispatch keys (off, off, on, on): both are on again after it, the kernel is done
    once the host waits (run then, or already run), and the next simulated op works."""
    with simulated_accelerator("eager"):
        x = torch.arange(4.0, device="cuda")
        y = torch.ones(4, device="cuda")
        _twice(lambda: x + y)
        torch.cuda.synchronize()
        real = _sched._exclude
        calls: list[int] = []

        def flaky(key: Any, off: bool) -> None:
            real(key, off)
            calls.append(1)
            if len(calls) == nth:
                raise KeyboardInterrupt

        monkeypatch.setattr(_sched, "_exclude", flaky)
        with pytest.raises(KeyboardInterrupt):
            x + y
        monkeypatch.setattr(_sched, "_exclude", real)
        assert _python_keys_excluded() == (False, False)
        torch.cuda.synchronize()  # (the kernel, run or still queued, done)
        assert torch.cuda.current_stream().query()
        assert (x * 2).tolist() == [0.0, 2.0, 4.0, 6.0]
