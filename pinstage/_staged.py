"""``StagedWriteTensor`` and ``FusedStagedWriter``: many small writes into device tables,
applied as one batch.

Each ``stage_write`` checks its position at once and records one ``(flat offset, length,
values)`` entry in one atomic list append, so several threads may stage into one table at
once. A list or tuple is copied into a tuple and its values are converted by ``apply_write``
(one cached ``struct`` pack each, the conversion rule's fast path; a value that does not fit is
refused there, before anything is written, and the batch stays staged), so its elements are
read then: numbers never change, and the simulated CUDA checks that a tensor or array held in
the list did not either (``HazardError``). Any other input is converted when staged.

``apply_write`` resolves overlapping writes on the host (the last staged write wins, so the
device never sees duplicate positions, whose order a GPU scatter does not define), packs int64
positions and values into a region of the device's pinned staging arena, and enqueues one
flat-index ``scatter_`` per table that reads them through UVA, or after one host-to-device
copy without UVA. The region is released as soon as the kernel is queued: the arena fences it
with an event after that kernel, so a burst of applies with the device far behind never makes
the host wait (only the arena's cap can).
"""

from __future__ import annotations

import functools
import struct
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from ._buffers import UvaBuffer, check_concurrency, get_default_max_concurrency
from ._capabilities import capabilities_for
from ._convert import number_bytes, pack_batch, pack_list, values_bytes
from ._device import Backend, refuse_capture
from ._dtypes import check_dtype, check_shape, itemsize, torch_to_numpy
from ._errors import NotANumberError, ValueOverflowError, describe
from ._host import align_up
from ._registry import get_backend
from ._state import DeviceState, device_state, renew_locks_after_fork

__all__ = ["StagedWriteTensor", "FusedStagedWriter", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.int32, torch.int64, torch.float32, torch.float16, torch.bfloat16,
                    torch.float64)
_REFUSALS = (ValueOverflowError, NotANumberError, ValueError, TypeError)  # most specific first


class _Snapshot:
    """A staged list's values with the bytes they converted to when staged (``None``: they
    were refused then). Only under a backend that ``checks_deferred_reads``: ``apply_write``
    checks that the values still convert to the same bytes."""

    __slots__ = ("values", "staged")

    def __init__(self, values: tuple[Any, ...], staged: bytes | None) -> None:
        self.values = values
        self.staged = staged


def _append_snapshot(staged: list[Any], dtype: torch.dtype, packers: dict[int, struct.Struct],
                     entry: tuple[int, int, tuple[Any, ...]]) -> None:
    """``staged.append(entry)``, its values wrapped in a :class:`_Snapshot` (one append: as
    atomic as the plain one)."""
    off, n, values = entry
    try:
        now: bytes | None = pack_list(values, dtype, "x", packers)
    except (TypeError, ValueError):
        now = None
    staged.append((off, n, _Snapshot(values, now)))


def _scatter_all(*parts: torch.Tensor) -> None:
    """The apply kernel: ``flat[idx] = vals`` for each (flat, idx, vals) triple. Positions are
    unique per table (resolved on the host) and int64; ``scatter_`` runs on every device."""
    for i in range(0, len(parts), 3):
        parts[i].scatter_(0, parts[i + 1], parts[i + 2])


def _as_int(x: Any, what: str) -> int:
    if isinstance(x, bool):
        raise TypeError(f"{what} must be an int, got {x!r}")
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, torch.Tensor) and x.numel() == 1 and not x.is_floating_point() \
            and x.dtype != torch.bool and x.device.type == "cpu":
        return int(x.item())
    raise TypeError(f"{what} must be an int, got {describe(x)}")


