"""The benchmark suite behind ``pinstage bench``.

Every case runs pinstage and the straightforward PyTorch way of doing the same work in the same
run: interleaved rounds (pinstage, baseline, pinstage, ...), the median time per call of each,
and the spread (interquartile range over rounds). Both sides are checked to produce the same
values before they are timed; as with ``timeit``, garbage collection is off while timing. On
an accelerator the time is the host's time per call (what the engine loop pays) unless a case
says it measures bandwidth, which includes the transfer.

Cases that need an accelerator (large copies, a 1 KiB upload, a UVA gather) are skipped with a
reason on the CPU target. The report's ``goals`` name each performance goal with its measured
value and ``pass``/``fail``, or ``not run`` with the reason.
"""

from __future__ import annotations

import datetime
import gc
import platform
import statistics
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import pinstage

from ._registry import get_backend
from ._state import device_state

__all__ = ["CASES", "Case", "SCHEMA", "best_target", "case_names", "check_case_names",
           "goals", "run_suite"]

# version of the JSON report's layout (``schema`` in it): raised when a key changes meaning
SCHEMA = 1


@dataclass
class Case:
    """One comparison. ``make(device)`` returns (pinstage_fn, baseline_fn, check_fn or None)."""

    name: str
    what: str
    make: Callable[[torch.device], tuple[Callable[[], Any], Callable[[], Any],
                                         Callable[[], None] | None]]
    gpu_only: bool = False
    bandwidth_bytes: int = 0  # > 0: report GB/s and time including the transfer
    calls_per_round: int = 50
    # more ways of doing the same work, timed in the same rounds and reported as NAME_us
    also: Callable[[torch.device], dict[str, Callable[[], Any]]] | None = None
    # why the case cannot run on this target (None: it can); checked after ``gpu_only``
    requires: Callable[[Any], str | None] | None = None
    # set when the baseline is a lower bound (part of the work done bare, named here), not
    # another way of doing the work
    floor: str = ""
    # each call of either side does this many operations; times are reported per operation
    # (a loop inside the call keeps the harness's own per-call cost out of tiny timings)
    ops_per_call: int = 1


def best_target() -> torch.device:
    """The best target this machine has: the current CUDA/ROCm device, else the CPU."""
    return pinstage.capabilities().device


def _sync(device: torch.device) -> None:
    pinstage.synchronize(device)


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The straightforward upload: a fresh device copy, non_blocking as people write it."""
    return t.to(device, non_blocking=True, copy=True)


# -- cases ------------------------------------------------------------------------------------


def _list_upload(device: torch.device):  # type: ignore[no-untyped-def]
    data = list(range(256))

    def ours() -> torch.Tensor:
        return pinstage.async_tensor_h2d(data, device, dtype=torch.int32)

    def base() -> torch.Tensor:
        return _to(torch.tensor(data, dtype=torch.int32), device)

    return ours, base, lambda: _same(ours(), base(), device)


def _ndarray_upload(device: torch.device):  # type: ignore[no-untyped-def]
    arr = np.random.default_rng(0).standard_normal(4096).astype(np.float32)

    def ours() -> torch.Tensor:
        return pinstage.async_tensor_h2d(arr, device)

    def base() -> torch.Tensor:
        return _to(torch.from_numpy(arr), device)

    return ours, base, lambda: _same(ours(), base(), device)


def _noncontig_upload(device: torch.device):  # type: ignore[no-untyped-def]
    t = torch.randn(512, 64)[:, ::2]

    def ours() -> torch.Tensor:
        return pinstage.async_tensor_h2d(t, device)

    def base() -> torch.Tensor:
        return _to(t, device)

    return ours, base, lambda: _same(ours(), base(), device)


def _staged_writes(device: torch.device):  # type: ignore[no-untyped-def]
    rows = [list(range(r, r + 16)) for r in range(256)]
    swt = pinstage.StagedWriteTensor((256, 64), torch.int32, device)
    table = torch.zeros(256, 64, dtype=torch.int32, device=device)

    def ours() -> None:
        for r in range(256):
            swt.stage_write(r, 16, rows[r])
        swt.apply_write()

    def base() -> None:
        for r in range(256):
            table[r, 16:32] = _to(torch.tensor(rows[r], dtype=torch.int32), device)

    def check() -> None:
        ours()
        base()
        _same(swt.gpu, table, device)

    return ours, base, check


def _random_writes(disjoint: bool, seed: int) -> tuple[list[int], list[int], list[list[int]]]:
    """256 writes of 16 int32 at random positions of a (1024, 64) table: distinct rows when
    ``disjoint``, else rows drawn with replacement (some writes overlap others)."""
    rng = np.random.default_rng(seed)
    rows = (rng.choice(1024, 256, replace=False) if disjoint else rng.integers(0, 1024, 256))
    starts = rng.integers(0, 64 - 16 + 1, 256)
    values = [rng.integers(0, 1 << 20, 16).tolist() for _ in range(256)]
    return rows.tolist(), starts.tolist(), values


def _staged_writes_overlap(device: torch.device):  # type: ignore[no-untyped-def]
    rows, starts, values = _random_writes(disjoint=False, seed=2)
    swt = pinstage.StagedWriteTensor((1024, 64), torch.int32, device)
    table = torch.zeros(1024, 64, dtype=torch.int32, device=device)

    def ours() -> None:
        for r, s, x in zip(rows, starts, values):
            swt.stage_write(r, s, x)
        swt.apply_write()

    def base() -> None:
        for r, s, x in zip(rows, starts, values):
            table[r, s : s + 16] = _to(torch.tensor(x, dtype=torch.int32), device)

    def check() -> None:
        ours()
        base()
        _same(swt.gpu, table, device)

    return ours, base, check


def _disjoint_writes(device: torch.device) -> dict[str, Callable[[], Any]]:
    """The same amount of writes, none overlapping: pinstage's side only (for the ratio)."""
    rows, starts, values = _random_writes(disjoint=True, seed=2)
    swt = pinstage.StagedWriteTensor((1024, 64), torch.int32, device)

    def disjoint() -> None:
        for r, s, x in zip(rows, starts, values):
            swt.stage_write(r, s, x)
        swt.apply_write()

    return {"pinstage_disjoint": disjoint}


