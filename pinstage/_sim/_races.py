"""Stream races, found when work is queued, whatever order the simulator then runs it in.

The model is CUDA's (and PyTorch's CUDA Sanitizer's): every stream has a vector clock, the
newest point of each other stream that its next operation is known to run after. Queuing an
operation advances the stream's own entry (its queue position); recording an event keeps a
copy of the stream's clock; ``wait_event``/``wait_stream`` join that copy into the waiting
stream's clock; a host synchronization (``synchronize()``, ``Stream.synchronize``,
``Event.synchronize``, a ``query()`` that answered ``True``, a blocking copy or ``.item()``)
joins what the host waited for into the host's clock, which every operation queued later is
ordered after.

Memory is tracked per storage (the memory a simulated tensor's data lives in), by byte
ranges: the writes not yet superseded and the reads since. An access that overlaps a
conflicting one (read after write, write after read, write after write) on another stream,
and is not ordered after it, raises :class:`HazardError` naming both: what, which stream,
which tensor, and the user's line that queued each.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any

import torch

from .. import _callsite
from .._errors import HazardError

__all__ = ["RaceTracker", "Access"]

_TRACKERS = itertools.count(1)
_PLAIN = torch._C.DisableTorchFunction
_ATTR = "_pinstage_sim_races"  # on a storage: (tracker number, its _Region)
# code object -> whether its frames are the user's (call_site's rule, cached: every access
# asks, and walking the stack with string tests would be most of the checker's cost). The
# same in a forked child: no reset needed.
_USER_CODE: dict[Any, bool] = {}


def _where() -> tuple[str, int]:
    """The user's frame that queued the work: (file, line)."""
    frame: Any = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        user = _USER_CODE.get(code)
        if user is None:
            fn = code.co_filename
            user = _USER_CODE[code] = not _callsite._skipped(fn) and (
                not fn.startswith(_callsite._PKG) or fn in _callsite._AS_USER)
        if user:
            return code.co_filename, frame.f_lineno
        frame = frame.f_back
    return "<unknown>", 0


class Access:
    """One read or write of a byte range ``[lo, hi)`` by work queued on a stream."""

    __slots__ = ("hi", "kind", "lo", "seq", "shape", "stream", "what", "where", "dtype")

    def __init__(self, kind: str, stream: Any, seq: int, what: str, where: tuple[str, int],
                 lo: int, hi: int, shape: Any, dtype: torch.dtype) -> None:
        self.kind, self.stream, self.seq, self.what, self.where = kind, stream, seq, what, where
        self.lo, self.hi, self.shape, self.dtype = lo, hi, shape, dtype

    def describe(self) -> str:
        verb = "writes" if self.kind == "write" else "reads"
        return (f"{self.what} on {_stream_name(self.stream)} {verb} a {self.dtype} tensor of "
                f"shape {tuple(self.shape)} (bytes {self.lo:#x}-{self.hi:#x}), queued at "
                f"{self.where[0]}:{self.where[1]}")


def _stream_name(stream: Any) -> str:
    sched = stream.sched
    default = stream is sched.default_stream(stream.device_index)
    return (f"the default stream of {stream.device}" if default else
            f"stream {stream.stream_id} of {stream.device}")


class _Region:
    """What is known of one storage: writes not yet covered by a later one, reads since."""

    __slots__ = ("reads", "writes")

    def __init__(self) -> None:
        self.writes: list[Access] = []
        self.reads: list[Access] = []


