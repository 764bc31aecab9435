"""Simulated CUDA tensors: a wrapper subclass that reports ``cuda:i`` and keeps its data in
host memory, whose every operation is queued on the current stream of its device.

* :class:`SimTensor` - the device tensor. ``__torch_dispatch__`` decides what each aten op
  means: views run at once (metadata only); copies are host<->device transfers with their
  blocking rules; everything else is shape-inferred on ``meta`` tensors, given fresh outputs,
  and queued; ops whose output size depends on device values make the host wait.
* :class:`_Proxy` - the same tensor reporting ``cpu``, used only to run the few Python
  bindings that install a CUDA device guard (``__getitem__``, ``__setitem__``,
  ``contiguous``...), which a CPU-only build of torch cannot do.
* :class:`SimFunctionMode` - catches what never reaches the dispatcher on a CPU build:
  factories with ``device="cuda"``, ``pin_memory=True``, ``Tensor.pin_memory()``,
  ``is_pinned()``, ``.to("cuda")`` / ``.cuda()``.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ._sched import HostRead, Op, poison_, span

if TYPE_CHECKING:
    from . import Simulator

__all__ = ["SimDispatchMode", "SimFunctionMode", "SimTensor", "enter_modes", "launch",
           "spread_to_new_threads", "stop_spreading"]

aten = torch.ops.aten
_T = torch.Tensor


def _active() -> Simulator:
    from . import active

    return active()


# --------------------------------------------------------------------------------------------
# the tensor types


_CPU = torch.device("cpu")


def _wrapper(cls: Any, inner: torch.Tensor, device: torch.device, host: Any,
             reported: torch.device) -> torch.Tensor:
    """A tensor of type ``cls`` with ``inner``'s layout, reporting ``reported`` as its device,
    whose data is ``inner`` on simulated ``device``."""
    r = torch.Tensor._make_wrapper_subclass(
        cls, inner.size(), strides=inner.stride(), storage_offset=inner.storage_offset(),
        dtype=inner.dtype, device=reported, layout=inner.layout, requires_grad=False)
    r._inner = inner
    r._host = host
    r._sim_device = device
    return r


class SimTensor(torch.Tensor):
    """A tensor on a simulated CUDA device; its data lives in ``_inner`` (a CPU tensor)."""

    _inner: torch.Tensor
    _host: Any  # the pinned host memory this aliases (a UVA view), else None
    _sim_device: torch.device

    @staticmethod
    def __new__(cls, inner: torch.Tensor, device: torch.device, host: Any = None) -> SimTensor:
        return _wrapper(cls, inner, device, host, reported=device)  # type: ignore[return-value]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        return _torch_function(func, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:
        return _torch_dispatch(func, args, kwargs or {})

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return _repr(self)


class _Proxy(torch.Tensor):
    """A :class:`SimTensor` seen as ``cpu`` by torch's Python bindings (see module doc)."""

    _inner: torch.Tensor
    _host: Any
    _sim_device: torch.device

    @staticmethod
    def __new__(cls, inner: torch.Tensor, device: torch.device, host: Any = None) -> _Proxy:
        return _wrapper(cls, inner, device, host, reported=_CPU)  # type: ignore[return-value]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:
        return _torch_dispatch(func, args, kwargs or {})


_DEV = (SimTensor, _Proxy)


def is_device(x: Any) -> bool:
    return isinstance(x, _DEV)


def wrap(inner: torch.Tensor, device: torch.device, host: Any = None,
         proxy: bool = False) -> torch.Tensor:
    return (_Proxy if proxy else SimTensor)(inner, device, host)


def _to_proxy(x: Any) -> Any:
    return _Proxy(x._inner, x._sim_device, x._host) if isinstance(x, SimTensor) else x


def _from_proxy(x: Any) -> Any:
    return SimTensor(x._inner, x._sim_device, x._host) if isinstance(x, _Proxy) else x


def empty_device(sim: Simulator, shape: Any, dtype: torch.dtype, index: int,
                 stride: Any = None) -> SimTensor:
    """Fresh simulated device memory: garbage (poison) until written, as on a GPU."""
    inner = torch.empty(tuple(shape), dtype=dtype) if stride is None else \
        torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype)
    if sim.mode != "eager":
        poison_(inner)
    return SimTensor(inner, torch.device("cuda", index))