_WRITES_PER_CALL = 64


_CALL_VALUES = list(range(1000, 1016))


def _staging_loop(device: torch.device) -> tuple[pinstage.StagedWriteTensor,
                                                 Callable[[], None]]:
    """A (1024, 64) int32 table and a loop staging 64 writes of 16 ints into it."""
    rows = range(_WRITES_PER_CALL)
    swt = pinstage.StagedWriteTensor((1024, 64), torch.int32, device)

    def stage() -> None:
        for r in rows:
            swt.stage_write(r, 8, _CALL_VALUES)  # as engine code calls it (no bound method)

    return swt, stage


def _stage_write_call(device: torch.device):  # type: ignore[no-untyped-def]
    """``stage_write`` of 16 ints, 64 per call (then the staged list is cleared, as
    ``apply_write`` would); the baseline packs the same ints with ``struct.pack``, 64 times.
    ``stage_write`` checks the position and copies the list; ``apply_write`` packs the values,
    so ``stage_and_apply_us`` (the same 64 writes staged, then applied) shows the whole cost."""
    values = _CALL_VALUES
    rows = range(_WRITES_PER_CALL)
    swt, stage = _staging_loop(device)

    def ours() -> None:
        stage()
        swt.clear_staged_writes()

    def base() -> None:
        for _ in rows:
            struct.pack("<16i", *values)

    def check() -> None:
        swt.clear_staged_writes()
        swt.stage_write(3, 8, values)
        swt.apply_write()
        _sync(device)
        if swt.gpu[3, 8:24].cpu().tolist() != values:
            raise AssertionError("stage_write did not write its values")
        swt.clear_staged_writes()

    return ours, base, check


def _stage_and_apply(device: torch.device) -> dict[str, Callable[[], Any]]:
    """The writes of ``stage_write_call`` staged and then applied (the packing included)."""
    swt, stage = _staging_loop(device)

    def stage_and_apply() -> None:
        stage()
        swt.apply_write()

    return {"stage_and_apply": stage_and_apply}