def _last_writes(starts: np.ndarray, lens: np.ndarray, idx: np.ndarray,
                 length: int) -> np.ndarray | None:
    """Where staged runs ``[start, start+len)`` overlap, a mask over the batch's values keeping
    only the last staged write of each position; ``None`` when no two runs overlap.

    Works on runs, not values: one sort of the run starts finds the clusters of overlapping
    runs, and only the values of those runs are sorted (stably: staging order decides).
    ``length``: the common length of all runs, or 0."""
    w = starts.shape[0]
    if w < 2:
        return None
    ends = starts + lens
    if bool(np.all(starts[1:] >= ends[:-1])):  # increasing and disjoint: the common case
        return None
    order = np.argsort(starts, kind="stable")
    reach = np.maximum.accumulate(ends[order])
    joins = starts[order[1:]] < reach[:-1]  # sorted run k+1 overlaps one before it
    if not bool(joins.any()):
        return None
    clustered = np.zeros(w, dtype=bool)  # runs sharing a cluster with another run
    clustered[1:] = joins
    clustered[:-1] |= joins
    runs = np.sort(order[clustered])  # in staging order
    if length:
        vidx = (runs[:, None] * length + np.arange(length)).reshape(-1)
    else:
        first = np.cumsum(lens) - lens  # index of each run's first value in the batch
        rl = lens[runs]
        vidx = np.repeat(first[runs] - (np.cumsum(rl) - rl), rl) + np.arange(int(rl.sum()))
    pos = idx[vidx]
    by_pos = np.argsort(pos, kind="stable")  # equal positions stay in staging order
    sorted_pos = pos[by_pos]
    lost = sorted_pos[1:] == sorted_pos[:-1]  # a later write to the same position follows
    keep = np.ones(idx.shape[0], dtype=bool)
    keep[vidx[by_pos[:-1][lost]]] = False
    return keep


def _uva_bytes(state: DeviceState, backend: Backend, region: Any, nbytes: int) -> torch.Tensor:
    """A device view (uint8) of the first ``nbytes`` of a staging region. Views of whole
    staging blocks are made once per block (a driver call on CUDA) and kept by the device
    state weakly, so a retired block's pinned memory is never kept alive from there."""
    block = region.block
    views = state.block_views
    view = views.get(block)
    if view is None:
        with torch.inference_mode(False):
            view = backend.uva_view(block.tensor)
        views[block] = view
    return view[region.start : region.start + nbytes]


class _TableBatch:
    """One table's staged writes resolved into unique int64 positions and their values."""

    __slots__ = ("table", "count", "idx", "vals")

    def __init__(self, table: StagedWriteTensor, count: int, idx: np.ndarray,
                 vals: np.ndarray) -> None:
        self.table = table
        self.count = count  # staged entries it covers (removed once applied)
        self.idx = idx
        self.vals = vals


class _Scratch:
    """Reusable memory for the metadata of applies that need no fence: pageable host memory
    (the copy from it is blocking) and device memory per stream (stream order protects it)."""

    def __init__(self) -> None:
        self.host: torch.Tensor | None = None
        self.device: dict[Any, torch.Tensor] = {}

    def host_bytes(self, n: int) -> torch.Tensor:
        if self.host is None or self.host.numel() < n:
            with torch.inference_mode(False):
                self.host = torch.empty(max(n, 4096) * 2, dtype=torch.uint8, device="cpu")
        return self.host[:n]

    def device_bytes(self, backend: Backend, n: int) -> torch.Tensor:
        stream = backend.current_stream()
        buf = self.device.get(stream)
        if buf is None or buf.numel() < n:
            if len(self.device) >= 8:
                self.device.clear()
            with torch.inference_mode(False):
                buf = self.device[stream] = backend.empty((max(n, 4096) * 2,), torch.uint8)
        return buf[:n]


