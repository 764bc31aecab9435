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

Pinned host memory is memory the device reaches too (a non-blocking copy's source or
destination, a kernel's UVA view): the host's own torch ops on it (``.tolist()``, ``print``,
an in-place write, a copy into it) are checked against the device accesses queued on it that
the host has not waited for, in every mode (eager included, where the copy may have run
already: on a GPU nothing says it has). Host writes through a NumPy view are not seen.
"""

from __future__ import annotations

import math
import sys
import threading
from typing import Any

import numpy as np
import torch

from .. import _callsite
from .._errors import HazardError

__all__ = ["RaceTracker", "Access", "entry", "site_of"]

_PLAIN = torch._C.DisableTorchFunction
_ATTR = "_pinstage_sim_races"  # on a storage: what its tracker knows of it
# on a tensor: (address, numel, its bytes lo, hi, storage's _ATTR, strides or None, shape, dtype)
_SPAN = "_pinstage_sim_span"
# id(code object) -> (it, whether its frames are the user's): call_site's rule, cached, as
# every access asks (walking the stack with string tests would be most of the checker's
# cost; keyed by id, as hashing a code object hashes its bytecode; holding the code keeps its
# id unique). The same in a forked child: no reset needed.
_USER_CODE: dict[int, tuple[Any, bool]] = {}


class _Entry(threading.local):
    frame: Any = None
    host_op = False  # a torch call the user's code makes on host tensors is running
    learn: Any = None  # the simulator's dispatches seen while it learns a call (_tensor)
    direct: Any = None  # (aten op, the torch binding it stands for) on the direct path
    # (lane key, args, kwargs, the lane's call of the flattened arguments if not the
    # binding's) of a direct call not tried for a _Lane yet (_tensor, _ops)
    lane: Any = None


# The frame that called the torch function being simulated now, on this thread (set by the
# simulator's function mode while the call runs): the user's line is found from there, not by
# walking up through the simulator's own frames (in CPython 3.11+ each frame walked past is
# made into a Python object: most of the cost of a race check).
entry = _Entry()


def _where() -> tuple[str, int]:
    """The user's frame that queued the work: (file, line)."""
    frame: Any = entry.frame
    return site_of(sys._getframe(2) if frame is None else frame)


def site_of(frame: Any) -> tuple[str, int]:
    """(file, line) of the first of ``frame`` and its callers that is the user's."""
    code = frame.f_code
    if code is _LAST_USER[0]:  # (the user's code found last time: a loop's calls)
        return code.co_filename, frame.f_lineno
    while frame is not None:
        code = frame.f_code
        known = _USER_CODE.get(id(code))
        if known is None or known[0] is not code:
            fn = code.co_filename
            known = _USER_CODE[id(code)] = (code, not _callsite._skipped(fn) and (
                not fn.startswith(_callsite._PKG) or fn in _callsite._AS_USER))
        if known[1]:
            _LAST_USER[0] = code
            return code.co_filename, frame.f_lineno
        frame = frame.f_back
    return "<unknown>", 0


_LAST_USER: list[Any] = [None]


# One read or write by work queued on a stream, as a tuple (made on every access: a tuple is
# several times cheaper than an object): what, stream, its id, position, the user's
# (file, line), bytes [lo, hi), shape, dtype, which owner of reused memory made it, and its
# strides when it is not contiguous (then not every byte of [lo, hi) is its own).
Access = tuple[Any, ...]
_WHAT, _STREAM, _SID, _SEQ, _SITE, _LO, _HI, _SHAPE, _DTYPE, _OWNER, _STRIDE = range(11)


def _unordered(prevs: list[Access], a: Access, mine: dict[int, int],
               host: dict[int, int]) -> Access | None:
    """The first of ``prevs`` that ``a`` races with: on another stream, sharing bytes, and
    not ordered before ``a`` (by ``a``'s stream's clock ``mine`` or a host wait); or
    ``None``."""
    sid, lo, hi, st = a[_SID], a[_LO], a[_HI], a[_STRIDE]
    for p in prevs:
        if p[_SID] != sid and p[_LO] < hi and lo < p[_HI] and \
                mine.get(p[_SID], 0) < p[_SEQ] and host.get(p[_SID], 0) < p[_SEQ] and \
                ((st is None and p[_STRIDE] is None) or _overlaps(a, p)):
            return p
    return None


def _describe(a: Access, verb: str) -> str:
    where = a[_SITE]
    return (f"{a[_WHAT]} on {_stream_name(a[_STREAM])} {verb} a {a[_DTYPE]} tensor of shape "
            f"{tuple(a[_SHAPE])} (bytes {a[_LO]:#x}-{a[_HI]:#x}), queued at "
            f"{where[0]}:{where[1]}")


def _stream_name(stream: Any) -> str:
    sched = stream.sched
    default = stream is sched.default_stream(stream.device_index)
    return (f"the default stream of {stream.device}" if default else
            f"stream {stream.stream_id} of {stream.device}")


def _range(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``t`` (not empty) may touch."""
    lo = t.data_ptr()
    size = t.element_size()
    if t.is_contiguous():
        return lo, lo + t.numel() * size
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
        self.clocks: dict[int, dict[int, int]] = {}  # stream id -> {other stream id: seq}
        self.host: dict[int, int] = {}  # what the host has waited for
        self.enabled = True
        # is this host tensor's memory pinned (the simulator's rule; set when it opens):
        # pinned storages are the host memory queued device work may use
        self.is_host: Any = None
        # id(region) -> region of pinned host memory with device accesses the host may not
        # have waited for (what the host's own ops are checked against; empty: no checks)
        self.watch: dict[int, list[Any]] = {}

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
        if self.watch:
            self._prune()

    def host_waited(self, stream: Any, seq: int) -> None:
        """The host waited until ``stream`` ran up to ``seq``."""
        if seq >= stream.last:
            self.host_join(self.snapshot(stream))
        elif self.host.get(stream.stream_id, 0) < seq:
            self.host[stream.stream_id] = seq
            if self.watch:
                self._prune()

    def _prune(self) -> None:
        """Forget the watched host regions whose device accesses the host has waited for
        (threads may prune at once: each forgets what is still there)."""
        host = self.host
        for key, held in list(self.watch.items()):
            if not any(host.get(p[_SID], 0) < p[_SEQ] for p in held[1]) and \
                    not any(host.get(p[_SID], 0) < p[_SEQ] for p in held[2]):
                self.watch.pop(key, None)

    def _region(self, t: torch.Tensor) -> list[Any]:
        """What is known of ``t``'s storage: [this tracker, writes not covered by a later
        one, reads since, how many times the caching allocator handed it out again, whether
        it is pinned host memory, the stream every record is of if they are all of one and
        contiguous (see :meth:`_solo`), else ``None``]."""
        storage = t.untyped_storage()
        held = getattr(storage, _ATTR, None)
        if held is None or held[0] is not self:
            host = t.device.type == "cpu" and self.is_host is not None and \
                bool(self.is_host(t))
            held = [self, [], [], 0, host, None]
            setattr(storage, _ATTR, held)
        return held  # type: ignore[no-any-return]

    def reused(self, t: torch.Tensor) -> None:
        """The caching allocator hands ``t``'s memory to a new owner (its accesses stay:
        queued work may still make them)."""
        self._region(t)[3] += 1

    def access(self, stream: Any, seq: int, what: str, reads: Any = (), writes: Any = (),
               where: tuple[str, int] | None = None) -> None:
        """Work ``what`` queued on ``stream`` at position ``seq`` reads ``reads`` and writes
        ``writes`` (tensors over simulated memory): ``HazardError`` if that races with an
        access on another stream it is not ordered after; else it is recorded."""
        if not self.enabled:
            return
        with _PLAIN():  # (tensor methods here must not go through the simulator's modes)
            self._access(stream, seq, what, reads, writes, where)

    def _span(self, t: torch.Tensor, n: int) -> tuple[Any, ...]:
        """What the checks need of ``t`` (``n`` elements): (address, n, ``_range(t)``'s lo and
        hi, ``_region(t)``, its strides if not contiguous, shape, dtype), kept on the tensor
        object: the simulator's tensors are used again and again (checked by its address and
        size, which a new storage or a resize changes)."""
        ptr = t.data_ptr()
        known = getattr(t, _SPAN, None)
        if known is not None and known[0] == ptr and known[1] == n and known[4][0] is self:
            return known  # type: ignore[no-any-return]
        lo, hi = _range(t)
        held = self._region(t)
        strides = None if t.is_contiguous() else tuple(t.stride())
        known = (ptr, n, lo, hi, held, strides, tuple(t.shape), t.dtype)
        try:
            setattr(t, _SPAN, known)
        except (AttributeError, TypeError):  # (a tensor type without attributes)
            pass
        return known

    def _known_span(self, t: torch.Tensor, trusted: bool) -> tuple[Any, ...] | None:
        """:meth:`_span` of ``t``, ``None`` if it is empty; ``trusted`` (see :meth:`_access`):
        a span it keeps is taken without reading its address and size again."""
        known = getattr(t, _SPAN, None)
        if known is None or known[4][0] is not self or not trusted and (
                known[0] != t.data_ptr() or known[1] != t.numel()):
            n = t.numel()
            return self._span(t, n) if n else None
        return known  # type: ignore[no-any-return]

    def _access(self, stream: Any, seq: int, what: str, reads: Any, writes: Any,
                where: tuple[str, int] | None, trusted: bool = False) -> None:
        """:meth:`access`'s work, torch's function modes off. ``trusted``: every tensor is
        a simulated tensor's own host tensor (not a UVA view), whose address and size never
        change (the simulator refuses resizes, and an in-place view op makes a new one): a
        span it keeps is its span."""
        sid = stream.stream_id
        site = where if where is not None else _where()
        if trusted and self._solo(stream, seq, what, reads, writes, site):
            return
        self._general(stream, sid, seq, what, reads, writes, site, trusted)

    def _general(self, stream: Any, sid: int, seq: int, what: str, reads: Any, writes: Any,
                 site: tuple[str, int], trusted: bool) -> None:
        """:meth:`_access` of any case (see there)."""
        mine = self.clocks.get(sid) or _EMPTY
        host = self.host
        # first every check (nothing is recorded if one raises), then every record
        todo: list[Any] = []  # region, access of each write, then of each read, flat
        for t in writes:
            known = self._known_span(t, trusted)
            if known is None:
                continue
            _, _, lo, hi, held, st, shape, dtype = known
            a: Access = (what, stream, sid, seq, site, lo, hi, shape, dtype, held[3], st)
            for prevs, verb in ((held[2], "reads"), (held[1], "writes")):  # (CSAN's order)
                p = _unordered(prevs, a, mine, host)
                if p is not None:
                    raise _error("write", a, p, verb)
            todo.append(held)
            todo.append(a)
        nw = len(todo)
        one = writes[0] if len(writes) == 1 else None
        for t in reads:
            if t is one or (writes and one is None and any(t is w for w in writes)):
                continue  # (read and written: the write's checks cover both)
            known = self._known_span(t, trusted)
            if known is None:
                continue
            _, _, lo, hi, held, st, shape, dtype = known
            a = (what, stream, sid, seq, site, lo, hi, shape, dtype, held[3], st)
            p = _unordered(held[1], a, mine, host)
            if p is not None:
                raise _error("read", a, p, "writes")
            todo.append(held)
            todo.append(a)
        # all checked: record them, dropping what they cover
        for i in range(0, len(todo), 2):
            held, a = todo[i], todo[i + 1]
            write = i < nw
            lo, hi = a[_LO], a[_HI]
            if held[4]:  # pinned host memory: the host's own ops on it are checked now
                self.watch[id(held)] = held
            if a[_STRIDE] is not None:  # (strided: it covers only some bytes of [lo, hi))
                held[1 if write else 2].append(a)
            elif write:
                _record_write(held, a)
            else:
                r = held[2]
                if r:  # (a read covered and ordered before this one adds nothing)
                    p = r[0]
                    if len(r) == 1 and p[_SID] == sid and p[_LO] >= lo and p[_HI] <= hi:
                        r[0] = a  # (the common case: the same stream read it last)
                        continue
                    held[2] = r = [p for p in r if p[_LO] < lo or p[_HI] > hi or (
                        p[_SID] != sid and mine.get(p[_SID], 0) < p[_SEQ] and
                        host.get(p[_SID], 0) < p[_SEQ])]
                r.append(a)
        for i in range(0, len(todo), 2):  # (which regions :meth:`_solo` may take)
            held = todo[i]
            only = None if held[4] else stream
            for recs in (held[1], held[2]):
                for p in recs:
                    if p[_STREAM] is not only or p[_STRIDE] is not None:
                        only = None
                        break
            held[5] = only

    def _solo(self, stream: Any, seq: int, what: str, reads: Any, writes: Any,
              site: tuple[str, int]) -> bool:
        """:meth:`_access` of the common case, in fewer steps: one tensor written, every
        tensor's span kept (``trusted``) and contiguous, and every record of its region on
        this stream (``held[5]``: queue order orders them all before this access, so none
        can race with it). Records it as :meth:`_access` would; ``False`` (nothing done) if
        not that case. (``held[5]`` is the stream itself, which the records keep alive: no
        stream of another tracker is that object.)"""
        if len(writes) != 1:
            return False
        out = writes[0]
        known = getattr(out, _SPAN, None)
        if known is None or known[4][5] is not stream or known[5] is not None:
            return False
        spans = []
        for t in reads:
            if t is not out:  # (read and written: the write covers both)
                k = getattr(t, _SPAN, None)
                if k is None or k[4][5] is not stream or k[5] is not None:
                    return False
                spans.append(k)
        sid = stream.stream_id
        held = known[4]
        _record_write(held, (what, stream, sid, seq, site, known[2], known[3], known[6],
                             known[7], held[3], None))
        for known in spans:  # (every read before is of this stream: the ones covered go)
            lo, hi, held = known[2], known[3], known[4]
            a = (what, stream, sid, seq, site, lo, hi, known[6], known[7], held[3], None)
            r = held[2]
            if len(r) == 1 and r[0][_LO] >= lo and r[0][_HI] <= hi:
                r[0] = a
            else:
                if r:
                    held[2] = r = [p for p in r if p[_LO] < lo or p[_HI] > hi]
                r.append(a)
        return True

    # -- the host's own accesses to pinned memory ------------------------------------------
    def host_access(self, what: str, reads: Any = (), writes: Any = ()) -> None:
        """The host's ``what`` reads ``reads`` and writes ``writes`` (host tensors) now:
        ``HazardError`` if queued device work the host has not waited for writes them (or,
        for a write, reads them)."""
        if not self.enabled or not self.watch:
            return
        with _PLAIN():
            for t in writes:
                self._host_check(what, t, True)
            for t in reads:
                if not any(t is w for w in writes):
                    self._host_check(what, t, False)

    def _host_check(self, what: str, t: Any, write: bool) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.numel():
            return
        held = getattr(t.untyped_storage(), _ATTR, None)
        if held is None or held[0] is not self or id(held) not in self.watch:
            return
        lo, hi = _range(t)
        st = None if t.is_contiguous() else tuple(t.stride())
        # (the host's access as a record, for _overlaps: strided ones share bytes only where
        # their elements meet, as for two streams)
        a: Access = (what, None, None, 0, None, lo, hi, tuple(t.shape), t.dtype, 0, st)
        host = self.host
        for prevs, verb in ((held[1], "writes"), (held[2] if write else [], "reads")):
            p = _unordered(prevs, a, _EMPTY, host)  # (no stream: only host waits order it)
            if p is not None:
                raise _host_error(what, t, lo, hi, write, p, verb)


def _record_write(held: list[Any], a: Access) -> None:
    """Record contiguous write ``a`` in region ``held``: the writes and reads whose bytes it
    covers go (checked, it is ordered after them all)."""
    lo, hi = a[_LO], a[_HI]
    w = held[1]
    if len(w) == 1 and w[0][_LO] >= lo and w[0][_HI] <= hi:
        w[0] = a  # (the common case: it covers the one write before)
    else:
        if w:
            held[1] = w = [p for p in w if p[_LO] < lo or p[_HI] > hi]
        w.append(a)
    if held[2]:
        held[2] = [p for p in held[2] if p[_LO] < lo or p[_HI] > hi]


def _host_error(what: str, t: torch.Tensor, lo: int, hi: int, write: bool, prev: Access,
                prev_verb: str) -> HazardError:
    kind = "write" if write else "read"
    file, line = _where()
    return HazardError(
        f"host race ({kind}-after-{prev_verb[:-1]}): {what} on the host {kind}s a {t.dtype} "
        f"tensor of shape {tuple(t.shape)} in pinned memory (bytes {lo:#x}-{hi:#x}) at "
        f"{file}:{line}, while {_describe(prev, prev_verb)}, and the host has not waited for "
        "it (no synchronize(), Event.synchronize() or Stream.synchronize() after it was "
        "queued). On a GPU that work may not have run yet: "
        + ("the host would read what was there before it." if not write else
           "the device could see the host's new values, or the host's write be lost."))


_WRITES: dict[int, tuple[Any, tuple[tuple[int, str], ...]]] = {}


def schema_writes(func: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument aten op ``func`` writes (its schema's mutable
    arguments, ``out=`` included), worked out once per op."""
    known = _WRITES.get(id(func))
    if known is None or known[0] is not func:
        known = _WRITES[id(func)] = (func, tuple(
            (j, a.name) for j, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write))
    return known[1]  # type: ignore[no-any-return]


