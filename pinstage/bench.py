"""The benchmark suite behind ``pinstage bench``.

Every case runs pinstage and the straightforward PyTorch way of doing the same work in the same
run: interleaved rounds (pinstage, baseline, pinstage, ...), the median time per call of each,
and the spread (interquartile range over rounds). Both sides are checked to produce the same
values before they are timed; as with ``timeit``, garbage collection is off while timing. On
an accelerator the time is the host's time per call (what the engine loop pays) unless a case
says it measures bandwidth, which includes the transfer.
"""

from __future__ import annotations

import gc
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import pinstage

from ._backend import get_backend

__all__ = ["Case", "run_suite", "cases_for", "best_target"]


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


def _large(pageable: bool):  # type: ignore[no-untyped-def]
    def make(device: torch.device):  # type: ignore[no-untyped-def]
        n = 256 * 2**20 // 4
        pinned = pinstage.np_to_pinned_tensor(np.zeros(n, np.float32))
        src = torch.randn(n) if pageable else pinned
        dst = torch.empty(n, device=device)

        def ours() -> None:
            pinstage.async_tensor_h2d(src, out=dst)
            _sync(device)

        def base() -> None:  # the bound: a bare pinned copy
            dst.copy_(pinned, non_blocking=True)
            _sync(device)

        return ours, base, None
    return make


def _small_latency(device: torch.device):  # type: ignore[no-untyped-def]
    arr = np.arange(256, dtype=np.int32)  # 1 KiB
    pinned = pinstage.np_to_pinned_tensor(arr)
    dst = torch.empty(256, dtype=torch.int32, device=device)

    def ours() -> torch.Tensor:
        return pinstage.async_tensor_h2d(arr, out=dst)

    def base() -> torch.Tensor:  # the floor: a bare pinned non_blocking copy_
        return dst.copy_(pinned, non_blocking=True)

    return ours, base, None


def _uva_gather(device: torch.device):  # type: ignore[no-untyped-def]
    rows, cols = 1 << 16, 64
    buf = pinstage.UvaBuffer((rows, cols), torch.float32, device)
    buf.cpu.fill_(1.0)
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
    Case("engine_step_256", "3 per-request uploads + 256 block-table appends",
         _engine_step, calls_per_round=5),
    Case("h2d_many_8", "8 small arrays in one call (one transfer)", _h2d_many,
         also=lambda device: {"separate_async_tensor_h2d": _separate_calls(device)}),
    Case("cpugpubuffer_round_trip", "CpuGpuBuffer 512 rows to device and back",
         _buffer_round_trip),
    Case("small_copy_1k", "1 KiB upload vs a bare pinned copy_ (overhead)", _small_latency,
         gpu_only=True),
    Case("large_pinned_256m", "256 MiB pinned -> device vs bare pinned copy_",
         _large(False), gpu_only=True, bandwidth_bytes=256 * 2**20, calls_per_round=1),
    Case("large_pageable_256m", "256 MiB pageable -> device vs bare pinned copy_",
         _large(True), gpu_only=True, bandwidth_bytes=256 * 2**20, calls_per_round=1),
    Case("uva_gather", "gather 4096 rows from a 16 MiB pinned table via UVA",
         _uva_gather, gpu_only=True, calls_per_round=5),
]


def cases_for(device: torch.device) -> list[Case]:
    accel = pinstage.capabilities(device).accelerator
    return [c for c in CASES if accel or not c.gpu_only]


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


