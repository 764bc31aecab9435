"""What each aten op means on the simulated device: handlers registered per op (as
PyTorch's ``fake_impls.py`` registers its rules), the defaults for views and for every other
op, and ``sim.launch``.

* views run at once (metadata only);
* copies are host<->device transfers with CUDA's blocking rules (``_copy``, ``_h2d``,
  ``_d2h``): a non-blocking copy from pinned memory is queued and its source snapshotted, a
  pageable one makes the host wait;
* every other op is shape-inferred on ``meta`` tensors (cached), given fresh (poisoned)
  outputs, and queued on the current stream; an op whose output size depends on device values
  makes the host wait (``_host_fallback``);
* host reads of device values (``.item()``, ``torch.equal``, ``bool``) wait for the stream.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree

from .._callsite import call_site
from ._alloc import layout_of
from ._core import _ACTIVE, SimState
from ._hazards import HostRead, poison_, span
from ._races import entry as _entry
from ._races import schema_writes
from ._sched import Op
from ._tensor import (
    _DEV,
    _HANDLERS,
    INFERENCE_MADE,
    NO_LANE,
    Proxy,
    SimTensor,
    devices_of,
    empty_device,
    inner_of,
    is_device,
    keep_lane,
    layout_id,
    like_inference,
    like_strides,
    map_out,
    register_default,
    register_op,
    wrap,
    wrap_fresh,
)

__all__ = ["launch"]

aten = torch.ops.aten
_bump_version = torch._C._increment_version
_NO_SUBCLASS_TF = torch._C.DisableTorchFunctionSubclass
_inference = torch.is_inference_mode_enabled


def _view(sim: SimState, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    base = args[0] if args else None
    if not kwargs and type(base) is SimTensor and not any(
            isinstance(x, torch.Tensor) or (type(x) in _SEQ and any(
                isinstance(e, torch.Tensor) for e in x)) for x in args[1:]):
        # (the common call, a view of one simulated tensor, in fewer steps: the same)
        out = func(base._inner, *args[1:])
        if type(out) is torch.Tensor and not INFERENCE_MADE[0] and not _inference():
            return SimTensor(out, base._sim_device, base._host, base._block)
        device, proxy = base._sim_device, False
    else:
        flat, spec = _flatten(args, kwargs)
        device, proxy = devices_of(flat, allow_cpu=True)
        base = next(x for x in flat if isinstance(x, _DEV))
        a, k = _unflatten([x._inner if isinstance(x, _DEV) else x for x in flat], spec)
        out = func(*a, **k)
    host, block = base._host, base._block
    with like_inference(base):  # (a view is an inference tensor if and only if its base is)
        return map_out(lambda t: wrap(t, device, host, proxy, block)
                       if isinstance(t, torch.Tensor) else t, out)


def _meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and (is_device(x) or x.dim() > 0):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


_CPU_OK = {aten.index, aten.index_put_, aten.index_put, aten._index_put_impl_}

# Output shapes by (op, input shapes/strides/dtypes, other arguments): working them out on
# meta tensors is most of the cost of a simulated op, and engines repeat the same ops.
_META_CACHE: dict[Any, Any] = {}
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
            torch.memory_format)


class _Plan:
    """What ``func``'s schema says, worked out once per overload: which arguments it writes
    and which argument each return aliases (in-place / out=)."""

    __slots__ = ("cpu_ok", "func", "name", "out_fn", "packet", "rets", "scatter", "writes")

    def __init__(self, func: Any) -> None:
        schema = func._schema
        self.func = func  # (held: the plans are keyed by its id)
        self.packet = packet = func.overloadpacket
        self.name: str = packet.__name__
        self.cpu_ok = packet in _CPU_OK
        self.scatter = packet in _SCATTERS
        params = list(enumerate(schema.arguments))
        self.writes = schema_writes(func)
        rets: list[tuple[tuple[int, str], ...] | None] = []
        for r in schema.returns:
            info = r.alias_info
            if info is None or not info.is_write:
                rets.append(None)
                continue
            rets.append(tuple((j, a.name) for j, a in params if a.alias_info is not None and
                              a.alias_info.is_write and
                              set(a.alias_info.before_set) & set(info.before_set)))
        self.rets = tuple(rets)
        self.out_fn = _out_variant(func) if not self.writes and len(schema.returns) == 1 \
            else None


def _out_variant(func: Any) -> Any:
    """The ``out=`` overload of a functional op of one result (``add.Tensor`` ->
    ``add.out``), when its schema is the functional one plus a keyword-only ``out``: the
    kernel then writes straight into the output's memory (no temporary and copy)."""
    if torch.Tag.nondeterministic_seeded in func.tags:
        return None  # (a random op's out= kernel may draw its numbers differently)
    packet, name = func.overloadpacket, func._overloadname
    args = [(a.name, str(a.type)) for a in func._schema.arguments]
    for cand in (f"{name}_out", "out") if name in ("default", "Tensor") else (f"{name}_out",):
        over = getattr(packet, cand, None)
        if over is None:
            continue
        oargs = over._schema.arguments
        if [(a.name, str(a.type)) for a in oargs[:-1]] == args and oargs and \
                oargs[-1].name == "out" and oargs[-1].kwarg_only and \
                len(over._schema.returns) == 1:
            return over
    return None