_SEAM = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), f)
              for f in ("_cuda.py", "_backend.py"))


def _call_site() -> str:
    """Where queued work came from: ``file:line (function)`` of the first frame outside torch,
    the simulator and pinstage's device seam (so a pinstage primitive names itself)."""
    from ._sched import _QUIET

    frame: Any = sys._getframe(2)
    while frame is not None:
        fn = frame.f_code.co_filename
        if not (fn.startswith(_QUIET) or fn.startswith(_SEAM) or fn.startswith("<") or
                "contextlib" in fn):
            name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
            return f"{os.path.basename(fn)}:{frame.f_lineno} ({name})"
        frame = frame.f_back
    return "<unknown>"


# --------------------------------------------------------------------------------------------
# __torch_function__: the Python-level methods that must not reach a CUDA device guard


def _torch_function(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    handler = _TF.get(func)
    if handler is not None:
        return handler(*args, **kwargs)
    if func not in _VIA_PROXY:
        try:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        except RuntimeError as exc:  # a binding that takes a CUDA device guard first
            if "not linked with support for cuda" not in str(exc):
                raise
            _VIA_PROXY.add(func)
    args, kwargs = pytree.tree_map(_to_proxy, (args, kwargs))
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*args, **kwargs)
    return pytree.tree_map(_from_proxy, out)


def _item(self: torch.Tensor) -> Any:
    return aten._local_scalar_dense.default(self)


def _scalar(cast: Callable[[Any], Any]) -> Callable[[torch.Tensor], Any]:
    def conv(self: torch.Tensor) -> Any:
        if self.numel() != 1:
            raise RuntimeError(f"a Tensor with {self.numel()} elements cannot be converted to "
                               "Scalar")
        return cast(aten._local_scalar_dense.default(self))
    return conv


def _bool(self: torch.Tensor) -> bool:
    if self.numel() != 1:
        raise RuntimeError(f"Boolean value of Tensor with {'no values' if self.numel() == 0 else 'more than one value'} is ambiguous")  # noqa: E501
    return bool(aten._local_scalar_dense.default(self))


def _tolist(self: torch.Tensor) -> Any:
    return _to(self, "cpu").tolist()


def _numpy(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use "
                    "Tensor.cpu() to copy the tensor to host memory first.")


def _repr(self: torch.Tensor, *args: Any, **kwargs: Any) -> str:
    host = _to(self, "cpu")
    text = repr(host)
    dev = f"device='{self.device}'"
    if text.endswith(")"):
        i = text.rfind(", dtype=")
        text = (text[:i] + f", {dev}" + text[i:]) if i >= 0 else (text[:-1] + f", {dev})")
    return text


def _format(self: torch.Tensor, spec: str) -> str:
    if self.dim() == 0 and spec:
        return format(_item(self), spec)
    return _repr(self)


def _copy_(self: torch.Tensor, src: Any, non_blocking: bool = False) -> torch.Tensor:
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"copy_(): argument 'src' must be Tensor, not {type(src).__name__}")
    aten.copy_.default(self, src, non_blocking)
    return self


def _pin_memory(self: torch.Tensor, *args: Any) -> torch.Tensor:
    if is_device(self):
        raise RuntimeError(f"cannot pin '{self.type()}' only dense CPU tensors can be pinned")
    sim = _active()
    out = sim.pinned_empty(tuple(self.shape), self.dtype)
    out.copy_(self)
    return out


def _is_pinned(self: torch.Tensor, *args: Any) -> bool:
    if is_device(self):
        return False
    from . import _ACTIVE

    return _ACTIVE is not None and self.device.type == "cpu" and _ACTIVE.is_pinned(self)


def _data_ptr(self: Any) -> int:
    return int(self._inner.data_ptr() if is_device(self) else _T.data_ptr(self))


def _record_stream(self: torch.Tensor, stream: Any) -> None:
    return None  # memory lifetime here is Python's: nothing to record


def _type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False,
          **kwargs: Any) -> Any:
    if dtype is None:
        name = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half",
                torch.bfloat16: "BFloat16", torch.int64: "Long", torch.int32: "Int",
                torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
                torch.bool: "Bool"}.get(self.dtype, "")
        return f"torch.cuda.{name}Tensor"
    if isinstance(dtype, str):
        dtype = dtype.replace(".cuda.", ".")  # 'torch.cuda.DoubleTensor': stay on the device
    with torch._C.DisableTorchFunctionSubclass():
        return _from_proxy(_T.type(_to_proxy(self), dtype, non_blocking, **kwargs))