def run_case(case: Case, device: torch.device, rounds: int) -> dict[str, Any]:
    ours, base, check = case.make(device)
    if check is not None:
        check()
    calls = case.calls_per_round
    for _ in range(2):  # warm up (arena, caches, allocator)
        _time_calls(ours, calls)
        _time_calls(base, calls)
    _sync(device)
    others = case.also(device) if case.also is not None else {}
    backend = get_backend(device)
    stalls0 = backend.stalls
    t_ours, t_base = [], []
    t_other: dict[str, list[float]] = {k: [] for k in others}
    for _ in range(rounds):  # interleaved
        t_ours.append(_time_calls(ours, calls))
        t_base.append(_time_calls(base, calls))
        for k, fn in others.items():
            t_other[k].append(_time_calls(fn, calls))
        _sync(device)  # keep queues short; outside the timed calls
    p, b = statistics.median(t_ours), statistics.median(t_base)
    result: dict[str, Any] = {
        "name": case.name, "what": case.what,
        "pinstage_us": p * 1e6, "baseline_us": b * 1e6, "speedup": b / p,
        "pinstage_spread_us": _iqr(t_ours) * 1e6, "baseline_spread_us": _iqr(t_base) * 1e6,
        "rounds": rounds, "calls_per_round": calls,
        # host waits for unfinished device work inside pinstage calls, in the timed rounds
        "pinstage_host_stalls": backend.stalls - stalls0,
    }
    for k, ts in t_other.items():
        result[f"{k}_us"] = statistics.median(ts) * 1e6
    if case.bandwidth_bytes:
        result["pinstage_gbps"] = case.bandwidth_bytes / p / 1e9
        result["baseline_gbps"] = case.bandwidth_bytes / b / 1e9
    return result


def _iqr(xs: list[float]) -> float:
    if len(xs) < 4:
        return max(xs) - min(xs)
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


def simulator_checks() -> dict[str, Any]:
    """Counts the simulator can give exactly: transfers per call and host stalls."""
    from .testing import simulated_accelerator

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
        many = _time_calls(lambda: pinstage.h2d_many(arrays, sim.device), 200)
        sep = _time_calls(lambda: [pinstage.async_tensor_h2d(a, sim.device) for a in arrays],
                          200)
        out["h2d_many_8_sim_us"] = many * 1e6
        out["separate_8_sim_us"] = sep * 1e6
        out["h2d_many_vs_separate_ratio"] = many / sep
    with simulated_accelerator("random", seed=0) as sim:
        # 50 engine steps; like a real engine, step k+1 starts once step k's outputs were read
        # (the device is then at most one step behind). Any host wait inside pinstage counts.
        # Pool depth 3: a hand-out's fence is recorded at the next hand-out, so with the device
        # a step behind, two slots would sometimes wait for the step in flight.
        swt = pinstage.StagedWriteTensor((256, 64), torch.int32, sim.device, max_concurrency=3)
        reserved0 = prev = 0
        for step in range(50):
            if step == 3:  # after the first steps have sized the arena and every pool slot
                reserved0 = pinstage.host_memory_stats()["reserved_bytes"]
            pinstage.h2d_many([list(range(256))] * 3, sim.device, dtype=torch.int32)
            for r in range(256):
                swt.stage_write(r, step % 48, [r, r + 1, r + 2, r + 3])
            swt.apply_write()
            sim.launch(lambda: None)  # the step's model kernels
            if step:
                sim.backend.sim._run_until(prev)  # the engine read step k-1's outputs
            prev = sim.backend.record_event(None).seq
        out["steady_state_host_stalls_50_steps"] = sim.stats.host_stalls
        out["steady_state_pinned_growth_bytes"] = (pinstage.host_memory_stats()["reserved_bytes"]
                                                 - reserved0)
    return out


def run_suite(quick: bool = False, device: Any = None,
              progress: Callable[[int, int, str], None] | None = None,
              only: list[str] | None = None) -> dict[str, Any]:
    """Run every case for the target; returns the JSON-able report of the contract."""
    dev = best_target() if device is None else torch.device(device)
    caps = pinstage.capabilities(dev)
    cases = [c for c in cases_for(dev) if only is None or c.name in only]
    rounds = 7 if quick else 25
    if dev.type == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
    results = []
    for i, case in enumerate(cases):
        if progress:
            progress(i, len(cases), case.name)
        results.append(run_case(case, dev, rounds))
    if progress:
        progress(len(cases), len(cases), "simulator checks")
    sim = simulator_checks()
    return {
        "target": str(dev) if caps.accelerator else "cpu",
        "device_name": _device_name(dev),
        "quick": quick,
        "capabilities": caps.as_dict(),
        "cases": results,
        "simulator": sim,
        "host": {"python": platform.python_version(), "torch": torch.__version__,
                 "numpy": np.__version__, "machine": platform.machine(),
                 "threads": torch.get_num_threads()},
        "pinstage": pinstage.__version__,
    }


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        from ._cuda import device_name

        return device_name(dev)
    return platform.processor() or platform.machine()