def _apply(backend: Backend, batches: Sequence[_TableBatch], scratch: _Scratch, label: str) -> None:
    """Enqueue the scatters of ``batches`` with at most one host-to-device copy in all."""
    if not backend.accelerator:  # CPU target: the host arrays are device memory there
        args: list[torch.Tensor] = []
        for b in batches:
            vals = torch.from_numpy(b.vals)
            if b.table.dtype == torch.bfloat16:
                vals = vals.view(torch.bfloat16)
            args += [b.table._flat, torch.from_numpy(b.idx), vals]
        _scatter_all(*args)
        return
    refuse_capture(backend, label)
    layout = []
    nbytes = 0
    for b in batches:
        n = b.idx.shape[0]
        voff = align_up(nbytes + n * 8)
        layout.append((nbytes, voff, n))
        nbytes = align_up(voff + n * b.table._itemsize)
    caps = capabilities_for(backend)
    if not caps.pin_memory:  # pageable: a plain (blocking) copy, scratch reused at once
        host = scratch.host_bytes(nbytes)
        _fill(host.numpy(), batches, layout)
        dev = scratch.device_bytes(backend, nbytes)
        backend.copy_h2d(dev, host)  # host -> device, blocking: pinning is off
        _launch(backend, dev, batches, layout)
        return
    state = device_state(backend)
    arena = state.arena()
    if nbytes > arena.limit:  # larger than the whole staging cap: in pieces (one copy each)
        for part in _halves(batches):
            _apply(backend, part, scratch, label)
        return
    # released on leaving (fenced by an event after the kernel that reads it), whatever
    # happens: an interrupt that skips the release gives the region back through its owner
    with arena.staging(nbytes) as region:
        block = region.block
        _fill(block.np[region.start : region.start + nbytes], batches, layout)
        if caps.uva:
            dev = _uva_bytes(state, backend, region, nbytes)  # the kernel reads pinned memory
        else:
            dev = scratch.device_bytes(backend, nbytes)
            backend.copy_h2d(dev, region.tensor(nbytes), pinned=True)  # host -> device
        _launch(backend, dev, batches, layout)


def _halves(batches: Sequence[_TableBatch]) -> tuple[list[_TableBatch], list[_TableBatch]]:
    """The batches split in two by values. Positions are unique per table once resolved, so
    the halves may be applied in either order."""
    first, second = [], []
    for b in batches:
        h = (b.idx.shape[0] + 1) // 2
        first.append(_TableBatch(b.table, 0, b.idx[:h], b.vals[:h]))
        if b.idx.shape[0] > h:
            second.append(_TableBatch(b.table, 0, b.idx[h:], b.vals[h:]))
    return first, second


def _fill(mem: np.ndarray, batches: Sequence[_TableBatch], layout: list[tuple[int, int, int]]
          ) -> None:
    for b, (ioff, voff, n) in zip(batches, layout):
        mem[ioff : ioff + n * 8].view(np.int64)[:] = b.idx  # host write into staging
        mem[voff : voff + b.vals.nbytes].view(b.vals.dtype)[:] = b.vals


def _launch(backend: Backend, dev: torch.Tensor, batches: Sequence[_TableBatch],
            layout: list[tuple[int, int, int]]) -> None:
    args: list[torch.Tensor] = []
    for b, (ioff, voff, n) in zip(batches, layout):
        t = b.table
        args += [t._flat, dev[ioff : ioff + n * 8].view(torch.int64),
                 dev[voff : voff + n * t._itemsize].view(t.dtype)]
    backend.launch(_scatter_all, *args)