def _new_tensor(self: torch.Tensor, data: Any, dtype: Any = None, device: Any = None,
                requires_grad: bool = False, **kwargs: Any) -> torch.Tensor:
    device = device if device is not None else self.device
    dtype = dtype or self.dtype
    if _is_cuda(device):
        return _factory(_active(), torch.tensor, (data,), {"dtype": dtype, "device": device})
    return torch.tensor(data, dtype=dtype, device=device)


def _to(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``Tensor.to`` for host tensors going to a simulated device and for device tensors."""
    copy = bool(kwargs.pop("copy", False))
    if len(args) >= 4 and isinstance(args[-1], bool) and not isinstance(args[0], torch.Tensor):
        copy = bool(args[-1])  # to(device, dtype, non_blocking, copy)
        args = args[:-1]
    if args and isinstance(args[0], int) and not isinstance(args[0], bool):
        args = (torch.device("cuda", args[0]), *args[1:])  # .to(local_rank)
    if isinstance(kwargs.get("device"), int) and not isinstance(kwargs["device"], bool):
        kwargs["device"] = torch.device("cuda", kwargs["device"])
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    dtype = dtype or self.dtype
    sim = _active()
    if not is_device(self):
        if device is not None and device.type == "cuda" and self.requires_grad:
            raise NotImplementedError(
                "the simulated CUDA does not support autograd: tensors that require grad "
                "(nn.Module parameters) cannot move to a simulated device; run the model "
                "under torch.no_grad() on CPU tensors, or test it on a real GPU")
        if device is None or device.type != "cuda":
            with torch._C.DisableTorchFunction():
                return _T.to(self, *args, copy=copy, **kwargs)  # type: ignore[call-overload]
        index = sim.device_index(device)
        stride = _like_strides(self) if memory_format in (None, torch.preserve_format) \
            else None
        dst = empty_device(sim, self.shape, dtype, index, stride)
        aten.copy_.default(dst, self, bool(non_blocking))  # host -> device
        return dst
    here = self._sim_device
    if device is None or (device.type == "cuda" and sim.device_index(device) == here.index):
        if dtype == self.dtype and not copy and memory_format in (None,
                                                                  torch.preserve_format):
            return self
        kw: dict[str, Any] = {"dtype": dtype}
        if memory_format is not None:
            kw["memory_format"] = memory_format
        return aten._to_copy.default(self, **kw)
    if device.type == "cpu":
        return aten._to_copy.default(self, dtype=dtype, device=torch.device("cpu"),
                                     non_blocking=bool(non_blocking))
    if device.type == "cuda":
        dst = empty_device(sim, self.shape, dtype, sim.device_index(device))
        aten.copy_.default(dst, self, bool(non_blocking))  # device -> device
        return dst
    raise RuntimeError(f"cannot move a simulated {here} tensor to {device}")


def _cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False,
          **kwargs: Any) -> Any:
    sim = _active()
    index = sim.device_index(device)
    return _to(self, torch.device("cuda", index), non_blocking=non_blocking)


def _cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    if not is_device(self):
        with torch._C.DisableTorchFunction():
            return _T.cpu(self, *args, **kwargs)
    return _to(self, "cpu")


def _like_strides(t: torch.Tensor) -> tuple[int, ...] | None:
    if t.is_contiguous():
        return None
    return tuple(torch.empty_like(torch.empty_strided(t.shape, t.stride(), device="meta"))
                 .stride())


_TF: dict[Any, Callable[..., Any]] = {
    _T.item: _item, _T.__bool__: _bool, _T.__int__: _scalar(int),
    _T.__float__: _scalar(float), _T.__index__: _scalar(int), _T.__complex__: _scalar(complex),
    _T.tolist: _tolist, _T.numpy: _numpy, _T.__array__: _numpy, _T.__repr__: _repr,
    _T.__str__: _repr, _T.__format__: _format, _T.copy_: _copy_, _T.pin_memory: _pin_memory,
    _T.is_pinned: _is_pinned, _T.data_ptr: _data_ptr, _T.record_stream: _record_stream,
    _T.to: _to, _T.cuda: _cuda, _T.cpu: _cpu, _T.type: _type, _T.new_tensor: _new_tensor,
}
_VIA_PROXY = {
    _T.__getitem__, _T.__setitem__, _T.contiguous, _T.float, _T.double, _T.half,
    _T.bfloat16, _T.int, _T.long, _T.short, _T.char, _T.byte, _T.bool,
    getattr(_T, "cfloat", _T.float), getattr(_T, "cdouble", _T.double), _T.index_put_,
    _T.index_put, _T.masked_fill_, _T.put_, _T.index_fill_,
    _T.nonzero, _T.new_zeros, _T.new_ones, _T.new_empty, _T.new_full, _T.__len__,
    _T.element_size, _T.apply_, _T.map_, _T.requires_grad_, _T.set_, _T.view,
}


# --------------------------------------------------------------------------------------------
# __torch_dispatch__: what each aten op means on the simulated device


def _torch_dispatch(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    sim = _active()
    with sim.lock:
        handler = _HANDLERS.get(func.overloadpacket)
        if handler is not None:
            return handler(sim, func, args, kwargs)
        if func.is_view:
            return _view(sim, func, args, kwargs)
        return _deferred(sim, func, args, kwargs)


def _devices(flat: list[Any], allow_cpu: bool) -> tuple[torch.device, bool]:
    device: torch.device | None = None
    proxy = False
    for x in flat:
        if is_device(x):
            proxy = proxy or isinstance(x, _Proxy)
            if device is None:
                device = x._sim_device
            elif x._sim_device != device:
                raise RuntimeError("Expected all tensors to be on the same device, but found "
                                   f"at least two devices, {device} and {x._sim_device}!")
    if device is None:
        raise RuntimeError("internal: a simulated op without a simulated tensor")
    if not allow_cpu:
        for x in flat:
            if isinstance(x, torch.Tensor) and not is_device(x) and x.dim() > 0 and \
                    x.device.type == "cpu":
                raise RuntimeError("Expected all tensors to be on the same device, but found "
                                   f"at least two devices, {device} and cpu!")
    return device, proxy


def _inner_of(x: Any) -> Any:
    return x._inner if is_device(x) else x


def _view(sim: Simulator, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    flat, spec = pytree.tree_flatten((args, kwargs))
    device, proxy = _devices(flat, allow_cpu=True)
    base = next(x for x in flat if is_device(x))
    a, k = pytree.tree_unflatten([_inner_of(x) for x in flat], spec)
    out = func(*a, **k)
    return pytree.tree_map_only(torch.Tensor, lambda t: wrap(t, device, base._host, proxy), out)


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


def _meta_key(func: Any, flat: list[Any], spec: Any) -> Any:
    parts: list[Any] = [func, spec]
    for x in flat:
        if isinstance(x, torch.Tensor):
            parts.append((tuple(x.shape), x.stride(), x.dtype, is_device(x) or x.dim() > 0))
        elif isinstance(x, _SCALARS):
            parts.append((type(x), x))
        else:
            return None
    return tuple(parts)


def _aliased_arg(func: Any, i: int, args: Any, kwargs: dict[str, Any]) -> Any:
    """The argument that return ``i`` of ``func`` aliases and writes (in-place / out=), or
    None for a fresh output."""
    rets = func._schema.returns
    if i >= len(rets):
        return None
    info = rets[i].alias_info
    if info is None or not info.is_write:
        return None
    for j, arg in enumerate(func._schema.arguments):
        ai = arg.alias_info
        if ai is not None and ai.is_write and set(ai.before_set) & set(info.before_set):
            if arg.name in kwargs:
                return kwargs[arg.name]
            if j < len(args):
                return args[j]
    return None


def _written_args(func: Any, args: Any, kwargs: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    for j, arg in enumerate(func._schema.arguments):
        ai = arg.alias_info
        if ai is not None and ai.is_write:
            v = kwargs.get(arg.name, args[j] if j < len(args) else None)
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


def _deferred(sim: Simulator, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    packet = func.overloadpacket
    flat, spec = pytree.tree_flatten((args, kwargs))
    device, proxy = _devices(flat, allow_cpu=packet in _CPU_OK)
    key = _meta_key(func, flat, spec)
    meta_out = _META_CACHE.get(key) if key is not None else None
    if meta_out is None:
        try:
            ma, mk = pytree.tree_unflatten([_meta(x) for x in flat], spec)
            meta_out = func(*ma, **mk)
        except Exception:  # noqa: BLE001 - data-dependent output size, or no meta kernel
            return _host_fallback(sim, func, args, kwargs, device, proxy)
        if key is not None:
            if len(_META_CACHE) > 4096:
                _META_CACHE.clear()
            _META_CACHE[key] = meta_out
    fresh: list[tuple[int, torch.Tensor]] = []

    def make(i: int, m: torch.Tensor) -> torch.Tensor:
        inner = torch.empty_strided(m.shape, m.stride(), dtype=m.dtype)
        if sim.mode != "eager":
            poison_(inner)
        fresh.append((i, inner))
        return wrap(inner, device, None, proxy)

    result = _assemble(func, args, kwargs, meta_out, make)
    reads: list[HostRead] = []
    inner_flat = []
    label = f"{packet.__name__} on {device}"
    for x in flat:
        if is_device(x):
            if x._host is not None:
                reads.append(HostRead.of(sim, x._inner, "UVA view (pinned host memory) read by "
                                         f"{packet.__name__}"))
            inner_flat.append(x._inner)
        elif isinstance(x, torch.Tensor):
            inner_flat.append(x.clone())  # CPU scalars/indices: passed by value at launch
        else:
            inner_flat.append(x)
    ia, ik = pytree.tree_unflatten(inner_flat, spec)
    host_writes = [span(w._inner) for w in _written_args(func, args, kwargs)
                   if is_device(w) and w._host is not None]
    if reads:
        label += f", queued at {_call_site()}"
    seed = int(sim._rng.integers(1 << 62)) if sim.mode == "random" and packet in _SCATTERS \
        else None

    def run(_: list[torch.Tensor]) -> None:
        a, k = ia, ik
        if seed is not None:  # positions are device values: shuffle when the kernel runs
            a, k = _shuffle_duplicates(seed, packet, a, k)
        out = func(*a, **k)
        if fresh:
            leaves = [out] if isinstance(out, torch.Tensor) else list(out) \
                if isinstance(out, tuple) else pytree.tree_leaves(out)
            for i, inner in fresh:
                inner.copy_(leaves[i])

    sim.enqueue(sim.current_stream(device), Op(label, run, reads, host_writes=host_writes))
    return result


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


def _host_fallback(sim: Simulator, func: Any, args: Any, kwargs: dict[str, Any],
                   device: torch.device, proxy: bool) -> Any:
    """An op whose output size depends on device values: the host waits for the stream, then
    runs it (a host stall inside pinstage calls, as on CUDA)."""
    stream = sim.current_stream(device)
    sim.host_wait(stream, stream._last, f"{func.overloadpacket.__name__} (its output size "
                  "depends on device values)")
    ia, ik = pytree.tree_map(_inner_of, (args, kwargs))
    with torch._C.DisableTorchFunction():
        out = func(*ia, **ik)
    sim.stats.launches += 1
    return _assemble(func, args, kwargs, out,
                     lambda i, t: wrap(t.clone() if t.device.type == "cpu" else t, device,
                                       None, proxy))


def _host_read(sim: Simulator, x: Any, what: str) -> torch.Tensor:
    stream = sim.current_stream(x._sim_device)
    sim.host_wait(stream, stream._last, what)
    return x._inner  # type: ignore[no-any-return]


def _local_scalar(sim: Simulator, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    return _host_read(sim, args[0], ".item()").item()


def _equal(sim: Simulator, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    a, b = args[0], args[1]
    if is_device(a) and is_device(b) and a._sim_device != b._sim_device:
        raise RuntimeError("Expected all tensors to be on the same device")
    ia = _host_read(sim, a, "torch.equal") if is_device(a) else a
    ib = _host_read(sim, b, "torch.equal") if is_device(b) else b
    return torch.equal(ia, ib)


def _is_nonzero(sim: Simulator, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    return bool(_host_read(sim, args[0], "bool(tensor)").item())


def _noop(sim: Simulator, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    return None


def _empty_like(sim: Simulator, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    flat, spec = pytree.tree_flatten((args, kwargs))
    device, proxy = _devices(flat, allow_cpu=True)
    ma, mk = pytree.tree_unflatten([_meta(x) for x in flat], spec)
    m = func(*ma, **mk)
    t = empty_device(sim, m.shape, m.dtype, device.index or 0, m.stride())
    return _Proxy(t._inner, device) if proxy else t


def _copy(sim: Simulator, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    dst, src = args[0], args[1]
    nb = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    if is_device(dst) and is_device(src):  # device -> device (peer copies included)
        stream = sim.current_stream(dst._sim_device)
        deps = []
        if src._sim_device != dst._sim_device:
            other = sim.current_stream(src._sim_device)
            deps.append((other, other._last))
        reads = [HostRead.of(sim, src._inner, "UVA view read by a device copy")] \
            if src._host is not None else []
        d_in, s_in = dst._inner, src._inner
        writes = [span(d_in)] if dst._host is not None else []
        sim.enqueue(stream, Op("device-to-device copy", lambda _: d_in.copy_(s_in), reads,
                               deps=deps, host_writes=writes), "d2d_copies")
        if deps:  # PyTorch orders a peer copy on both devices' current streams
            other = deps[0][0]
            sim.enqueue(other, Op("wait for a peer copy", None,
                                  deps=[(stream, stream._last)]), None)
        return dst
    if is_device(dst):  # host -> device
        if not isinstance(src, torch.Tensor):
            raise TypeError(f"copy_ source must be a tensor, got {type(src).__name__}")
        return _h2d(sim, dst, src, nb)
    if is_device(src):  # device -> host
        return _d2h(sim, dst, src, nb)
    with torch._C.DisableTorchFunction():
        return dst.copy_(src, nb)


def _h2d(sim: Simulator, dst: Any, src: torch.Tensor, nb: bool) -> Any:
    stream = sim.current_stream(dst._sim_device)
    d_in = dst._inner
    writes = [span(d_in)] if dst._host is not None else []
    if src.dim() == 0:  # a scalar passed by value (x[i] = 5): a fill kernel
        value = src.clone()
        sim.enqueue(stream, Op("fill", lambda _: d_in.copy_(value), host_writes=writes))
        return dst
    pinned = sim.is_pinned(src) and src.is_contiguous()
    if nb and pinned:  # async: the device reads the pinned source when the copy runs
        label = f"host-to-device copy queued at {_call_site()}"
        read = HostRead.of(sim, src, "pinned host source")
        sim.enqueue(stream, Op(label, lambda rs: d_in.copy_(rs[0]), [read],
                               host_writes=writes), "copies")
        return dst
    sim.stats.copies += 1
    if pinned:  # blocking copy from pinned memory: the host waits for the stream
        sim.host_wait(stream, stream._last, "a blocking host-to-device copy")
    else:  # pageable: the driver drains the stream and copies synchronously
        sim.check_not_capturing("a host-to-device copy from pageable memory")
        sim.stats.pageable_copies += 1
        sim.stats.syncs += 1
        sim.stats.host_stalls += 1
        sim._run_until(stream, stream._last)
    with torch._C.DisableTorchFunction():
        d_in.copy_(src)
    return dst


def _d2h(sim: Simulator, dst: torch.Tensor, src: Any, nb: bool) -> Any:
    stream = sim.current_stream(src._sim_device)
    s_in = src._inner
    if nb and sim.is_pinned(dst):  # async into pinned memory: poison until it runs
        lo, hi = span(dst)
        for s in sim.all_streams():  # queued reads of this memory run before the copy lands
            for op in s._queue:
                for r in op.reads:
                    if r.span[0] < hi and lo < r.span[1]:
                        r.freeze(op.label)
        with torch._C.DisableTorchFunction():
            poison_(dst)
        read = HostRead.of(sim, dst, "destination of a device-to-host copy (written by the "
                           "host before the copy ran)")
        label = f"device-to-host copy queued at {_call_site()}"
        sim.enqueue(stream, Op(label, lambda rs: rs[0].copy_(s_in), [read],
                               host_writes=[span(dst)]), "d2h_copies")
        return dst
    sim.stats.d2h_copies += 1
    sim.host_wait(stream, stream._last, "a device-to-host copy")
    with torch._C.DisableTorchFunction():
        dst.copy_(s_in)
    return dst


def _to_copy(sim: Simulator, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    x = args[0]
    device = kwargs.get("device")
    dtype = kwargs.get("dtype") or x.dtype
    nb = bool(kwargs.get("non_blocking", False))
    if device is not None:
        device = torch.device(device)
        if device.type == "cpu":
            out = sim.pinned_empty(tuple(x.shape), dtype) if nb and sim.pin_memory else \
                torch.empty(tuple(x.shape), dtype=dtype)
            return _d2h(sim, out, x, nb)
        if device.type == "cuda" and sim.device_index(device) != x._sim_device.index:
            dst = empty_device(sim, x.shape, dtype, sim.device_index(device))
            return _copy(sim, aten.copy_.default, (dst, x, nb), {})
    kw = {k: v for k, v in kwargs.items() if k not in ("device", "non_blocking", "pin_memory")}
    return _deferred(sim, func, args, kw)


_HANDLERS: dict[Any, Callable[..., Any]] = {
    aten.copy_: _copy, aten._to_copy: _to_copy, aten._local_scalar_dense: _local_scalar,
    aten.equal: _equal, aten.is_nonzero: _is_nonzero, aten.record_stream: _noop,
    aten.empty_like: _empty_like, aten.new_empty: _empty_like,
    aten.new_empty_strided: _empty_like,
}


def launch(sim: Simulator, fn: Callable[..., Any], args: Any, kwargs: dict[str, Any],
           writes: tuple[Any, ...]) -> None:
    """``sim.launch``: ``fn`` queued as one kernel; device tensors reach it as their memory."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    devices = [x for x in flat if is_device(x)]
    device = devices[0]._sim_device if devices else torch.device("cuda", sim.current_device())
    name = getattr(fn, "__name__", "kernel")
    reads: list[HostRead] = []
    inner = []
    x: Any
    for x in flat:
        host = isinstance(x, torch.Tensor) and (
            (is_device(x) and getattr(x, "_host", None) is not None) or
            (not is_device(x) and sim.is_pinned(x)))
        if host and not any(x is w for w in writes):
            reads.append(HostRead.of(sim, _inner_of(x), f"input of kernel {name} in host "
                                                       "memory"))
        inner.append(_inner_of(x))
    a, k = pytree.tree_unflatten(inner, spec)
    host_writes = [span(_inner_of(w)) for w in writes if isinstance(w, torch.Tensor) and (
        (is_device(w) and getattr(w, "_host", None) is not None) or
        (not is_device(w) and sim.is_pinned(w)))]
    label = f"kernel {name} queued at {_call_site()}"
    sim.enqueue(sim.current_stream(device), Op(label, lambda _: fn(*a, **k), reads,
                                               host_writes=host_writes))


# --------------------------------------------------------------------------------------------
# the function mode: what a CPU-only torch refuses before any dispatch


def _is_cuda(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, (str, torch.device)):
        try:
            return torch.device(device).type == "cuda"
        except RuntimeError:
            return False
    return False


_DATA_FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray}


