"""Hidden-sync audit: find every copy and read that makes the host wait, with its call site.

Built on a ``TorchDispatchMode`` (thread-local: it watches the thread that entered it). It sees
``aten.copy_`` / ``aten._to_copy`` with their ``non_blocking`` flag and the source's pinning,
and ``aten._local_scalar_dense`` (``.item()``, ``.tolist()``, ``if tensor:``), which
``torch.cuda.set_sync_debug_mode`` misses in part (pageable ``non_blocking`` copies, pinned but
non-contiguous sources). Each finding is grouped by kind and by the first frame outside
pinstage and PyTorch. Cost: a few microseconds per torch operation while active - a debugging
and test tool, not for production.

pinstage's own deliberate fallbacks (a blocking copy where pinned memory is unavailable or
switched off) are not findings: no line of the caller can fix them, and ``capabilities()``
already says why they happen.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ._callsite import call_site
from ._errors import HiddenSyncError
from ._registry import device_of, is_pinned_host

__all__ = ["audit", "Finding", "SyncReport", "HiddenSyncError", "KINDS", "pinstage_fallback"]

KINDS = {
    "pageable-nonblocking": "non_blocking copy to the accelerator from pageable (unpinned) host "
                            "memory: the host waits while the driver stages it",
    "noncontiguous-pinned": "non_blocking copy from pinned but non-contiguous host memory: "
                            "PyTorch makes a pageable contiguous temporary, so the host waits",
    "blocking-h2d": "host-to-accelerator copy without non_blocking=True: the host waits for it",
    "d2h": "accelerator-to-host copy that blocks, or lands in pageable memory",
    "item": "reads an accelerator value on the host (.item(), .tolist(), bool(tensor)): the "
            "host waits for all queued work",
    "data-dependent": "the output's size depends on values on the accelerator (nonzero, "
                      "boolean-mask indexing, masked_select, unique, repeat_interleave without "
                      "output_size): the host waits to learn it",
}

_aten = torch.ops.aten
_DATA_DEPENDENT = {_aten.nonzero, _aten.masked_select, _aten._unique2, _aten._unique,
                   _aten.unique_dim, _aten.unique_consecutive}

_tls = threading.local()
# Where a tensor lives and whether host memory is pinned: asked of the registry, which lets a
# stand-in for real hardware answer (a simulated tensor seen through its CPU proxy reports its
# device; inside a dispatch mode a CPU-only build of torch knows no pinned memory).
_device = device_of
_pinned = is_pinned_host


@contextlib.contextmanager
def pinstage_fallback() -> Iterator[None]:
    """Marks pinstage's deliberate, documented blocking fallbacks (not audit findings)."""
    _tls.depth = getattr(_tls, "depth", 0) + 1
    try:
        yield
    finally:
        _tls.depth -= 1


@dataclass
class Finding:
    """One kind of hidden sync at one call site."""

    kind: str
    where: str
    count: int
    message: str

    def __getitem__(self, key: str) -> object:
        """``finding["kind"]`` works too."""
        if key not in ("kind", "where", "count", "message"):
            raise KeyError(key)
        return getattr(self, key)