def host_written(func: Any, args: Any, kwargs: dict[str, Any]) -> list[Any]:
    """The tensors of ``args``/``kwargs`` that aten op ``func`` writes."""
    out: list[Any] = []
    for j, name in schema_writes(func):
        v = kwargs.get(name, args[j] if j < len(args) else None)
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


_EMPTY: dict[int, int] = {}
_PRECISE = 1 << 22  # elements: a larger strided access is taken to touch all of [lo, hi)


def _starts(a: Access) -> tuple[Any, int]:
    """The sorted start addresses of the byte runs access ``a`` touches, and their length."""
    if a[_STRIDE] is None:
        return np.array([a[_LO]], dtype=np.int64), a[_HI] - a[_LO]
    size = a[_DTYPE].itemsize
    offs = np.zeros(1, dtype=np.int64)
    for d, st in zip(a[_SHAPE], a[_STRIDE]):
        offs = (offs[:, None] + np.arange(d, dtype=np.int64) * (st * size)).ravel()
    return np.unique(offs) + a[_LO], size


def _overlaps(a: Access, p: Access) -> bool:
    """Whether two accesses whose byte ranges overlap share a byte (one of them strided: two
    column blocks of one matrix interleave without touching)."""
    for x in (a, p):
        st = x[_STRIDE]
        if st is not None and (any(v < 0 for v in st) or
                               math.prod(x[_SHAPE]) > _PRECISE):
            return True
    sa, za = _starts(a)
    sp, zp = _starts(p)
    # for each run of p, the last run of a starting before it ends: they meet if that one
    # ends after it starts (a's runs are all za long)
    idx = np.searchsorted(sa, sp + zp, side="left") - 1
    hit = idx >= 0
    return bool(np.any(sa[idx[hit]] + za > sp[hit]))


def _error(kind: str, cur: Access, prev: Access, prev_verb: str) -> HazardError:
    name = f"{kind}-after-{prev_verb[:-1]}"
    return HazardError(
        f"stream race ({name}): {_describe(cur, kind + 's')}; it is not ordered after "
        f"{_describe(prev, prev_verb)}. Nothing orders the two (no wait_stream/wait_event/"
        "Event.wait between them, no host synchronization after the first), so on a GPU they "
        "may run in either order or at once." + (
            " The memory was freed on the host and handed out again by the caching "
            "allocator on the stream it was allocated on, while work queued on another "
            "stream may still use it: call tensor.record_stream(that stream) before freeing "
            "it (or make the allocating stream wait for that stream)."
            if cur[_OWNER] != prev[_OWNER] else ""))