def _factory(sim: Simulator, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    index = sim.device_index(kwargs["device"])
    kw = dict(kwargs)
    kw["device"] = "cpu"
    kw.pop("pin_memory", None)
    name = getattr(func, "__name__", "")
    if func in _DATA_FACTORIES:
        data = args[0] if args else kw.pop("data")
        if is_device(data):
            if func is torch.tensor:
                data = _to(data, "cpu")
            else:
                return _to(data, torch.device("cuda", index), kw.get("dtype"))
        host = func(data, *args[1:], **kw)
        dst = empty_device(sim, host.shape, host.dtype, index)
        aten.copy_.default(dst, host, False)  # host -> device, from pageable memory: blocks
        return dst
    if any(is_device(x) for x in pytree.tree_leaves((args, kwargs))):
        if name.endswith("_like"):
            args, kw = pytree.tree_map(_inner_of, (args, kw))
        else:
            args, kw = pytree.tree_map(lambda x: _to(x, "cpu") if is_device(x) else x,
                                       (args, kw))
    out = func(*args, **kw)
    if not isinstance(out, torch.Tensor):
        return out
    return _device_result(sim, out, index, empty=name.startswith("empty") or
                          name == "new_empty")


def _device_result(sim: Simulator, values: torch.Tensor, index: int,
                   empty: bool) -> SimTensor:
    """A factory's result on simulated device ``index``. Only ``empty`` is free: the values
    of ``zeros``/``arange``/``randn``... are written by a kernel on the current stream
    (captured in a graph, ordered against other streams), so until it runs they are poison."""
    if empty:
        if sim.mode != "eager":
            poison_(values)
        return SimTensor(values, torch.device("cuda", index))
    inner = torch.empty_strided(values.shape, values.stride(), dtype=values.dtype)
    if sim.mode != "eager":
        poison_(inner)
    sim.enqueue(sim.current_stream(index), Op("fill (factory kernel)",
                                              lambda _: inner.copy_(values)))
    return SimTensor(inner, torch.device("cuda", index))


def _pinned_factory(sim: Simulator, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    kw = dict(kwargs)
    kw.pop("pin_memory")
    out = func(*args, **kw)
    if not isinstance(out, torch.Tensor) or out.device.type != "cpu":
        return out
    pinned = sim.pinned_empty(tuple(out.shape), out.dtype)
    pinned.copy_(out)
    return pinned


class SimFunctionMode(TorchFunctionMode):
    """Makes ``device="cuda"`` factories, pinning and ``.to("cuda")`` work (see module doc)."""

    def __init__(self, sim: Simulator) -> None:
        super().__init__()
        self.sim = sim

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        from . import current

        sim = current()  # whichever simulator is open now (a pooled thread outlives one)
        if sim is None:
            return func(*args, **kwargs)
        handler = _MODE.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            return _factory(sim, func, args, kwargs)
        if kwargs.get("pin_memory"):
            return _pinned_factory(sim, func, args, kwargs)
        return func(*args, **kwargs)


class SimDispatchMode(TorchDispatchMode):
    """Allocations that torch's C++ code makes on a simulated tensor's device (a scalar
    wrapped on ``self.device()``, a composite op's temporary) reach the dispatcher with
    ``device=cuda`` and no tensor to dispatch on: they are made here, in host memory."""

    def __init__(self, sim: Simulator) -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        from . import current

        sim = current()
        if device is not None and sim is not None and _is_cuda(device) and \
                not any(is_device(x) for x in args):
            index = sim.device_index(device)
            kw = dict(kwargs)
            kw["device"] = torch.device("cpu")
            kw.pop("pin_memory", None)
            out = func(*args, **kw)
            if isinstance(out, torch.Tensor):
                return _device_result(sim, out, index,
                                      empty=func.overloadpacket in _EMPTY_OPS)
            return out
        return func(*args, **kwargs)


_EMPTY_OPS = {aten.empty, aten.empty_strided, aten.new_empty, aten.new_empty_strided,
              aten.empty_like}


def _mode_copy_(self: torch.Tensor, src: Any, non_blocking: bool = False) -> torch.Tensor:
    if is_device(self) or is_device(src):
        return _copy_(self, src, non_blocking)
    with torch._C.DisableTorchFunction():
        return self.copy_(src, non_blocking)


_MODE: dict[Any, Callable[..., Any]] = {
    _T.to: _to, _T.cuda: _cuda, _T.cpu: _cpu, _T.pin_memory: _pin_memory,
    _T.is_pinned: _is_pinned, _T.copy_: _mode_copy_,
}


# --------------------------------------------------------------------------------------------
# threads started while the simulator is open see it too

_spread_lock = threading.Lock()


def spread_to_new_threads(sim: Simulator) -> None:
    """Threads started from now on enter the function mode before they run."""

    previous = threading.getprofile() if hasattr(threading, "getprofile") else None

    def hook(frame: Any, event: str, arg: Any) -> Any:
        sys.setprofile(previous)  # the user's own profile hook, if any, takes over
        if not sim.closed:
            enter_modes(sim)
        return previous(frame, event, arg) if previous is not None else None  # type: ignore[arg-type]

    with _spread_lock:
        _saved_profile[:] = [previous]
        threading.setprofile(hook)


_saved_profile: list[Any] = [None]


def enter_modes(sim: Simulator) -> Callable[[], None]:
    """Enter the simulator's function and dispatch modes on this thread; returns the exit."""
    fmode, dmode = SimFunctionMode(sim), SimDispatchMode(sim)
    fmode.__enter__()
    dmode.__enter__()

    def leave() -> None:
        dmode.__exit__(None, None, None)
        fmode.__exit__(None, None, None)

    return leave


def stop_spreading() -> None:
    with _spread_lock:
        threading.setprofile(_saved_profile[0])