def _engine_step(device: torch.device):  # type: ignore[no-untyped-def]
    """One engine step for 256 requests: three per-request arrays uploaded and one block-table
    append per request (4 new block ids at that request's current length)."""
    n = 256
    rng = np.random.default_rng(1)
    seq_lens = rng.integers(1, 2048, n).tolist()
    q_lens = rng.integers(1, 8, n)
    query_start_loc = np.concatenate([[0], np.cumsum(q_lens)]).tolist()
    idx_mapping = rng.permutation(n).tolist()
    starts = rng.integers(0, 60, n).tolist()
    blocks = [rng.integers(0, 1 << 20, 4).tolist() for _ in range(n)]
    swt = pinstage.StagedWriteTensor((n, 64), torch.int32, device)
    table = torch.zeros(n, 64, dtype=torch.int32, device=device)

    def ours() -> tuple[torch.Tensor, ...]:
        out = pinstage.h2d_many([idx_mapping, query_start_loc, seq_lens], device,
                                dtype=torch.int32)
        for r in range(n):
            swt.stage_write(r, starts[r], blocks[r])
        swt.apply_write()
        return out

    def base() -> tuple[torch.Tensor, ...]:
        out = tuple(_to(torch.tensor(x, dtype=torch.int32), device)
                    for x in (idx_mapping, query_start_loc, seq_lens))
        for r in range(n):
            s = starts[r]
            table[r, s : s + 4] = _to(torch.tensor(blocks[r], dtype=torch.int32), device)
        return out

    def check() -> None:
        a, b = ours(), base()
        for x, y in zip(a, b):
            _same(x, y, device)
        _same(swt.gpu, table, device)

    return ours, base, check


def _eight_arrays() -> list[np.ndarray]:
    return [np.arange(64, dtype=np.int32) + i for i in range(8)]


def _h2d_many(device: torch.device):  # type: ignore[no-untyped-def]
    arrays = _eight_arrays()

    def ours() -> tuple[torch.Tensor, ...]:
        return pinstage.h2d_many(arrays, device)

    def base() -> list[torch.Tensor]:
        return [_to(torch.from_numpy(a), device) for a in arrays]

    def check() -> None:
        for x, y in zip(ours(), base()):
            _same(x, y, device)

    return ours, base, check


def _separate_calls(device: torch.device) -> Callable[[], Any]:
    arrays = _eight_arrays()
    return lambda: [pinstage.async_tensor_h2d(a, device) for a in arrays]


def _buffer_round_trip(device: torch.device):  # type: ignore[no-untyped-def]
    buf = pinstage.CpuGpuBuffer(1024, dtype=torch.int32, device=device)
    host = np.arange(1024, dtype=np.int32)
    buf.cpu.copy_(torch.from_numpy(host))

    def ours() -> torch.Tensor:
        buf.copy_to_gpu(512)
        out = buf.copy_to_cpu(512)
        _sync(device)
        return out

    def base() -> np.ndarray:
        g = _to(torch.from_numpy(host[:512]), device)
        return g.to("cpu", copy=True).numpy()

    def check() -> None:
        _same(ours(), torch.from_numpy(base()), torch.device("cpu"))

    return ours, base, check


_LARGE = 256 * 2**20