def _range(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``t`` may touch."""
    lo = t.data_ptr()
    n = t.numel()
    if n == 0:
        return lo, lo
    size = t.element_size()
    if t.is_contiguous():
        return lo, lo + n * size
    hi = lo
    for d, st in zip(t.shape, t.stride()):
        if st >= 0:
            hi += (d - 1) * st * size
        else:
            lo += (d - 1) * st * size
    return lo, hi + size


class RaceTracker:
    """The vector clocks of one scheduler's streams and the host, and the accesses made."""

    def __init__(self) -> None:
        self.number = next(_TRACKERS)
        self.clocks: dict[int, dict[int, int]] = {}  # stream id -> {other stream id: seq}
        self.host: dict[int, int] = {}  # what the host has waited for
        self.enabled = True

    # -- clocks ------------------------------------------------------------------------------
    def snapshot(self, stream: Any) -> dict[int, int]:
        """The clock of ``stream`` now, its own position included (an event's record)."""
        vc = dict(self.clocks.get(stream.stream_id, ()))
        vc[stream.stream_id] = stream.last
        return vc

    def join(self, stream: Any, vc: dict[int, int] | None) -> None:
        """Work queued on ``stream`` from now on runs after the points in ``vc``."""
        if not vc:
            return
        sid = stream.stream_id
        mine = self.clocks.get(sid)
        if mine is None:
            mine = self.clocks[sid] = {}
        for k, v in vc.items():
            if k != sid and mine.get(k, 0) < v:
                mine[k] = v

    def host_join(self, vc: dict[int, int] | None) -> None:
        """The host waited for the points in ``vc``: all work queued later runs after them."""
        if not vc:
            return
        host = self.host
        for k, v in vc.items():
            if host.get(k, 0) < v:
                host[k] = v

    def host_waited(self, stream: Any, seq: int) -> None:
        """The host waited until ``stream`` ran up to ``seq``."""
        if seq >= stream.last:
            self.host_join(self.snapshot(stream))
        elif self.host.get(stream.stream_id, 0) < seq:
            self.host[stream.stream_id] = seq

    def _ordered(self, sid: int, mine: dict[int, int] | None, prev: Access) -> bool:
        psid = prev.stream.stream_id
        if psid == sid:
            return True
        seq = prev.seq
        return (mine is not None and mine.get(psid, 0) >= seq) or self.host.get(psid, 0) >= seq

    # -- accesses ----------------------------------------------------------------------------
    def _region(self, t: torch.Tensor) -> _Region:
        storage = t.untyped_storage()
        held = getattr(storage, _ATTR, None)
        if held is None or held[0] != self.number:
            held = (self.number, _Region())
            setattr(storage, _ATTR, held)
        return held[1]  # type: ignore[no-any-return]

    def access(self, stream: Any, seq: int, what: str, reads: Any = (), writes: Any = (),
               where: tuple[str, int] | None = None) -> None:
        """Work ``what`` queued on ``stream`` at position ``seq`` reads ``reads`` and writes
        ``writes`` (tensors over simulated memory): ``HazardError`` if that races with an
        access on another stream it is not ordered after; else it is recorded."""
        if not self.enabled:
            return
        with _PLAIN():  # (tensor methods here must not go through the simulator's modes)
            self._access(stream, seq, what, reads, writes, where)

    def _access(self, stream: Any, seq: int, what: str, reads: Any, writes: Any,
                where: tuple[str, int] | None) -> None:
        sid = stream.stream_id
        mine = self.clocks.get(sid)
        site = where if where is not None else _where()
        todo: list[tuple[_Region, Access]] = []
        for t in writes:
            if t.numel() == 0:
                continue
            lo, hi = _range(t)
            region = self._region(t)
            for prevs in (region.reads, region.writes):  # (reads since: CSAN's order)
                for prev in prevs:
                    if prev.lo < hi and lo < prev.hi and prev.stream.stream_id != sid and \
                            not self._ordered(sid, mine, prev):
                        raise self._error(Access("write", stream, seq, what, site, lo, hi,
                                                 t.shape, t.dtype), prev)
            todo.append((region, Access("write", stream, seq, what, site, lo, hi, t.shape,
                                        t.dtype)))
        for t in reads:
            if t.numel() == 0 or any(t is w for w in writes):
                continue  # (read and written: the write's checks cover both)
            lo, hi = _range(t)
            region = self._region(t)
            for prev in region.writes:
                if prev.lo < hi and lo < prev.hi and prev.stream.stream_id != sid and \
                        not self._ordered(sid, mine, prev):
                    raise self._error(Access("read", stream, seq, what, site, lo, hi, t.shape,
                                             t.dtype), prev)
            todo.append((region, Access("read", stream, seq, what, site, lo, hi, t.shape,
                                        t.dtype)))
        for region, acc in todo:  # all checked: record them, dropping what they cover
            lo, hi = acc.lo, acc.hi
            if acc.kind == "write":
                if region.writes:
                    region.writes = [p for p in region.writes if p.lo < lo or p.hi > hi]
                if region.reads:
                    region.reads = [p for p in region.reads if p.lo < lo or p.hi > hi]
                region.writes.append(acc)
            else:
                if region.reads:
                    region.reads = [p for p in region.reads if p.lo < lo or p.hi > hi or
                                    not self._ordered(sid, mine, p)]
                region.reads.append(acc)

    def _error(self, cur: Access, prev: Access) -> HazardError:
        kind = {("read", "write"): "read-after-write", ("write", "read"): "write-after-read",
                ("write", "write"): "write-after-write"}[(cur.kind, prev.kind)]
        return HazardError(
            f"stream race ({kind}): {cur.describe()}; it is not ordered after "
            f"{prev.describe()}. Nothing orders the two (no wait_stream/wait_event/"
            "Event.wait between them, no host synchronization after the first), so on a GPU "
            "they may run in either order or at once.")