class SyncReport:
    """What an :func:`audit` found: ``findings`` (one per kind and call site) and
    ``summary()``."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, str], Finding] = {}
        self.ops_seen = 0

    @property
    def findings(self) -> list[Finding]:
        """Most frequent first."""
        return sorted(self._by_key.values(), key=lambda f: (-f.count, f.where, f.kind))

    def __len__(self) -> int:
        return len(self._by_key)

    def __bool__(self) -> bool:
        return True  # a report is always truthy; use ``len()`` or ``findings``

    def _add(self, kind: str, where: str, detail: str) -> Finding:
        key = (kind, where)
        f = self._by_key.get(key)
        if f is None:
            f = self._by_key[key] = Finding(kind, where, 0, f"{KINDS[kind]} ({detail})")
        f.count += 1
        return f

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self._by_key.values():
            out[f.kind] = out.get(f.kind, 0) + f.count
        return out

    def summary(self) -> str:
        if not self._by_key:
            return f"pinstage audit: no hidden syncs ({self.ops_seen} torch operations watched)"
        total = sum(f.count for f in self._by_key.values())
        lines = [f"pinstage audit: {total} hidden sync(s) at {len(self._by_key)} call site(s)"]
        for f in self.findings:
            lines.append(f"  {f.count:>6}x  {f.kind:<22} {f.where}")
            lines.append(f"           {f.message}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"SyncReport({len(self._by_key)} finding(s))"


def _normalize_devices(devices: Iterable[Any] | None) -> frozenset[str] | None:
    if devices is None:
        return None
    if isinstance(devices, (str, torch.device)):
        devices = [devices]
    out = set()
    for d in devices:
        if isinstance(d, torch.device):
            out.add(d.type)
        elif isinstance(d, str):
            out.add(torch.device(d).type)
        else:
            raise TypeError(f"devices must hold device types such as 'cuda' or 'meta', got {d!r}")
    return frozenset(out)


class _AuditMode(TorchDispatchMode):
    def __init__(self, report: SyncReport, strict: bool, devices: frozenset[str] | None):
        super().__init__()
        self.report = report
        self.strict = strict
        self.devices = devices

    def _accel(self, device: torch.device) -> bool:
        if self.devices is None:
            return device.type != "cpu"
        return device.type in self.devices

    def _found(self, kind: str, detail: str) -> None:
        where = call_site(2).where
        self.report._add(kind, where, detail)
        if self.strict:
            raise HiddenSyncError(f"{kind} at {where}: {KINDS[kind]} ({detail})")

    def _classify_h2d(self, src: torch.Tensor, dst_dev: torch.device, non_blocking: bool,
                      op: str) -> None:
        detail = f"{op} {tuple(src.shape)} {src.dtype} cpu -> {dst_dev}"
        if not non_blocking:
            self._found("blocking-h2d", detail)
        elif not _pinned(src):
            self._found("pageable-nonblocking", detail)
        elif not src.is_contiguous():
            self._found("noncontiguous-pinned", detail)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.report.ops_seen += 1
        if getattr(_tls, "depth", 0) == 0:
            self._inspect(func, args, kwargs)
        return func(*args, **kwargs)

    def _inspect(self, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
        packet = getattr(func, "overloadpacket", None)
        if packet is torch.ops.aten.copy_:
            dst, src = args[0], args[1]
            nb = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            if not isinstance(src, torch.Tensor):
                return
            sdev, ddev = _device(src), _device(dst)
            if sdev.type == "cpu" and self._accel(ddev):
                self._classify_h2d(src, ddev, nb, "copy_")
            elif self._accel(sdev) and ddev.type == "cpu":
                if not nb or not _pinned(dst):
                    self._found("d2h", f"copy_ {tuple(src.shape)} {sdev} -> cpu"
                                + ("" if not nb else " into pageable memory"))
        elif packet is torch.ops.aten._to_copy:
            src = args[0]
            dev = kwargs.get("device")
            if dev is None or not isinstance(src, torch.Tensor):
                return
            dev = torch.device(dev)
            nb = bool(kwargs.get("non_blocking", False))
            sdev = _device(src)
            if sdev.type == "cpu" and self._accel(dev):
                self._classify_h2d(src, dev, nb, "to")
            elif self._accel(sdev) and dev.type == "cpu" and not nb:
                self._found("d2h", f"to {tuple(src.shape)} {sdev} -> cpu")
        elif packet is torch.ops.aten._local_scalar_dense:
            src = args[0]
            if isinstance(src, torch.Tensor) and self._accel(_device(src)):
                self._found("item", f".item() of a {_device(src)} tensor")
        elif packet in _DATA_DEPENDENT or (
                packet is _aten.repeat_interleave and kwargs.get("output_size") is None
                and not (len(args) > 3 and args[3] is not None)):
            src = args[0]
            if isinstance(src, torch.Tensor) and self._accel(_device(src)):
                self._found("data-dependent", f"{packet.__name__} of a {_device(src)} tensor")
        elif packet is _aten.index:
            src, indices = args[0], args[1]
            if isinstance(src, torch.Tensor) and self._accel(_device(src)) and any(
                    isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                    for i in indices):
                self._found("data-dependent", f"boolean-mask indexing of a {_device(src)} "
                                              "tensor")


@contextlib.contextmanager
def audit(strict: bool = False, devices: Iterable[Any] | None = None) -> Iterator[SyncReport]:
    """Watch torch operations on this thread; yield a report of each one that makes (or on a
    real accelerator would make) the host wait. ``strict``: raise ``HiddenSyncError`` at the
    first. ``devices``: device types that count as accelerators (default: all but ``cpu``)."""
    report = SyncReport()
    mode = _AuditMode(report, bool(strict), _normalize_devices(devices))
    with mode:
        yield report