class _StagedView(list):  # type: ignore[type-arg]
    """A read-only list: a snapshot of one of vLLM's private staging lists (changing it could
    not change what is staged, so it refuses to, rather than silently doing nothing)."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("this is a read-only view of a pinstage StagedWriteTensor's staged "
                        "writes; use clear_staged_writes() / stage_write() to change them")

    append = extend = insert = remove = pop = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse  # type: ignore[assignment]


class StagedWriteTensor:
    """A device tensor ``.gpu`` (``rows`` or ``(rows, cols)``) updated by staged writes.

    ``stage_write(i, start, x)`` means ``gpu[i, start:start+len(x)] = x`` later (1-D, as in
    vLLM: ``gpu[i+start : i+start+len(x)] = x``); ``apply_write()`` enqueues every staged
    write, in staging order, with at most one host-to-device copy. Staging is thread-safe;
    ``apply_write``/``clear_staged_writes`` from several threads are serialised.
    """

    def __init__(self, size: Any, dtype: torch.dtype, device: Any,
                 max_concurrency: int | None = None, uva_instead_of_gpu: bool = False) -> None:
        check_dtype(dtype)
        if dtype not in SUPPORTED_DTYPES:
            names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
            raise ValueError(f"StagedWriteTensor does not support dtype {dtype}; supported: "
                             f"{names}")
        self.shape = check_shape(size, "size (rows or (rows, cols))", ndims=(1, 2),
                                 dtype=dtype)
        self.num_rows = self.shape[0]
        self.num_cols = self.shape[1] if len(self.shape) == 2 else 1
        self.dtype = dtype
        self.max_concurrency = check_concurrency(
            get_default_max_concurrency() if max_concurrency is None else max_concurrency)
        backend = get_backend(device)
        self._backend = backend
        self.device = backend.device
        caps = capabilities_for(backend)
        self._uva_buf: UvaBuffer | None = None
        with torch.inference_mode(False):  # usable outside inference_mode too
            if uva_instead_of_gpu and caps.uva:
                self._uva_buf = UvaBuffer(self.shape, dtype, self.device)
                self.gpu = self._uva_buf.uva()
            elif backend.accelerator:
                self.gpu = backend.zeros(self.shape, dtype)
            else:
                self.gpu = torch.zeros(self.shape, dtype=dtype, device="cpu")
            self._flat = self.gpu.view(-1)
        self._itemsize = itemsize(dtype)
        npdt = torch_to_numpy(dtype)
        self._np_dtype = npdt if npdt is not None else np.dtype(np.int16)  # bfloat16 bits
        # (rows, flat stride of a row, k, limit): a write of n values at (i, s) is inside
        # when 0 <= i < rows, 0 <= s and i*k + s + n <= limit; 2-D: k=0, limit=cols; 1-D
        # (vLLM's meaning, gpu[i+s : i+s+n]): stride 1, k=1, limit=rows.
        if len(self.shape) == 2:
            self._geom = (self.num_rows, self.num_cols, 0, self.num_cols)
        else:
            self._geom = (self.num_rows, 1, 1, self.num_rows)
        self._packers: dict[int, struct.Struct] = {}  # pack_list's cached packs, by length
        # (flat offset, length, values): values as checked bytes of ``dtype``, or the tuple of
        # a list or tuple given to stage_write, converted by apply_write
        self._staged: list[tuple[int, int, bytes | tuple[Any, ...]]] = []
        # (the list is only ever cut, never replaced; under the simulated CUDA each staged
        # list is snapshotted too, so apply_write can tell a changed element)
        self._append: Any = self._staged.append
        if backend.checks_deferred_reads:
            self._append = functools.partial(_append_snapshot, self._staged, dtype, {})
        self._lock = threading.Lock()  # apply/clear; staging needs none (one list append)
        renew_locks_after_fork(self, "_lock")
        self._scratch = _Scratch()

    # -- staging -----------------------------------------------------------------------------
    def clear_staged_writes(self) -> None:
        """Drop every staged write."""
        with self._lock: del self._staged[:]  # noqa: E701 - (one line: see _host)

    @property
    def num_staged(self) -> int:
        """Number of values staged (not calls)."""
        return sum(e[1] for e in self._staged[:])

    def stage_write(self, index: int, start: int, x: Any) -> None:
        """Stage ``gpu[index, start:start+len(x)] = x`` (1-D: ``gpu[index+start:...]``).
        ``x``: any iterable of numbers, an array or a CPU tensor. The position is checked
        now (``IndexError``). A list or tuple is copied, and its values are read and checked
        by ``apply_write`` (which refuses a bad one before writing anything, keeping the
        batch staged): don't change a tensor or array held in it until then. Other inputs
        may be checked now."""
        # The engine's hot loop: ints and a non-empty list. The position is checked here and
        # a tuple copy of the values recorded in one atomic list append; apply_write packs
        # them (one cached struct each, in C), so a call costs little more than a bare pack.
        if type(index) is int and type(start) is int and (type(x) is list
                                                          or type(x) is tuple):
            rows, stride, k, limit = self._geom
            values = tuple(x)  # (its length is the one recorded, even if x changes meanwhile)
            n = len(values)
            if n and 0 <= index < rows and 0 <= start and index * k + start + n <= limit:
                self._append((index * stride + start, n, values))
                return
        self._stage_general(index, start, x)

    def _stage_general(self, index: Any, start: Any, x: Any) -> None:
        row = _as_int(index, "index")
        col = _as_int(start, "start")
        data, n = values_bytes(x, self.dtype, "x", self._backend)
        rows, stride, k, limit = self._geom
        if not (0 <= row < rows and 0 <= col and row * k + col + n <= limit):
            if k:
                where = f"elements {row + col}..{row + col + n} (index {row} + start {col})"
            else:
                where = f"row {row}, columns {col}..{col + n},"
            raise IndexError(f"staged write at {where} is outside the {self.shape} tensor")
        if n == 0:
            return
        self._staged.append((row * stride + col, n, data))

    def stage_write_elem(self, index: int, x: Any) -> None:
        """Stage ``gpu[index] = x`` (1-D) or ``gpu[index, 0] = x`` (2-D); ``x`` is one number."""
        row = _as_int(index, "index")
        data, n = number_bytes(x, self.dtype, "x", self._backend), 1
        if not 0 <= row < self.num_rows or self.num_cols < 1:
            raise IndexError(f"staged write at row {row} is outside the {self.shape} tensor")
        self._staged.append((row * self._geom[1], n, data))

    # -- applying ----------------------------------------------------------------------------
    def _batch(self, label: str) -> _TableBatch | None:
        """The writes staged now, resolved (positions unique, the last staged write wins).
        Entries staged meanwhile by other threads stay for the next apply. Raises (and
        changes nothing) when a value staged as a list does not convert by the rule."""
        entries = self._staged[:]
        k = len(entries)
        if not k:
            return None
        offs, lens_t, chunks = zip(*entries)
        starts = np.fromiter(offs, np.int64, k)
        lens = np.fromiter(lens_t, np.int64, k)
        length = int(lens[0])
        if bool((lens == length).all()):  # all writes the same length (block-table appends)
            idx = (starts[:, None] + np.arange(length, dtype=np.int64)).reshape(-1)
        else:  # position of value j: starts[w] + (j - index of write w's first value)
            length = 0
            ends = np.cumsum(lens)
            idx = np.repeat(starts - (ends - lens), lens) + np.arange(int(ends[-1]),
                                                                      dtype=np.int64)
        vals = np.frombuffer(self._values(entries, chunks, length, label), self._np_dtype)
        keep = _last_writes(starts, lens, idx, length)
        if keep is not None:
            idx, vals = idx[keep], vals[keep]
        return _TableBatch(self, k, idx, vals)

    def _values(self, entries: Sequence[tuple[int, int, Any]], chunks: Sequence[Any],
                length: int, label: str) -> bytes | bytearray:
        """The values of ``entries`` as one run of bytes of ``dtype``: checked bytes as they
        are, tuples by the conversion module's batch fast path (the cached ``struct`` of their
        length, in C; ``length``: the common length of all entries, or 0). A size not seen
        yet, or values that path does not take, take :meth:`_encode` (``pack_list``)."""
        data = pack_batch(chunks, self.dtype, self._packers, length)
        if data is None:  # (a _Snapshot takes _encode as well)
            data = bytearray().join([self._encode(e, label) for e in entries])
        return data

    def _encode(self, entry: tuple[int, int, Any], label: str) -> bytes:
        """One entry's values as bytes of ``dtype``, by the conversion rule; its error names
        the staged write. A snapshotted list whose values changed since it was staged raises
        ``HazardError``."""
        off, n, values = entry
        if type(values) is bytes:
            return values
        snap = values if type(values) is _Snapshot else None
        if snap is not None:
            values = snap.values
        try:
            data = pack_list(values, self.dtype, "x", self._packers)
        except (TypeError, ValueError) as exc:
            if snap is not None and snap.staged is not None:
                raise self._changed(off, n, label) from None
            cls = next(c for c in _REFUSALS if isinstance(exc, c))
            raise cls(f"{label}: {self._where(off, n)} is refused: {exc}. Nothing was "
                      "written and the staged writes stay staged (clear_staged_writes() "
                      "drops them)") from None
        if snap is not None and data != snap.staged:
            raise self._changed(off, n, label)
        return data

    def _where(self, off: int, n: int) -> str:
        """The staged write at flat offset ``off`` of ``n`` values, in words."""
        _, stride, k, _ = self._geom
        span = (f"elements {off}..{off + n}" if k else
                f"row {off // stride}, columns {off % stride}..{off % stride + n}")
        return f"the write staged at {span} of the {self.shape} {self.dtype} table"

    def _changed(self, off: int, n: int, label: str) -> Exception:
        return self._backend.deferred_read_changed(
            f"{label}: a value of {self._where(off, n)} changed between stage_write and "
            "apply_write. stage_write copies the list, not its elements, which apply_write "
            "reads: a tensor or array held in the list must not change until then (pass "
            "numbers, e.g. t.tolist(), to reuse it at once). Nothing was written")

    def apply_write(self) -> None:
        """Enqueue device work that makes every staged write visible in ``.gpu``, in staging
        order; clears the staged list. At most one host-to-device copy for the batch."""
        # (one line: the lock's own __exit__ runs whatever interrupts the apply; see _host)
        with self._lock: self._apply_locked("StagedWriteTensor.apply_write")  # noqa: E701

    def _apply_locked(self, label: str) -> None:
        batch = self._batch(label)
        if batch is None:
            return
        _apply(self._backend, [batch], self._scratch, label)
        # only once queued, so a failed apply keeps them (interrupted between the two lines,
        # they are applied again by the next apply: the same values in the same order)
        del self._staged[: batch.count]


    # -- vLLM's private staged state, as read-only views (code and tests ported from vLLM
    # read these; see docs/compat-vllm.md). Each call decodes a snapshot of the staged list.
    def _compat_writes(self) -> list[tuple[int, int, list[Any]]]:
        """(index, start, values) per staged write, as vLLM's lists hold them. A 1-D table
        keeps only ``index + start``: it is reported as the index, with start 0."""
        _, stride, k, _ = self._geom
        out = []
        for off, _n, data in self._staged[:]:
            if type(data) is bytes:
                vals = np.frombuffer(data, self._np_dtype)
                if self.dtype == torch.bfloat16:
                    vals = torch.from_numpy(vals.copy()).view(torch.bfloat16).float().numpy()
                values = vals.tolist()
            else:
                values = list(data.values if type(data) is _Snapshot else data)
            out.append((off, 0, values) if k else (off // stride, off % stride, values))
        return out

    @property
    def _staged_write_indices(self) -> list[int]:
        return _StagedView([w[0] for w in self._compat_writes()])

    @property
    def _staged_write_starts(self) -> list[int]:
        return _StagedView([w[1] for w in self._compat_writes()])

    @property
    def _staged_write_contents(self) -> list[Any]:
        return _StagedView([v for w in self._compat_writes() for v in w[2]])

    @property
    def _staged_write_cu_lens(self) -> list[int]:
        lens = [len(w[2]) for w in self._compat_writes()]
        return _StagedView(np.cumsum(lens, dtype=np.int64).tolist())

    @property
    def _staged_write_numel(self) -> int:
        return self.num_staged

    @property
    def write_contents(self) -> UvaBuffer | None:
        """vLLM's ``write_contents`` is its UVA pool of write contents, there exactly when the
        table itself lives in pinned host memory (``uva_instead_of_gpu`` with UVA). pinstage
        stages contents through its fenced arena for every table, so this answers only
        vLLM's question, whether the table takes that path: the ``UvaBuffer`` holding
        ``.gpu``, else ``None``."""
        return self._uva_buf

    def _materialize_staged_write_contents(self) -> np.ndarray:
        """vLLM's staged values as one array of the table's NumPy dtype (a copy)."""
        npdt = torch_to_numpy(self.dtype) or np.dtype(np.float32)
        return np.asarray(self._staged_write_contents, dtype=npdt)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_staged_write_"):
            raise AttributeError(
                f"StagedWriteTensor.{name} is a read-only view in pinstage: it keeps its own "
                "representation of the staged writes (checked positions, packed values), so "
                "vLLM's private lists cannot be set; stage with stage_write()/"
                "stage_write_elem() (see docs/compat-vllm.md)")
        object.__setattr__(self, name, value)


class FusedStagedWriter:
    """Applies the staged writes of several :class:`StagedWriteTensor` (one per KV-cache
    group, say; dtypes may differ) with one host-to-device copy for all of them.

    ``max_writes`` and ``max_concurrency`` are vLLM's sizing hints: the metadata goes through
    the pinned staging arena, which grows with the batch, so more writes are never refused."""

    def __init__(self, device: Any, max_writes: int, max_concurrency: int | None = None) -> None:
        if isinstance(max_writes, bool) or not isinstance(max_writes, (int, np.integer)):
            raise TypeError(f"max_writes must be an int >= 0, got {describe(max_writes)}")
        if max_writes < 0:
            raise ValueError(f"max_writes must be >= 0, got {max_writes}")
        self.max_writes = int(max_writes)
        self.max_concurrency = check_concurrency(
            get_default_max_concurrency() if max_concurrency is None else max_concurrency)
        self._backend = get_backend(device)
        self.device = self._backend.device
        self._scratch = _Scratch()
        self._lock = threading.Lock()
        renew_locks_after_fork(self, "_lock")

    def apply(self, tensors: Sequence[StagedWriteTensor], output_ptrs: Any = None,
              output_strides: Any = None) -> None:
        """Apply and clear the staged writes of every table in ``tensors`` (in staging order
        per table) with one copy. ``output_ptrs``/``output_strides`` (vLLM's kernel
        arguments) are accepted and not needed."""
        if isinstance(tensors, StagedWriteTensor) or not isinstance(tensors, Iterable):
            raise TypeError(f"tensors must be a sequence of StagedWriteTensor, got "
                            f"{describe(tensors)}")
        tables: list[StagedWriteTensor] = []
        for i, t in enumerate(tensors):
            if not isinstance(t, StagedWriteTensor):
                raise TypeError(f"tensors[{i}] must be a StagedWriteTensor, got {describe(t)}")
            if t.device != self.device:
                raise ValueError(f"tensors[{i}] is on {t.device}; this FusedStagedWriter "
                                 f"writes to {self.device}")
            if all(t is not u for u in tables):
                tables.append(t)
        locks = [self._lock, *(t._lock for t in sorted(tables, key=id))]  # one order: no deadlock
        _holding(locks, lambda: self._apply_locked(tables))

    def _apply_locked(self, tables: list[StagedWriteTensor]) -> None:
        label = "FusedStagedWriter.apply"
        batches = [b for b in (t._batch(label) for t in tables) if b is not None]
        if batches:
            _apply(self._backend, batches, self._scratch, label)
            for b in batches:  # (interrupted midway: the rest are applied again next time)
                del b.table._staged[: b.count]


def _holding(locks: Sequence[Any], fn: Any) -> Any:
    """``fn()`` with every lock of ``locks`` held, taken in order. Each is held by a one-line
    ``with`` (its C-level ``__exit__`` always runs): an exception anywhere, even while waiting
    for the next lock, releases every lock already taken."""
    if not locks:
        return fn()
    with locks[0]: return _holding(locks[1:], fn)  # noqa: E701 - (one line: see _host)