# id(OpOverload) -> its plan: torch's OpOverload objects are made once per overload, and
# hashing one calls a Python __hash__ (keyed by the object, every lookup cost a Python call)
_PLANS: dict[int, _Plan] = {}


def _plan(func: Any) -> _Plan:
    # a wrapper made per call (a random kernel's _Seeded) shares its aten op's plan: keyed
    # by the wrapper, every random op added a plan, and a shape-cache entry, never freed
    func = getattr(func, "sim_wrapped", func)
    plan = _PLANS.get(id(func))
    if plan is None:
        plan = _PLANS[id(func)] = _Plan(func)
    return plan


def _aliased_arg(func: Any, i: int, args: Any, kwargs: dict[str, Any]) -> Any:
    """The argument that return ``i`` of ``func`` aliases and writes (in-place / out=), or
    None for a fresh output."""
    rets = _plan(func).rets
    if i >= len(rets) or rets[i] is None:
        return None
    for j, name in rets[i]:  # type: ignore[union-attr]
        if name in kwargs:
            return kwargs[name]
        if j < len(args):
            return args[j]
    return None


def _written_args(func: Any, args: Any, kwargs: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    for j, name in _plan(func).writes:
        v = kwargs.get(name, args[j] if j < len(args) else None)
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif v is not None:
            out.extend(x for x in pytree.tree_leaves(v) if isinstance(x, torch.Tensor))
    return out


def _assemble(func: Any, args: Any, kwargs: dict[str, Any], out: Any,
              make: Callable[[int, torch.Tensor], torch.Tensor]) -> Any:
    """The op's result: aliased returns are the argument objects, the rest ``make(i, t)``."""
    if isinstance(out, torch.Tensor):
        alias = _aliased_arg(func, 0, args, kwargs)
        return alias if alias is not None else make(0, out)
    if isinstance(out, tuple) and len(out) == len(func._schema.returns):
        return tuple(
            (a if (a := _aliased_arg(func, i, args, kwargs)) is not None else
             (make(i, o) if isinstance(o, torch.Tensor) else o))
            for i, o in enumerate(out))
    counter = iter(range(1 << 30))
    return pytree.tree_map_only(torch.Tensor, lambda t: make(next(counter), t), out)


_SEQ = (list, tuple, torch.Size)


def _flatten(args: Any, kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
    """``pytree.tree_flatten((args, kwargs))`` for what aten ops take (leaves, and lists or
    tuples of leaves), several times cheaper; its own spec (hashable), for
    :func:`_unflatten`. Anything nested deeper goes to pytree."""
    flat: list[Any] = []
    shape: list[Any] = []
    for a in args:
        if type(a) in _SEQ:
            for y in a:
                if isinstance(y, (list, tuple, dict)):
                    return _tree_flatten(args, kwargs)
            shape.append((type(a), len(a)))
            flat.extend(a)
        elif isinstance(a, (list, tuple, dict)):
            return _tree_flatten(args, kwargs)
        else:
            shape.append(None)
            flat.append(a)
    if not kwargs:
        if all(x is None for x in shape):  # (no list among them)
            return flat, _SIMPLE
        return flat, ("flat", tuple(shape), ())
    keys: list[Any] = []
    for k, a in kwargs.items():
        if type(a) in _SEQ:
            for y in a:
                if isinstance(y, (list, tuple, dict)):
                    return _tree_flatten(args, kwargs)
            keys.append((k, type(a), len(a)))
            flat.extend(a)
        elif isinstance(a, (list, tuple, dict)):
            return _tree_flatten(args, kwargs)
        else:
            keys.append((k, None, 1))
            flat.append(a)
    return flat, ("flat", tuple(shape), tuple(keys))


def _tree_flatten(args: Any, kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
    flat, spec = pytree.tree_flatten((args, kwargs))
    return flat, ("tree", spec)


_SIMPLE = ("simple",)  # _flatten's spec of positional leaves only


def _unflatten(flat: list[Any], spec: Any) -> tuple[Any, dict[str, Any]]:
    if spec is _SIMPLE:
        return tuple(flat), {}
    if spec[0] == "tree":
        return pytree.tree_unflatten(flat, spec[1])  # type: ignore[no-any-return]
    _, shape, keys = spec
    args: list[Any] = []
    i = 0
    for s in shape:
        if s is None:
            args.append(flat[i])
            i += 1
        else:
            typ, n = s
            args.append(typ(flat[i:i + n]))
            i += n
    kwargs: dict[str, Any] = {}
    for k, typ, n in keys:
        if typ is None:
            kwargs[k] = flat[i]
            i += 1
        else:
            kwargs[k] = typ(flat[i:i + n])
            i += n
    return tuple(args), kwargs


_LABELS: dict[tuple[str, torch.device], str] = {}


def _deferred(sim: SimState, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    plan = _PLANS.get(id(func)) or _plan(func)
    flat, spec = _flatten(args, kwargs)
    allow_cpu = plan.cpu_ok
    # one pass over the arguments: their device, the shape cache's key, what the queued
    # kernel gets (device tensors' memory; CPU tensors by value), the memory it reads
    device: Any = None
    proxy = False
    cacheable = True
    parts: list[Any] = [id(plan.func), spec]  # (the plan holds it: its id stays its own)
    inner_flat: list[Any] = []
    dev_reads: list[torch.Tensor] = []
    uva: list[Any] = []
    for x in flat:
        if isinstance(x, _DEV):
            d = x._sim_device
            if device is None:
                device = d
            elif d != device:
                devices_of(flat, allow_cpu)  # (raises, naming both)
            if type(x) is Proxy:
                proxy = True
            inner = x._inner
            lk = x._lk
            if lk is None:
                lk = x._lk = layout_id(inner)
            parts.append(lk)
            if x._host is not None:
                uva.append(x)
            inner_flat.append(inner)
            dev_reads.append(inner)
        elif isinstance(x, torch.Tensor):
            nd = x.dim()
            if nd and not allow_cpu and x.device.type == "cpu":
                devices_of(flat, allow_cpu)  # (raises, naming both devices)
            parts.append((x.shape, x.stride(), x.dtype, nd > 0))
            inner_flat.append(x.clone())  # CPU scalars/indices: passed by value at launch
        else:
            if cacheable:
                if isinstance(x, _SCALARS):
                    parts.append((type(x), x))
                else:
                    cacheable = False
            inner_flat.append(x)
    if device is None:
        devices_of(flat, allow_cpu)  # (raises)
    key = tuple(parts) if cacheable else None
    meta_out = _META_CACHE.get(key) if key is not None else None
    if meta_out is None:
        try:
            ma, mk = _unflatten([_meta(x) for x in flat], spec)
            meta_out = func(*ma, **mk)
        except Exception:  # noqa: BLE001 - data-dependent output size, or no meta kernel
            return _host_fallback(sim, func, args, kwargs, device, proxy)
        if key is not None:
            if len(_META_CACHE) > 4096:
                _META_CACHE.clear()
            _META_CACHE[key] = meta_out
    fresh: list[tuple[int, torch.Tensor]] = []
    index = device.index or 0

    stream = sim.sched.current_stream(index)

    def make(i: int, m: torch.Tensor) -> torch.Tensor:
        inner, block = sim.device_empty(m.shape, m.stride(), m.dtype, index, stream=stream)
        fresh.append((i, inner))
        return wrap(inner, device, None, proxy, block)

    if isinstance(meta_out, torch.Tensor):  # (most ops: one tensor, in place or fresh)
        result = _aliased_arg(func, 0, args, kwargs) if plan.rets and plan.rets[0] is not None \
            else None
        if result is None:
            result = make(0, meta_out)
        elif isinstance(result, _DEV) and result.shape != meta_out.shape:
            # (an out= tensor of another shape: torch resizes it, which a simulated tensor
            # cannot be; its size would stay wrong)
            raise NotImplementedError(
                f"{plan.name} into a simulated CUDA tensor of shape {tuple(result.shape)} for "
                f"a result of shape {tuple(meta_out.shape)}: changing a device tensor's size "
                "in place is not simulated; pass an out= tensor of the result's shape")
    else:
        result = _assemble(func, args, kwargs, meta_out, make)
    name = plan.name
    label = _LABELS.get((name, device))
    if label is None:
        label = _LABELS[(name, device)] = f"{name} on {device}"
    ia, ik = _unflatten(inner_flat, spec)
    if plan.writes:
        written = [w for w in _written_args(func, args, kwargs) if isinstance(w, _DEV)]
        writes = [w._inner for w in written]
        host_writes = [span(w._inner) for w in written if w._host is not None]
    else:
        writes, host_writes = [], []
    for _, inner in fresh:
        writes.append(inner)
    reads: list[HostRead] = []
    if uva:
        reads = [HostRead.of(sim.pinned, x._inner, "UVA view (pinned host memory) read by "
                             f"{name}") for x in uva]
        label = call_site().describe(label)
    packet = plan.packet
    seed = int(sim.sched.rng.integers(1 << 62)) if plan.scatter and sim.mode == "random" \
        else None
    # the torch binding the user called, when it is this op on these arguments (the direct
    # path of _tensor): on host tensors it is several times cheaper than the aten op's boxed
    # call, and it treats Python numbers as the user's call did
    direct = _entry.direct
    call = direct[1] if direct is not None and direct[0] is func else func
    into = None
    if seed is None and not fresh:
        def run(_: list[torch.Tensor]) -> None:  # (in place)
            call(*ia, **ik)
    elif seed is None and len(fresh) == 1 and fresh[0][0] == 0 and \
            isinstance(meta_out, torch.Tensor) and call is not func:
        out0 = fresh[0][1]
        into = _torch_out(call, key, flat, spec, meta_out) if plan.out_fn is not None and \
            key is not None else None
        if into is not None:
            def run(_: list[torch.Tensor]) -> None:  # (one fresh output, by torch.<op>(out=))
                into(*ia, **ik, out=out0)
        else:
            def run(_: list[torch.Tensor]) -> None:  # (one fresh output, by the binding)
                out0.copy_(call(*ia, **ik))
    elif seed is None and len(fresh) == 1 and fresh[0][0] == 0 and \
            isinstance(meta_out, torch.Tensor):
        out0 = fresh[0][1]
        # (a _HostKernel wrapper, e.g. batch_norm_elemt, shares its aten op's plan but must
        # keep its own functional run: the CPU build lacks the aten op's out= kernel)
        out_fn = plan.out_fn if func is plan.func else None
        if out_fn is not None:
            def run(_: list[torch.Tensor]) -> None:  # (the common case: into its memory)
                out_fn(*ia, **ik, out=out0)
        else:
            def run(_: list[torch.Tensor]) -> None:  # (one fresh output)
                out0.copy_(func(*ia, **ik))
    else:
        def run(_: list[torch.Tensor]) -> None:
            a, k = ia, ik
            if seed is not None:  # positions are device values: shuffle when the kernel runs
                a, k = _shuffle_duplicates(seed, packet, a, k)
            out = call(*a, **k)
            if fresh:
                leaves = [out] if isinstance(out, torch.Tensor) else list(out) \
                    if isinstance(out, tuple) else pytree.tree_leaves(out)
                for i, inner in fresh:
                    inner.copy_(leaves[i])

    lane = _entry.lane
    if lane is not None and lane[1] is args and lane[2] is kwargs and direct is not None and \
            call is not func and key is not None and (spec is _SIMPLE or (
                lane[3] is not None and not plan.writes)) and not uva and not proxy and \
            seed is None and isinstance(meta_out, torch.Tensor):
        _offer_lane(lane[0], plan, flat, device, label, lane[3] or call,
                    into if fresh else None, meta_out, fresh, result)
    sim.sched.enqueue(stream,
                      Op(label, run, reads, host_writes=host_writes, acc=(name, dev_reads, writes),
                         plain=True))
    return result


def _offer_lane(lane_key: Any, plan: _Plan, args: list[Any], device: torch.device,
                label: str, call: Any, into: Any, meta_out: torch.Tensor,
                fresh: list[tuple[int, torch.Tensor]], result: Any) -> None:
    """Keep what :func:`_deferred` worked out for this call of the direct path (one aten op
    of positional simulated tensors and numbers, no UVA view; ``args``: them, flattened) as
    a :class:`_Lane`, if its later calls of the same kind (binding, shapes, strides, dtypes,
    numbers, device) can skip to the allocation, the race check and the queue."""
    if not all(type(a) is SimTensor or type(a) in _LANE_SCALARS for a in args):
        return  # (a CPU tensor is passed by value, a list would need _flatten)
    known = _HANDLERS.get(id(plan.func))
    if known is None or known[1] is not _deferred:
        return  # (_deferred inside another op's handler, which may do more)
    written = [j for j, _ in plan.writes if j < len(args)]
    if len(written) != len(plan.writes) or any(type(args[j]) is not SimTensor
                                                for j in written):
        return
    if fresh:
        if written or len(fresh) != 1:
            return
        ret = -1
    else:
        ret = next((j for j, a in enumerate(args) if a is result), -1)
        if ret < 0 or not written:
            return
    keep_lane(lane_key, _Lane(device, label, plan.name, call, into, meta_out, ret,
                              tuple(written), "launches"))


_LANE_SCALARS = (int, float, bool)


class _Lane:
    """A call of the direct path that :func:`_deferred` has seen: the same kind again is
    the same work (its output's layout, its kernel, what it reads and writes) on new
    arguments. Called with them, it allocates, checks races and queues as ``_deferred``
    does, or returns ``NO_LANE`` where ``_deferred`` would do more (random mode, a graph
    capture, a kernel's body, an inference tensor written, a closed or forked simulator)."""

    __slots__ = ("call", "count", "device", "dtype", "index", "into", "label", "layout", "name",
                 "ret", "shape", "stride", "written")

    def __init__(self, device: torch.device, label: str, name: str, call: Any, into: Any,
                 meta_out: torch.Tensor | None, ret: int, written: tuple[int, ...],
                 count: str) -> None:
        self.device, self.index = device, device.index or 0
        self.label, self.name, self.call, self.into = label, name, call, into
        if meta_out is not None:
            self.shape, self.stride, self.dtype = \
                meta_out.shape, meta_out.stride(), meta_out.dtype
            self.layout = layout_of(self.shape, self.stride, self.dtype)
        self.ret, self.written, self.count = ret, written, count

    def __call__(self, args: Any, frame: Any = None) -> Any:
        """``frame``: the caller's, where the race checker finds the user's line (else from
        ``race_entry.frame``)."""
        if not _ACTIVE:
            return NO_LANE
        sim = _ACTIVE[-1]  # (current())
        sched = sim.sched
        index = self.index
        stream = sched.shortcut_stream(index)
        if stream is None:
            return NO_LANE
        written = self.written
        if written and INFERENCE_MADE[0]:
            with _NO_SUBCLASS_TF():  # (a SimTensor's method goes to its __torch_function__)
                for j in written:
                    if args[j].is_inference():
                        return NO_LANE
        if len(args) == 2 and type(args[0]) is SimTensor and type(args[1]) is SimTensor:
            ia = reads = [args[0]._inner, args[1]._inner]  # (the common call)
        else:
            ia = []
            reads = []
            for a in args:
                if type(a) is SimTensor:
                    a = a._inner
                    reads.append(a)
                ia.append(a)
        call = self.call
        with sched.lock:
            if self.ret < 0:
                shape, stride, dtype = self.shape, self.stride, self.dtype
                inner, handle, new = sim.allocators[index].empty_strided(
                    shape, stride, dtype, stream, self.layout)
                if new and sim.mode != "eager":
                    poison_(inner)
                result = wrap_fresh(inner, shape, stride, dtype, self.device, handle)
                into = self.into
                if into is not None:
                    sched.kernel(stream, self.label, into, ia, inner, self.name, reads,
                                 (inner,), self.count, frame)
                else:
                    sched.kernel(stream, self.label, _copy_result, (inner, call, *ia), None,
                                 self.name, reads, (inner,), self.count, frame)
            else:
                result = args[self.ret]
                sched.kernel(stream, self.label, call, ia, None, self.name, reads,
                             [args[j]._inner for j in written], self.count, frame)
        if written:
            _bump_version([args[j] for j in written])
        return result


def _copy_result(out: torch.Tensor, call: Any, *args: Any) -> None:
    """A lane's kernel for a binding without ``out=``: its result copied into ``out``."""
    out.copy_(call(*args))


# (the shape cache's key of a call, torch binding's name) -> torch's function of that name,
# which takes these arguments with out=, or None
_TORCH_OUT: dict[Any, Any] = {}


def _torch_out(binding: Any, key: Any, flat: list[Any], spec: Any, meta_out: Any) -> Any:
    """``torch.<name>`` of a binding whose aten op has an ``out=`` overload of the same
    arguments (``Tensor.add`` -> ``torch.add``), if it takes this call's arguments with
    ``out=`` (tried once on meta tensors): it writes the result straight into the output's
    memory (the binding's result and a copy cost twice that)."""
    name = getattr(binding, "__name__", "")
    known = _TORCH_OUT.get((key, name), _NOT_TRIED)
    if known is _NOT_TRIED:
        known = getattr(torch, name, None)
        if isinstance(known, types.BuiltinFunctionType):
            try:
                ma, mk = _unflatten([_meta(x) for x in flat], spec)
                known(*ma, **mk, out=torch.empty_like(meta_out))
            except Exception:  # noqa: BLE001 - (its Python signature differs: no out= here)
                known = None
        else:
            known = None
        if len(_TORCH_OUT) > 4096:
            _TORCH_OUT.clear()
        _TORCH_OUT[(key, name)] = known
    return known


_NOT_TRIED = object()


_SCATTERS = {aten.scatter_, aten.scatter, aten.index_put_, aten.index_put,
             aten._index_put_impl_}


def _shuffle_duplicates(seed: int, packet: Any, args: Any,
                        kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Random mode: one scatter's writes land in a seeded shuffled order, as on a GPU (with
    duplicate positions, which one wins is unspecified there)."""
    rng = np.random.default_rng(seed)
    args = list(args)
    if packet in (aten.scatter_, aten.scatter) and len(args) >= 4 and \
            isinstance(args[2], torch.Tensor) and args[2].dim() == 1:
        index = args[2]
        perm = torch.from_numpy(rng.permutation(index.numel()))
        args[2] = index[perm]
        if isinstance(args[3], torch.Tensor) and args[3].dim() == 1:
            args[3] = args[3][: index.numel()][perm]
    elif packet in (aten.index_put_, aten.index_put, aten._index_put_impl_) and len(args) >= 3:
        indices, values = args[1], args[2]
        accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        idx = [i for i in indices if i is not None]
        if not accumulate and idx and all(i.dim() == 1 and i.dtype != torch.bool and
                                          i.numel() == idx[0].numel() for i in idx):
            perm = torch.from_numpy(rng.permutation(idx[0].numel()))
            args[1] = [None if i is None else i[perm] for i in indices]
            if isinstance(values, torch.Tensor) and values.dim() >= 1 and \
                    values.shape[0] == idx[0].numel():
                args[2] = values[perm]
    return tuple(args), kwargs


def _host_fallback(sim: SimState, func: Any, args: Any, kwargs: dict[str, Any],
                   device: torch.device, proxy: bool) -> Any:
    """An op whose output size depends on device values: the host waits for the stream, then
    runs it (a host stall inside pinstage calls, as on CUDA)."""
    stream = sim.sched.current_stream(device)
    name = func.overloadpacket.__name__
    flat = pytree.tree_leaves((args, kwargs))
    sim.sched.races.access(stream, stream.last, name, [x._inner for x in flat if is_device(x)],
                           [w._inner for w in _written_args(func, args, kwargs)
                            if is_device(w)])
    sim.sched.host_wait(stream, stream.last, f"{name} (its output size depends on device "
                        "values)")
    ia, ik = pytree.tree_map(inner_of, (args, kwargs))
    with torch._C.DisableTorchFunction():
        out = func(*ia, **ik)
    sim.sched.stats.launches += 1
    return _assemble(func, args, kwargs, out,
                     lambda i, t: wrap(t.clone() if t.device.type == "cpu" else t, device,
                                       None, proxy))


def _host_read(sim: SimState, x: Any, what: str) -> torch.Tensor:
    stream = sim.sched.current_stream(x._sim_device)
    sim.sched.races.access(stream, stream.last, what, (x._inner,))
    sim.sched.host_wait(stream, stream.last, what)
    return x._inner  # type: ignore[no-any-return]


def _local_scalar(sim: SimState, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    return _host_read(sim, args[0], ".item()").item()


def _equal(sim: SimState, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    a, b = args[0], args[1]
    if is_device(a) and is_device(b) and a._sim_device != b._sim_device:
        raise RuntimeError("Expected all tensors to be on the same device")
    ia = _host_read(sim, a, "torch.equal") if is_device(a) else a
    ib = _host_read(sim, b, "torch.equal") if is_device(b) else b
    return torch.equal(ia, ib)


def _is_nonzero(sim: SimState, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    return bool(_host_read(sim, args[0], "bool(tensor)").item())


def _noop(sim: SimState, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    return None


def _empty_like(sim: SimState, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    flat, spec = pytree.tree_flatten((args, kwargs))
    device, proxy = devices_of(flat, allow_cpu=True)
    ma, mk = pytree.tree_unflatten([_meta(x) for x in flat], spec)
    m = func(*ma, **mk)
    t = empty_device(sim, m.shape, m.dtype, device.index or 0, m.stride())
    return Proxy(t._inner, device, None, t._block) if proxy else t


def _copy(sim: SimState, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    dst, src = args[0], args[1]
    nb = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    if is_device(dst) and is_device(src):  # device -> device (peer copies included)
        stream = sim.sched.current_stream(dst._sim_device)
        deps = []
        if src._sim_device != dst._sim_device:
            other = sim.sched.current_stream(src._sim_device)
            deps.append((other, other.last))
        reads = [HostRead.of(sim.pinned, src._inner, "UVA view read by a device copy")] \
            if src._host is not None else []
        d_in, s_in = dst._inner, src._inner
        writes = [span(d_in)] if dst._host is not None else []
        lane = _entry.lane
        if lane is not None and lane[1] is args and lane[2] is kwargs and not deps and \
                not reads and not writes and type(dst) is SimTensor and \
                type(src) is SimTensor:  # (Tensor.copy_ of the same arguments: _tensor)
            keep_lane(lane[0], _Lane(dst._sim_device, "device-to-device copy",
                                     "device-to-device copy", torch.Tensor.copy_, None, None,
                                     0, (0,), "d2d_copies"))
        if deps:  # the copy runs after the source device's current work
            sim.sched.races.join(stream, sim.sched.races.snapshot(deps[0][0]))
        sim.sched.enqueue(stream, Op("device-to-device copy", lambda _: d_in.copy_(s_in), reads,
                                     deps=deps, host_writes=writes,
                                     acc=("device-to-device copy", (s_in,), (d_in,)),
                                     plain=True),
                          "d2d_copies")
        if deps:  # PyTorch orders a peer copy on both devices' current streams
            other = deps[0][0]
            sim.sched.races.join(other, sim.sched.races.snapshot(stream))
            sim.sched.enqueue(other, Op("wait for a peer copy", None,
                                  deps=[(stream, stream.last)]), None)
        return dst
    if is_device(dst):  # host -> device
        if not isinstance(src, torch.Tensor):
            raise TypeError(f"copy_ source must be a tensor, got {type(src).__name__}")
        return _h2d(sim, dst, src, nb)
    if is_device(src):  # device -> host
        return _d2h(sim, dst, src, nb)
    with torch._C.DisableTorchFunction():
        return dst.copy_(src, nb)


def _h2d(sim: SimState, dst: Any, src: torch.Tensor, nb: bool) -> Any:
    stream = sim.sched.current_stream(dst._sim_device)
    d_in = dst._inner
    writes = [span(d_in)] if dst._host is not None else []
    if src.dim() == 0:  # a scalar passed by value (x[i] = 5): a fill kernel
        value = src.clone()
        sim.sched.enqueue(stream, Op("fill", lambda _: d_in.copy_(value), host_writes=writes,
                                     acc=("fill", (), (d_in,)), plain=True))
        return dst
    pinned = sim.is_pinned(src) and src.is_contiguous()
    if nb and pinned:  # async: the device reads the pinned source when the copy runs
        label = call_site().describe("host-to-device copy")
        read = HostRead.of(sim.pinned, src, "pinned host source")
        sim.sched.enqueue(stream, Op(label, lambda rs: d_in.copy_(rs[0]), [read],
                                     host_writes=writes,
                                     acc=("host-to-device copy", (src,), (d_in,)),
                                     plain=True), "copies")
        return dst
    if stream.capture is not None:
        raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture "
                           "unless the CPU tensor is pinned.")
    sim.sched.races.access(stream, stream.last, "blocking host-to-device copy", (), (d_in,))
    sim.sched.stats.copies += 1
    if pinned:  # blocking copy from pinned memory: the host waits for the stream
        sim.sched.host_wait(stream, stream.last, "a blocking host-to-device copy")
    else:  # pageable: the driver drains the stream and copies synchronously
        sim.sched.check_usable()
        sim.sched.check_not_capturing("a host-to-device copy from pageable memory")
        if not nb and sim.sched.sync_debug_mode:  # (torch does not flag non_blocking ones)
            sim.sched.sync_debug("a blocking host-to-device copy")
        sim.sched.stats.pageable_copies += 1
        sim.sched.stats.syncs += 1
        sim.sched.stats.host_stalls += 1
        sim.sched.run_until(stream, stream.last)
        sim.sched.races.host_waited(stream, stream.last)
    with torch._C.DisableTorchFunction():
        d_in.copy_(src)
    return dst


def _d2h(sim: SimState, dst: torch.Tensor, src: Any, nb: bool) -> Any:
    stream = sim.sched.current_stream(src._sim_device)
    s_in = src._inner
    if nb and sim.is_pinned(dst):  # async into pinned memory: poison until it runs
        lo, hi = span(dst)
        for op, r in sim.sched.pending_reads():  # queued reads run before the copy lands
            if r.span[0] < hi and lo < r.span[1]:
                r.freeze(op.label)
        with torch._C.DisableTorchFunction():
            poison_(dst)
        read = HostRead.of(sim.pinned, dst, "destination of a device-to-host copy (written by the "
                           "host before the copy ran)")
        label = call_site().describe("device-to-host copy")
        sim.sched.enqueue(stream, Op(label, lambda rs: rs[0].copy_(s_in), [read],
                                     host_writes=[span(dst)],
                                     acc=("device-to-host copy", (s_in,), (dst,)), plain=True),
                          "d2h_copies")
        return dst
    if stream.capture is not None:  # (CUDA's check, before any driver call: no invalidation)
        raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture "
                           "unless the CPU tensor is pinned.")
    sim.sched.races.access(stream, stream.last, "blocking device-to-host copy", (s_in,))
    sim.sched.stats.d2h_copies += 1
    sim.sched.host_wait(stream, stream.last, "a device-to-host copy")
    with torch._C.DisableTorchFunction():
        dst.copy_(s_in)
    return dst


def _to_copy(sim: SimState, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    x = args[0]
    device = kwargs.get("device")
    dtype = kwargs.get("dtype") or x.dtype
    nb = bool(kwargs.get("non_blocking", False))
    if device is not None:
        device = torch.device(device)
        if device.type == "cpu":
            out = sim.pinned_empty(tuple(x.shape), dtype) if nb and sim.pin_memory else \
                torch.empty(tuple(x.shape), dtype=dtype, device="cpu")
            return _d2h(sim, out, x, nb)
        if device.type == "cuda" and sim.sched.device_index(device) != x._sim_device.index:
            stride = like_strides(x._inner) if kwargs.get("memory_format") in (
                None, torch.preserve_format) else None  # (a peer copy keeps the layout)
            dst = empty_device(sim, x.shape, dtype, sim.sched.device_index(device), stride)
            return _copy(sim, aten.copy_.default, (dst, x, nb), {})
    kw = {k: v for k, v in kwargs.items() if k not in ("device", "non_blocking", "pin_memory")}
    return _deferred(sim, func, args, kw)


def _inplace_view(sim: SimState, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """``t.t_()``, ``t.unsqueeze_(0)``, ``t.as_strided_(...)``...: metadata only, so done at
    once, as views are: on the host tensor and on the simulated tensor's own metadata (as
    PyTorch's return_and_correct_aliasing does for wrapper subclasses)."""
    self = args[0]
    flat, spec = _flatten(args, kwargs)
    devices_of(flat, allow_cpu=True)
    # a fresh alias of the host memory takes the new metadata: kernels queued before (lazy
    # mode, a stream not yet run) keep the tensor object they were given, with its old shape,
    # as a launched kernel's arguments do on a GPU (and so does a block's next owner)
    inner = self._inner
    with torch.utils._mode_utils.no_dispatch():
        alias = inner.as_strided(inner.size(), inner.stride(), inner.storage_offset())
        a, k = _unflatten([alias if x is self else x._inner if isinstance(x, _DEV) else x
                           for x in flat], spec)
        func(*a, **k)
        func(*args, **kwargs)  # (the simulated tensor's own metadata)
    self._inner = alias
    self.__dict__.pop("_proxy", None)  # (its cpu view, of the old metadata)
    self._lk = None
    return self


def _fits(t: torch.Tensor, meta: torch.Tensor) -> bool:
    """Whether ``meta``'s layout, at ``t``'s offset, lies in ``t``'s storage (torch grows a
    tensor's storage for a resize that needs more: an expanded tensor's). For a simulated
    tensor, both its host tensor's and its own (the wrapper's) must hold it."""
    n = 1 + sum((d - 1) * st for d, st in zip(meta.shape, meta.stride())) \
        if meta.numel() else 0
    return (t.storage_offset() + n) * t.element_size() <= t.untyped_storage().nbytes()


def _resize(sim: SimState, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """``resize_``/``resize_as_`` to the shape a simulated tensor has changes at most its
    strides (a ``memory_format=``), at once, as :func:`_inplace_view` does; to another shape,
    and ``set_``, the simulator refuses (it cannot change a device tensor's size in place:
    allocate one of the new size instead) rather than leave the tensor's size wrong."""
    self = args[0]
    if func.overloadpacket in (aten.resize_, aten.resize_as_):
        # (what torch does to a tensor of this layout, worked out on meta tensors: its
        # strides, or torch's error for these arguments)
        meta = torch.empty_strided(self.shape, self.stride(), dtype=self.dtype, device="meta")
        rest, spec = _flatten(args[1:], kwargs)
        ma, mk = _unflatten([_meta(x) for x in rest], spec)
        func(meta, *ma, **mk)
        if meta.shape == self.shape and _fits(self._inner, meta) and _fits(self, meta):
            if meta.stride() != self.stride():
                _inplace_view(sim, aten.as_strided_.default,
                              (self, meta.shape, meta.stride(), self.storage_offset()), {})
            return self
    raise NotImplementedError(
        f"{func.overloadpacket.__name__} of a simulated CUDA tensor ({self._sim_device}, shape "
        f"{tuple(self.shape)}) to another shape or storage is not simulated: allocate a tensor "
        "of the new size (torch.empty(size, device=...)) and copy into it")


register_op(aten.t_, aten.transpose_, aten.unsqueeze_, aten.squeeze_, aten.swapdims_,
            aten.swapaxes_, aten.as_strided_)(_inplace_view)
register_op(aten.resize_, aten.resize_as_, aten.set_)(_resize)
register_op(aten.copy_)(_copy)
register_op(aten._to_copy)(_to_copy)
register_op(aten._local_scalar_dense)(_local_scalar)
register_op(aten.equal)(_equal)
register_op(aten.is_nonzero)(_is_nonzero)
register_op(aten.record_stream)(_noop)
register_op(aten.empty_like, aten.new_empty, aten.new_empty_strided)(_empty_like)
register_default("view")(_view)
register_default("op")(_deferred)


def launch(sim: SimState, fn: Callable[..., Any], args: Any, kwargs: dict[str, Any],
           writes: tuple[Any, ...]) -> None:
    """``sim.launch``: ``fn`` queued as one kernel; device tensors reach it as their memory."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    devices = [x for x in flat if is_device(x)]
    device = devices[0]._sim_device if devices else \
        torch.device("cuda", sim.sched.current_device())
    name = getattr(fn, "__name__", "kernel")
    reads: list[HostRead] = []
    inner = []
    x: Any
    for x in flat:
        host = isinstance(x, torch.Tensor) and (
            (is_device(x) and getattr(x, "_host", None) is not None) or
            (not is_device(x) and sim.is_pinned(x)))
        if host and not any(x is w for w in writes):
            reads.append(HostRead.of(sim.pinned, inner_of(x), f"input of kernel {name} in host "
                                                       "memory"))
        inner.append(inner_of(x))
    a, k = pytree.tree_unflatten(inner, spec)
    host_writes = [span(inner_of(w)) for w in writes if isinstance(w, torch.Tensor) and (
        (is_device(w) and getattr(w, "_host", None) is not None) or
        (not is_device(w) and sim.is_pinned(w)))]
    site = call_site()
    label = site.describe(f"kernel {name}")
    tensors = [x for x in flat if isinstance(x, torch.Tensor) and
               (is_device(x) or sim.is_pinned(x))]
    written = [inner_of(w) for w in writes if isinstance(w, torch.Tensor)]
    acc = (f"kernel {name}", [inner_of(x) for x in tensors if not any(x is w for w in writes)],
           written)

    def body(_: list[torch.Tensor]) -> None:
        with torch._C._EnableTorchFunction():  # ops on device tensors inside are the kernel's
            fn(*a, **k)

    sim.sched.enqueue(sim.sched.current_stream(device), Op(label, body, reads,
                                                           host_writes=host_writes, acc=acc))


