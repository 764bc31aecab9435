"""The simulated CUDA's stream-race detector (issue 17 item 1): a read or write on one stream
that is not ordered after a conflicting access on another raises HazardError when it is
queued, in every mode and seed, naming both accesses; correctly fenced twins raise nothing.

The racy programs follow CSAN's (``torch.cuda._sanitizer``) patterns: a write on one stream
read on another without a wait, a read then a write on another stream, two writes, and a
non_blocking upload on a side stream used without a wait.
"""

from __future__ import annotations

import re
import sys
from typing import Any

import pytest
import torch

import pinstage
from pinstage.testing import HazardError, simulated_accelerator

pytestmark = pytest.mark.timeout(120)

SCHEDULES = [("eager", 0), ("lazy", 0), *(("random", s) for s in range(4))]
FENCES = ["wait_stream", "wait_event", "event_wait", "synchronize", "stream_synchronize",
          "event_synchronize", "query"]
HERE = __file__.rsplit("/", 1)[-1]


def next_line() -> int:
    """The line after the caller's (where the access under test is queued)."""
    return sys._getframe(1).f_lineno + 1


def fence(kind: str | None, waiter: torch.cuda.Stream, waited: torch.cuda.Stream) -> None:
    """Order ``waiter``'s later work after ``waited``'s work so far (``None``: don't)."""
    if kind is None:
        return
    if kind == "wait_stream":
        waiter.wait_stream(waited)
    elif kind == "wait_event":
        waiter.wait_event(waited.record_event())
    elif kind == "event_wait":
        e = torch.cuda.Event()
        e.record(waited)
        e.wait(waiter)
    elif kind == "synchronize":
        torch.cuda.synchronize()
    elif kind == "stream_synchronize":
        waited.synchronize()
    elif kind == "event_synchronize":
        e = torch.cuda.Event()
        e.record(waited)
        e.synchronize()
    elif kind == "query":
        e = waited.record_event()
        while not e.query():  # the host polls until the work is done: ordered after it
            pass
    else:
        raise AssertionError(kind)


def lines_named(message: str) -> set[int]:
    return {int(n) for n in re.findall(re.escape(HERE) + r":(\d+)", message)}


# -- the three kinds of race, across two streams ---------------------------------------------


def raw(kind: str | None) -> tuple[list[float], tuple[int, int]]:
    """Write on a side stream, read on the main stream."""
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    a = torch.ones(4, device="cuda")
    side.wait_stream(main)
    with torch.cuda.stream(side):
        w = next_line()
        b = a * 2
    fence(kind, main, side)
    r = next_line()
    c = b + 1
    return c.tolist(), (w, r)


def war(kind: str | None) -> tuple[list[float], tuple[int, int]]:
    """Read on the main stream, then write on a side stream."""
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    a = torch.ones(4, device="cuda")
    r = next_line()
    c = a + 1
    fence(kind, side, main)
    with torch.cuda.stream(side):
        w = next_line()
        a.mul_(3)
    main.wait_stream(side)
    return c.tolist() + a.tolist(), (r, w)


def waw(kind: str | None) -> tuple[list[float], tuple[int, int]]:
    """Write on the main stream, then on a side stream."""
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    a = torch.empty(4, device="cuda")
    w1 = next_line()
    a.fill_(2.0)
    fence(kind, side, main)
    with torch.cuda.stream(side):
        w2 = next_line()
        a.fill_(5.0)
    main.wait_stream(side)
    return a.tolist(), (w1, w2)


RACES = {
    "raw": (raw, "read-after-write", ("mul", "add"), [3.0] * 4),
    "war": (war, "write-after-read", ("add", "mul_"), [2.0] * 4 + [3.0] * 4),
    "waw": (waw, "write-after-write", ("fill_", "fill_"), [5.0] * 4),
}