def _large_pageable(device: torch.device):  # type: ignore[no-untyped-def]
    """256 MiB from an ordinary (pageable) tensor: pinstage's pipelined staging vs the copy a
    user writes; a bare copy from pinned memory (the bound) is timed in the same rounds."""
    return _large_copy(torch.randn(_LARGE // 4), device)


def _large_pageable_also(device: torch.device) -> dict[str, Callable[[], Any]]:
    n = _LARGE // 4
    src = torch.randn(n)
    pinned = torch.empty(n, pin_memory=True)
    dst = torch.empty(n, device=device)

    def to_device() -> None:
        src.to(device, non_blocking=True)
        _sync(device)

    def bare_pinned_copy() -> None:
        dst.copy_(pinned, non_blocking=True)
        _sync(device)

    return {"to_device": to_device, "bare_pinned_copy": bare_pinned_copy}


def _large_pinned(device: torch.device):  # type: ignore[no-untyped-def]
    """256 MiB from a tensor the user pinned with torch: pinstage reads it in place, so the
    bound is the bare ``copy_`` itself."""
    return _large_copy(torch.randn(_LARGE // 4).pin_memory(), device)


def _large_copy(src: torch.Tensor, device: torch.device):  # type: ignore[no-untyped-def]
    """pinstage's ``async_tensor_h2d(src, out=dst)`` against the ``dst.copy_(src,
    non_blocking=True)`` a user writes, both synchronized (bandwidth); checked first."""
    dst = torch.empty(src.numel(), device=device)

    def ours() -> None:
        pinstage.async_tensor_h2d(src, out=dst)
        _sync(device)

    def base() -> None:
        dst.copy_(src, non_blocking=True)
        _sync(device)

    def check() -> None:
        dst.zero_()
        ours()
        if not torch.equal(dst.cpu(), src):
            raise AssertionError("pinstage's copy differs from its source")

    return ours, base, check


def _small_copy(device: torch.device):  # type: ignore[no-untyped-def]
    arr = np.arange(256, dtype=np.int32)  # 1 KiB

    def ours() -> torch.Tensor:
        return pinstage.async_tensor_h2d(arr, device)

    def base() -> torch.Tensor:
        return torch.from_numpy(arr).to(device, non_blocking=True)

    return ours, base, lambda: _same(ours(), base(), device)


def _small_copy_also(device: torch.device) -> dict[str, Callable[[], Any]]:
    arr = np.arange(256, dtype=np.int32)
    pinned = torch.from_numpy(arr).pin_memory()
    dst = torch.empty(256, dtype=torch.int32, device=device)
    return {"bare_pinned_copy": lambda: dst.copy_(pinned, non_blocking=True),
            "torch_tensor_to": lambda: torch.tensor(arr).to(device, non_blocking=True)}


_UVA_ROWS = 1 << 16  # a 16 MiB float32 table of 64 columns


def _uva_gather(device: torch.device):  # type: ignore[no-untyped-def]
    rows, cols = _UVA_ROWS, 64
    buf = pinstage.UvaBuffer((rows, cols), torch.float32, device)
    buf.cpu.copy_(torch.randn(rows, cols))
    idx = torch.randint(0, rows, (4096,), device=device)
    view = buf.uva()
    host = buf.cpu

    def ours() -> torch.Tensor:  # gather straight from pinned host memory
        out = view.index_select(0, idx)
        _sync(device)
        return out

    def base() -> torch.Tensor:  # copy the table, then gather
        out = host.to(device, non_blocking=True).index_select(0, idx)
        _sync(device)
        return out

    return ours, base, lambda: _same(ours(), base(), device)


def _needs_pinning(device: Any) -> str | None:
    if not pinstage.capabilities(device).pin_memory:
        return f"pinned memory is off for {device} (see pinstage doctor)"
    return None


def _needs_uva(device: Any) -> str | None:
    if not pinstage.capabilities(device).uva:
        return f"UVA is off for {device} (see pinstage doctor)"
    return None


def _same(a: Any, b: Any, device: torch.device) -> None:
    _sync(device)
    ta, tb = torch.as_tensor(a).cpu(), torch.as_tensor(b).cpu()
    if ta.shape != tb.shape or not torch.equal(ta, tb.to(ta.dtype)):
        raise AssertionError("pinstage and the baseline disagree; the benchmark is invalid")


CASES = [
    Case("list_upload_256", "256-int Python list -> device int32", _list_upload),
    Case("ndarray_upload_4k", "4096-float32 ndarray -> device", _ndarray_upload),
    Case("noncontig_upload", "non-contiguous (512, 32) tensor -> device", _noncontig_upload),
    Case("staged_writes_256x16", "256 row writes of 16 int32 into a (256, 64) table",
         _staged_writes, calls_per_round=5),
    Case("staged_writes_overlap", "256 random writes of 16 int32 into a (1024, 64) table, some "
         "overlapping (pinstage_disjoint_us: the same without overlaps)",
         _staged_writes_overlap, calls_per_round=5, also=_disjoint_writes),
    Case("stage_write_call", "one stage_write of 16 ints (position checked, values copied; "
         "apply_write packs them); baseline: struct.pack of them (the floor of a whole write, "
         "not a way to write a table); per write, 64 writes per call (also: "
         "stage_and_apply_us, the same writes staged then applied)",
         _stage_write_call, calls_per_round=20, floor="struct.pack",
         ops_per_call=_WRITES_PER_CALL, also=_stage_and_apply),
    Case("engine_step_256", "3 per-request uploads + 256 block-table appends",
         _engine_step, calls_per_round=5),
    Case("h2d_many_8", "8 small arrays in one call (one transfer)", _h2d_many,
         also=lambda device: {"separate_async_tensor_h2d": _separate_calls(device)}),
    Case("cpugpubuffer_round_trip", "CpuGpuBuffer 512 rows to device and back",
         _buffer_round_trip),
    Case("small_copy_1k", "1 KiB ndarray upload vs torch.from_numpy(a).to(dev, "
         "non_blocking=True) (also: torch.tensor(a).to(...), and bare_pinned_copy_us: a pinned "
         "copy_, the floor)", _small_copy,
         gpu_only=True, also=_small_copy_also),
    Case("large_pinned_256m", "256 MiB torch-pinned tensor -> device vs its bare copy_",
         _large_pinned, gpu_only=True, bandwidth_bytes=_LARGE, calls_per_round=1),
    Case("large_pageable_256m", "256 MiB pageable tensor -> device vs copy_(non_blocking=True) "
         "(also: .to(dev), and a bare copy_ from pinned memory)", _large_pageable,
         gpu_only=True, bandwidth_bytes=_LARGE, calls_per_round=1, also=_large_pageable_also,
         requires=_needs_pinning),
    Case("uva_gather", "gather 4096 rows from a 16 MiB pinned table via UVA vs copy-then-gather",
         _uva_gather, gpu_only=True, calls_per_round=5, requires=_needs_uva),
]

# cases without a transfer large enough to hide a wait: the host should never stall in them
SMALL_CASES = ("list_upload_256", "ndarray_upload_4k", "noncontig_upload", "staged_writes_256x16",
               "staged_writes_overlap", "engine_step_256", "h2d_many_8", "small_copy_1k")


def case_names() -> list[str]:
    """Every case's name, in suite order."""
    return [c.name for c in CASES]


def check_case_names(names: list[str]) -> None:
    """Raise ``ValueError`` naming the valid cases if any of ``names`` is not one."""
    unknown = [n for n in names if n not in case_names()]
    if unknown:
        raise ValueError(f"unknown case {', '.join(repr(n) for n in unknown)}; valid cases: "
                         f"{', '.join(case_names())}")


def skip_reason(case: Case, device: torch.device) -> str | None:
    """Why ``case`` cannot run on ``device`` (None: it can)."""
    if case.gpu_only and not pinstage.capabilities(device).accelerator:
        return "needs an accelerator; the target is the CPU"
    return case.requires(device) if case.requires is not None else None


def _time_calls(fn: Callable[[], Any], calls: int) -> float:
    """Seconds per call. Like ``timeit``, the garbage collector is off while timing (for both
    sides), so a collection triggered by one side's garbage is not charged to the other. (No
    ``gc.collect()`` before: it hands pymalloc arenas back to the OS, and the next round then
    pays page faults.)"""
    gc.disable()
    try:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls
    finally:
        gc.enable()


def run_case(case: Case, device: torch.device, rounds: int,
             warmups: int = 2) -> dict[str, Any]:
    ours, base, check = case.make(device)
    if check is not None:
        check()
    calls = case.calls_per_round
    for _ in range(warmups):  # warm up (arena, caches, allocator)
        _time_calls(ours, calls)
        _time_calls(base, calls)
    _sync(device)
    others = case.also(device) if case.also is not None else {}
    state = device_state(get_backend(device))
    stalls0 = state.stalls
    t_ours, t_base = [], []
    t_other: dict[str, list[float]] = {k: [] for k in others}
    per = case.ops_per_call
    for _ in range(rounds):  # interleaved
        t_ours.append(_time_calls(ours, calls) / per)
        t_base.append(_time_calls(base, calls) / per)
        for k, fn in others.items():
            t_other[k].append(_time_calls(fn, calls) / per)
        _sync(device)  # keep queues short; outside the timed calls
    p, b = statistics.median(t_ours), statistics.median(t_base)
    result: dict[str, Any] = {
        "name": case.name, "what": case.what,
        "pinstage_us": p * 1e6, "baseline_us": b * 1e6, "speedup": b / p,
        "pinstage_spread_us": _iqr(t_ours) * 1e6, "baseline_spread_us": _iqr(t_base) * 1e6,
        # the quartiles behind the spread (the chart's error bars)
        "pinstage_q1_us": _quartiles(t_ours)[0] * 1e6,
        "pinstage_q3_us": _quartiles(t_ours)[1] * 1e6,
        "baseline_q1_us": _quartiles(t_base)[0] * 1e6,
        "baseline_q3_us": _quartiles(t_base)[1] * 1e6,
        "rounds": rounds, "calls_per_round": calls, "ops_per_call": per,
        "baseline_floor": case.floor or None,
        # host waits for unfinished device work inside pinstage calls, in the timed rounds
        "pinstage_host_stalls": state.stalls - stalls0,
    }
    for k, ts in t_other.items():
        result[f"{k}_us"] = statistics.median(ts) * 1e6
    if case.bandwidth_bytes:
        result["pinstage_gbps"] = case.bandwidth_bytes / p / 1e9
        result["baseline_gbps"] = case.bandwidth_bytes / b / 1e9
        for k, ts in t_other.items():
            result[f"{k}_gbps"] = case.bandwidth_bytes / statistics.median(ts) / 1e9
    if "bare_pinned_copy_us" in result:
        result["pinstage_vs_bare_pinned"] = result["bare_pinned_copy_us"] / result["pinstage_us"]
    if "pinstage_disjoint_us" in result:
        result["overlap_vs_disjoint"] = result["pinstage_us"] / result["pinstage_disjoint_us"]
    return result


def _quartiles(xs: list[float]) -> tuple[float, float]:
    """The first and third quartiles (with fewer than 4 values: the least and the most)."""
    if len(xs) < 4:
        return min(xs), max(xs)
    q = statistics.quantiles(xs, n=4)
    return q[0], q[2]


def _iqr(xs: list[float]) -> float:
    q1, q3 = _quartiles(xs)
    return q3 - q1


def simulator_checks(quick: bool = False) -> dict[str, Any]:
    """Counts the simulator can give exactly: transfers per call, host stalls, pinned bytes
    (``quick``: the host times over fewer calls; the counts are the same)."""
    from .testing import simulated_accelerator

    timed_calls = 40 if quick else 200

    arrays = _eight_arrays()
    out: dict[str, Any] = {}
    with simulated_accelerator("eager") as sim:
        c0 = sim.stats.copies
        pinstage.h2d_many(arrays, sim.device)
        out["h2d_many_8_transfers"] = sim.stats.copies - c0
        c0 = sim.stats.copies
        for a in arrays:
            pinstage.async_tensor_h2d(a, sim.device)
        out["separate_8_transfers"] = sim.stats.copies - c0
        many = _time_calls(lambda: pinstage.h2d_many(arrays, sim.device), timed_calls)
        sep = _time_calls(lambda: [pinstage.async_tensor_h2d(a, sim.device) for a in arrays],
                          timed_calls)
        out["h2d_many_8_sim_us"] = many * 1e6
        out["separate_8_sim_us"] = sep * 1e6
        out["h2d_many_vs_separate_ratio"] = many / sep
        out["pinned_rss_ratio"] = pinned_rss(sim.device)["ratio"]
    with simulated_accelerator("random", seed=0) as sim:
        # 50 engine steps; like a real engine, step k+1 starts once step k's outputs were read
        # (the device is then at most one step behind). Any host wait inside pinstage counts.
        # Pool depth 3: a hand-out's fence is recorded at the next hand-out, so with the device
        # a step behind, two slots would sometimes wait for the step in flight.
        swt = pinstage.StagedWriteTensor((256, 64), torch.int32, sim.device, max_concurrency=3)
        reserved0 = 0
        prev: Any = None
        for step in range(50):
            if step == 3:  # after the first steps have sized the arena and every pool slot
                reserved0 = pinstage.host_memory_stats()["reserved_bytes"]
            pinstage.h2d_many([list(range(256))] * 3, sim.device, dtype=torch.int32)
            for r in range(256):
                swt.stage_write(r, step % 48, [r, r + 1, r + 2, r + 3])
            swt.apply_write()
            sim.launch(lambda: None)  # the step's model kernels
            done = torch.cuda.Event()  # the simulated CUDA's: the end of step k
            done.record()
            if prev is not None:
                prev.synchronize()  # the engine read step k-1's outputs (an explicit wait)
            prev = done
        out["steady_state_host_stalls_50_steps"] = sim.stats.host_stalls
        out["steady_state_pinned_growth_bytes"] = (pinstage.host_memory_stats()["reserved_bytes"]
                                                 - reserved0)
    return out


# odd sizes (bytes) of persistent pinned buffers: power-of-two rounding would reserve ~1.4x
_RSS_SIZES = (4096 + 4, 2**20 + 12, 3 * 2**20 + 20, 17 * 2**20 + 4, 100 * 2**20 - 44)


def pinned_rss(device: Any) -> dict[str, Any]:
    """Pinned bytes reserved per byte requested for a set of odd-sized ``CpuGpuBuffer`` objects:
    the growth of ``host_memory_stats()["reserved_bytes"]`` over that of ``requested_bytes``."""
    s0 = pinstage.host_memory_stats()
    bufs = [pinstage.CpuGpuBuffer(n // 4, dtype=torch.int32, device=device, with_numpy=False)
            for n in _RSS_SIZES]
    s1 = pinstage.host_memory_stats()
    requested = s1["requested_bytes"] - s0["requested_bytes"]
    reserved = s1["reserved_bytes"] - s0["reserved_bytes"]
    del bufs
    return {"requested_bytes": requested, "reserved_bytes": reserved,
            "ratio": reserved / requested if requested else None,
            "buffer_bytes": [n // 4 * 4 for n in _RSS_SIZES]}


def _simulator_open() -> bool:
    from ._sim import current

    return current() is not None


def resolve_target(device: Any = None) -> torch.device:
    """The device to benchmark: ``device``, or the best target of this machine. Raises
    ``ValueError``/``RuntimeError`` naming the problem when it cannot be benchmarked."""
    if device is None:
        return best_target()
    dev = pinstage.capabilities(device).device
    if dev.type == "meta":
        raise ValueError("device 'meta' cannot be benchmarked: meta tensors hold no data (it "
                         "stands in for an accelerator in audit tests only)")
    return dev


def run_suite(quick: bool = False, device: Any = None,
              progress: Callable[[int, int, str], None] | None = None,
              only: list[str] | None = None,
              on_result: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run every case (or those named in ``only``) for the target; returns the JSON-able
    report of the contract, with ``goals``. ``on_result`` is called with each finished case.

    On ``KeyboardInterrupt`` the suite stops and the report holds the cases finished so far,
    with ``"interrupted": true`` (the caller decides what an interrupt means for it)."""
    if only is not None:
        check_case_names(only)
    dev = resolve_target(device)
    caps = pinstage.capabilities(dev)
    selected = [c for c in CASES if only is None or c.name in only]
    skipped = [{"name": c.name, "what": c.what, "reason": why} for c in selected
               if (why := skip_reason(c, dev)) is not None]
    cases = [c for c in selected if skip_reason(c, dev) is None]
    rounds, warmups = (5, 1) if quick else (25, 2)
    results: list[dict[str, Any]] = []
    # every step, in order, so progress counts them all: the cases, then the extra checks
    extra = (["pinned memory"] if caps.accelerator and caps.pin_memory else []) + (
        [] if _simulator_open() else ["simulator checks"])
    steps = [c.name for c in cases] + extra
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "target": str(dev) if caps.accelerator else "cpu",
        "device_name": _device_name(dev),
        "quick": quick,
        "interrupted": False,
        "capabilities": caps.as_dict(),
        "cases": results,
        "skipped": skipped,
        "pinned_memory": None,
        "simulator": None,
        "host": {"python": platform.python_version(), "torch": torch.__version__,
                 "numpy": np.__version__, "machine": platform.machine(),
                 "threads": torch.get_num_threads()},
        "pinstage": pinstage.__version__,
    }
    def step(i: int) -> None:
        if progress:
            progress(i, len(steps), steps[i] if i < len(steps) else "done")

    try:
        for i, case in enumerate(cases):
            step(i)
            results.append(run_case(case, dev, rounds, warmups))
            if on_result:
                on_result(results[-1])
        if "pinned memory" in extra:
            step(steps.index("pinned memory"))
            report["pinned_memory"] = pinned_rss(dev)
        if "simulator checks" in extra:
            step(steps.index("simulator checks"))
            report["simulator"] = simulator_checks(quick)
        # else: the target is simulated already (one simulator at a time): None
        step(len(steps))  # every step done
    except KeyboardInterrupt:
        report["interrupted"] = True
    report["goals"] = goals(report)
    return report


def _goal(text: str, value: float | None, limit: float, at_most: bool,
          not_run: str | None = None, unit: str = "x", **extra: Any) -> dict[str, Any]:
    """A goal's record; ``unit`` says how its value reads: ``"x"`` a ratio, ``"us"``
    microseconds, ``""`` a count (``format_value`` prints it as the table does)."""
    if not_run is not None or value is None:
        return {"goal": text, "status": "not run", "reason": not_run or "no value",
                "unit": unit, **extra}
    ok = value <= limit if at_most else value >= limit
    return {"goal": text, "value": round(value, 4), "limit": limit, "unit": unit,
            "compare": "<=" if at_most else ">=", "status": "pass" if ok else "fail", **extra}


def format_value(value: float, unit: str) -> str:
    """One number as the table, the chart and the goals all print it: a ratio ``1.25x``, a
    time ``3.4 us``, a count ``0``."""
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "us":
        return f"{value:.1f} us"
    return f"{value:g}"


def goals(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each performance goal with its measured value and ``pass``/``fail``, or ``not run``
    and why (case skipped on this target, not selected, or the run was interrupted)."""
    cases = {c["name"]: c for c in report.get("cases", [])}
    skipped = {s["name"]: s["reason"] for s in report.get("skipped", [])}
    accel = bool(report.get("capabilities", {}).get("accelerator"))

    def why_not(name: str) -> str | None:
        if name in cases:
            return None
        if name in skipped:
            return f"{name}: {skipped[name]}"
        if report.get("interrupted"):
            return f"{name}: the run was interrupted before it"
        return f"{name}: not selected (--case)"

    out: dict[str, dict[str, Any]] = {}
    c = cases.get("staged_writes_overlap", {})
    out["staged_writes_overlap_le_1_3x_disjoint"] = _goal(
        "overlapping staged writes cost at most 1.3x disjoint ones (pinstage_us / "
        "pinstage_disjoint_us of staged_writes_overlap)", c.get("overlap_vs_disjoint"), 1.3,
        True, why_not("staged_writes_overlap"))
    c = cases.get("stage_write_call", {})
    out["stage_write_call_le_2x_struct_pack"] = _goal(
        "one stage_write of 16 ints costs at most 2x a bare struct.pack of them: the "
        "table's speedup of stage_write_call (struct.pack time / stage_write time) is at "
        "least 0.50x", c.get("speedup"), 0.5, False, why_not("stage_write_call"))
    c = cases.get("large_pageable_256m", {})
    out["pageable_ge_75pct_of_pinned_bandwidth"] = _goal(
        "a 256 MiB pageable upload through pinstage reaches at least 75% of a bare pinned "
        "copy's bandwidth (same rounds)", c.get("pinstage_vs_bare_pinned"), 0.75, False,
        why_not("large_pageable_256m"),
        **({"pinstage_gbps": c["pinstage_gbps"], "bare_pinned_gbps": c["bare_pinned_copy_gbps"],
            "straightforward_gbps": c["baseline_gbps"]} if c else {}))
    c = cases.get("large_pinned_256m", {})
    out["large_pinned_ge_90pct_of_bare"] = _goal(
        "a 256 MiB pinned upload through pinstage reaches at least 90% of the bare copy_'s "
        "bandwidth", c.get("speedup"), 0.90, False, why_not("large_pinned_256m"),
        **({"pinstage_gbps": c["pinstage_gbps"], "bare_gbps": c["baseline_gbps"]} if c else {}))
    c = cases.get("small_copy_1k", {})
    out["small_copy_1k_host_us"] = _goal(
        "a 1 KiB upload costs the host no more per call than torch.from_numpy(a).to(dev, "
        "non_blocking=True); value: pinstage's per-call host time in us, next to a bare "
        "pinned copy_'s", c.get("pinstage_us"), c.get("baseline_us", 0.0), True,
        why_not("small_copy_1k"), unit="us",
        **({"bare_pinned_copy_us": c["bare_pinned_copy_us"],
            "straightforward_us": c["baseline_us"],
            "torch_tensor_to_us": c.get("torch_tensor_to_us")} if c else {}))
    small = [cases[n] for n in SMALL_CASES if n in cases]
    out["small_cases_0_host_stalls"] = _goal(
        "no host stall inside pinstage in the timed (steady-state) rounds of the small cases",
        sum(x["pinstage_host_stalls"] for x in small) if small else None, 0, True,
        None if accel and small else
        "needs an accelerator target (the CPU never waits for a device; the simulator's "
        "steady-state count is under 'simulator')" if not accel else "no small case ran",
        unit="", **({"cases": [x["name"] for x in small]} if accel else {}))
    pm = report.get("pinned_memory") or {}
    out["pinned_rss_le_1_05x_requested"] = _goal(
        "pinned memory reserved for odd-sized buffers is at most 1.05x the bytes requested",
        pm.get("ratio"), 1.05, True,
        None if pm else "needs an accelerator target with pinned memory" if not (
            accel and report.get("capabilities", {}).get("pin_memory")) else
        "the run was interrupted before it")
    return out


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        from ._cuda import device_name

        return device_name(dev)
    return platform.processor() or platform.machine()