@pytest.mark.parametrize("mode,seed", SCHEDULES)
@pytest.mark.parametrize("race", sorted(RACES))
def test_a_race_raises_when_queued_naming_both_accesses(race, mode, seed):
    program, kind, (first_op, second_op), _ = RACES[race]
    with simulated_accelerator(mode, seed=seed):
        with pytest.raises(HazardError) as info:
            program(None)
    msg = str(info.value)
    assert f"stream race ({kind})" in msg
    # both accesses: the operation, the stream, the tensor and the user's line of each
    first, second = msg.split("it is not ordered after")
    assert first_op in second and second_op in first
    assert "the default stream of cuda:0" in msg and re.search(r"stream \d+ of cuda:0", msg)
    assert "torch.float32 tensor of shape (4,)" in first and \
        "torch.float32 tensor of shape (4,)" in second
    assert len(lines_named(msg)) == 2


@pytest.mark.parametrize("mode,seed", SCHEDULES)
@pytest.mark.parametrize("race", sorted(RACES))
def test_the_lines_named_are_the_two_accesses(race, mode, seed):
    program, _, _, _ = RACES[race]
    lines: list[tuple[int, int]] = []

    def record_lines() -> None:
        try:
            program(None)
        except HazardError as exc:
            lines.append(tuple(sorted(lines_named(str(exc)))))  # type: ignore[arg-type]
            raise

    with simulated_accelerator(mode, seed=seed):
        with pytest.raises(HazardError):
            record_lines()
    # the program's own (w, r) lines: run its fenced twin to learn them
    with simulated_accelerator(mode, seed=seed):
        _, expected = program("wait_stream")
    assert lines == [tuple(sorted(expected))]


@pytest.mark.parametrize("mode,seed", SCHEDULES)
@pytest.mark.parametrize("kind", FENCES)
@pytest.mark.parametrize("race", sorted(RACES))
def test_the_fenced_twin_raises_nothing_and_is_right(race, kind, mode, seed):
    program, _, _, want = RACES[race]
    with simulated_accelerator(mode, seed=seed):
        got, _ = program(kind)
    assert got == want


def test_the_race_raises_before_anything_runs_in_lazy_mode():
    """Not found by running it: the racy read is refused when queued, with the side
    stream's write still queued (so no schedule can hide it)."""
    with simulated_accelerator("lazy") as sim:
        side = torch.cuda.Stream()
        a = torch.ones(4, device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            b = a * 2
        pending = sim.pending
        with pytest.raises(HazardError, match="read-after-write"):
            b + 1
        assert sim.pending == pending  # nothing ran and the racy op was not queued


# -- copies ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode,seed", SCHEDULES)
@pytest.mark.parametrize("wait", [False, True])
def test_a_non_blocking_upload_on_a_side_stream_needs_a_wait(mode, seed, wait):
    """CSAN's pattern: an H2D copy queued on a copy stream, its destination used on the
    compute stream."""
    with simulated_accelerator(mode, seed=seed):
        src = torch.arange(8.0).pin_memory()
        copy_stream = torch.cuda.Stream()
        with torch.cuda.stream(copy_stream):
            dst = src.to("cuda", non_blocking=True)
        if wait:
            torch.cuda.current_stream().wait_stream(copy_stream)
            assert (dst * 2).tolist() == [2.0 * i for i in range(8)]
        else:
            with pytest.raises(HazardError, match=r"read-after-write.*mul.*host-to-device "
                               r"copy"):
                dst * 2


@pytest.mark.parametrize("mode,seed", SCHEDULES)
@pytest.mark.parametrize("read", ["cpu", "item", "tolist", "non_blocking_cpu"])
def test_downloads_are_reads_on_the_current_stream(mode, seed, read):
    """``.cpu()``/``.item()`` copy on the current stream: a tensor written on another stream
    without a wait is a race, though the host waits for its own stream."""
    with simulated_accelerator(mode, seed=seed):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x = torch.full((1,), 7.0, device="cuda")
        with pytest.raises(HazardError, match="read-after-write"):
            if read == "cpu":
                x.cpu()
            elif read == "item":
                x.item()
            elif read == "tolist":
                x.tolist()
            else:
                x.to("cpu", non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)
        assert x.item() == 7.0


@pytest.mark.parametrize("mode,seed", SCHEDULES)
def test_a_device_to_device_copy_reads_and_writes(mode, seed):
    with simulated_accelerator(mode, seed=seed):
        main, side = torch.cuda.current_stream(), torch.cuda.Stream()
        a = torch.ones(4, device="cuda")
        b = torch.empty(4, device="cuda")
        with torch.cuda.stream(side), pytest.raises(HazardError, match=r"read-after-write.*"
                                                    r"device-to-device copy.*fill"):
            b.copy_(a)  # a's fill ran on main; side has not waited
        side.wait_stream(main)
        with torch.cuda.stream(side):
            b.copy_(a)
        with pytest.raises(HazardError, match="read-after-write"):
            b.sum()
        main.wait_stream(side)
        assert b.sum().item() == 4.0


@pytest.mark.parametrize("mode", ["eager", "lazy", "random"])
def test_disjoint_parts_of_one_tensor_on_two_streams_do_not_race(mode):
    with simulated_accelerator(mode):
        main, side = torch.cuda.current_stream(), torch.cuda.Stream()
        a = torch.zeros(8, device="cuda")
        side.wait_stream(main)
        a[:4].fill_(1.0)
        with torch.cuda.stream(side):
            a[4:].fill_(2.0)  # other bytes: no race
            with pytest.raises(HazardError, match="write-after-write"):
                a[3:5].fill_(3.0)  # overlaps main's part
        main.wait_stream(side)
        assert a.tolist() == [1.0] * 4 + [2.0] * 4


# -- kernels, graphs, pinstage's own calls ---------------------------------------------------


@pytest.mark.parametrize("mode,seed", SCHEDULES)
def test_sim_launch_declares_its_accesses(mode, seed):
    def scale(out: torch.Tensor, x: torch.Tensor) -> None:
        out.copy_(x * 10)

    with simulated_accelerator(mode, seed=seed) as sim:
        main, side = torch.cuda.current_stream(), torch.cuda.Stream()
        x = torch.arange(4.0, device="cuda")
        out = torch.empty(4, device="cuda")
        with torch.cuda.stream(side), pytest.raises(HazardError, match=r"kernel scale.*"
                                                    r"fill"):
            sim.launch(scale, out, x, writes=(out,))  # reads x before its fill is ordered
        side.wait_stream(main)
        with torch.cuda.stream(side):
            sim.launch(scale, out, x, writes=(out,))
        with pytest.raises(HazardError, match=r"read-after-write.*kernel scale"):
            out.sum()
        main.wait_stream(side)
        assert out.tolist() == [0.0, 10.0, 20.0, 30.0]


@pytest.mark.parametrize("mode,seed", SCHEDULES)
def test_a_graph_replayed_on_a_stream_is_checked(mode, seed):
    with simulated_accelerator(mode, seed=seed):
        main, side = torch.cuda.current_stream(), torch.cuda.Stream()
        static_in = torch.ones(4, device="cuda")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_out = static_in * 3
        side.wait_stream(main)
        with torch.cuda.stream(side):
            g.replay()
        with pytest.raises(HazardError, match=r"read-after-write.*graph replay"):
            static_out.sum()
        main.wait_stream(side)
        assert static_out.tolist() == [3.0] * 4


@pytest.mark.parametrize("mode,seed", SCHEDULES)
def test_pinstage_uploads_on_a_side_stream_need_a_wait(mode, seed):
    with simulated_accelerator(mode, seed=seed):
        main, side = torch.cuda.current_stream(), torch.cuda.Stream()
        with torch.cuda.stream(side):
            x = pinstage.async_tensor_h2d([1.0, 2.0, 3.0], device="cuda")
        with pytest.raises(HazardError, match="read-after-write"):
            x + 1
        main.wait_stream(side)
        assert (x + 1).tolist() == [2.0, 3.0, 4.0]


def test_memory_freed_and_reused_does_not_inherit_old_accesses():
    """Accesses belong to the storage: a new tensor (even at a reused address) starts
    clean, and so does a tensor made under another simulator."""
    for _ in range(3):
        with simulated_accelerator("lazy"):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(20):
                    t = torch.ones(16, device="cuda")  # freed each round on the host
            torch.cuda.synchronize()
            fresh = torch.empty(16, device="cuda")
            fresh.fill_(1.0)  # nothing earlier touched this storage
            assert fresh.sum().item() == 16.0
            del t


def _side_then_default(side: Any, default: Any) -> tuple[torch.Tensor, torch.cuda.Stream]:
    """A 4x4 zeros matrix ``a``: ``side(a)`` queued on a side stream ordered after the zeros,
    then ``default(a)`` on the default stream with no wait for it; (a, the side stream)."""
    a = torch.zeros(4, 4, device="cuda")
    s1 = torch.cuda.Stream()
    s1.wait_stream(torch.cuda.current_stream())  # (after the zeros)
    with torch.cuda.stream(s1):
        side(a)
    default(a)
    return a, s1


@pytest.mark.parametrize("mode,seed", SCHEDULES)
def test_strided_accesses_race_only_where_their_elements_meet(mode, seed):
    """Column blocks of one matrix interleave in memory: two streams writing a[:, :2] and
    a[:, 2:] share no byte (no race, whatever the byte ranges' hulls say), a[:, :3] and
    a[:, 2:] share column 2 (a race); a strided write does not cover the bytes between its
    elements, so an earlier access there is still checked."""
    with simulated_accelerator(mode, seed=seed):
        a, s1 = _side_then_default(lambda a: a[:, :2].add_(1),
                                   lambda a: a[:, 2:].add_(2))  # (disjoint columns: no race)
        torch.cuda.current_stream().wait_stream(s1)
        assert a.tolist() == [[1.0, 1.0, 2.0, 2.0]] * 4
    with pytest.raises(HazardError, match=r"write-after-write"):
        with simulated_accelerator(mode, seed=seed):
            _side_then_default(lambda a: a[:, :3].add_(1),
                               lambda a: a[:, 2:].add_(2))  # (column 2 is both's)
    with pytest.raises(HazardError, match=r"read-after-write"):
        with simulated_accelerator(mode, seed=seed):
            # (columns 0 and 2 on the default stream: their hull holds column 1, not its
            # bytes), then a read of s1's column, unordered
            _side_then_default(lambda a: a[:, 1].fill_(1),
                               lambda a: [a[:, ::2].fill_(2), a.sum()])


@pytest.mark.parametrize("mode,seed", SCHEDULES)
def test_host_accesses_to_pinned_memory_race_only_where_elements_meet(mode, seed):
    """The host's reads of pinned columns a queued copy does not write are fine; columns it
    writes race, as two streams' strided accesses do."""
    with simulated_accelerator(mode, seed=seed):
        d = torch.arange(8, dtype=torch.float32, device="cuda").reshape(4, 2)
        h = torch.zeros(4, 4, pin_memory=True)
        h[:, :2].copy_(d, non_blocking=True)  # (columns 0-1, queued)
        assert h[:, 2:].tolist() == [[0.0, 0.0]] * 4  # (columns 2-3: the host's alone)
        h[:, 3].fill_(5.0)
        with pytest.raises(HazardError, match=r"host race \(read-after-write\)"):
            h[:, 1:3].tolist()  # (column 1 is the copy's)
        torch.cuda.synchronize()
        assert h.tolist() == [[0.0, 1.0, 0.0, 5.0], [2.0, 3.0, 0.0, 5.0],
                              [4.0, 5.0, 0.0, 5.0], [6.0, 7.0, 0.0, 5.0]]
