"""Simulated CUDA tensors: a wrapper subclass that reports ``cuda:i`` and keeps its data in
host memory, the Python-level methods a CPU-only build of torch would refuse, and the modes
that catch ``device="cuda"`` before any dispatch.

* :class:`SimTensor` - the device tensor. Its ``__torch_dispatch__`` looks the aten op up in
  :data:`OPS` (handlers registered per op by ``_ops``, as PyTorch's ``fake_impls`` does) and
  otherwise runs the registered defaults for views and for every other op.
* :class:`Proxy` - the same tensor reporting ``cpu``, used only to run the few Python
  bindings that install a CUDA device guard (``__getitem__``, ``__setitem__``,
  ``contiguous``...), which a CPU-only build of torch cannot do.
* :class:`SimFunctionMode` - catches what never reaches the dispatcher on a CPU build:
  factories with ``device="cuda"``, ``pin_memory=True``, ``Tensor.pin_memory()``,
  ``is_pinned()``, ``.to("cuda")`` / ``.cuda()``; :class:`SimDispatchMode` - allocations
  torch's C++ code makes on a simulated device.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import os
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ._core import SimState, active, current
from ._races import entry as _race_entry
from ._races import host_written, schema_writes
from ._sched import _NO_DISPATCH, Op, in_kernel

__all__ = ["SimDispatchMode", "SimFunctionMode", "SimTensor", "OPS", "register_op",
           "register_default", "enter_modes", "spread_to_new_threads", "stop_spreading",
           "is_device", "wrap", "inner_of", "empty_device", "to", "devices_of", "Proxy",
           "from_proxy", "map_args", "map_out", "like_strides", "wrap_fresh", "keep_lane",
           "forget_lanes", "layout_id", "like_inference", "INFERENCE_MADE"]

aten = torch.ops.aten
_T = torch.Tensor
Handler = Callable[[SimState, Any, Any, "dict[str, Any]"], Any]

# aten overload packet -> handler(sim, func, args, kwargs); filled by ``_ops`` (through
# register_op: it also forgets the handlers looked up so far)
OPS: dict[Any, Handler] = {}
_DEFAULTS: dict[str, Handler] = {}
# factory function -> handler(sim, func, args, kwargs, device index) for ``device="cuda"``
# factories that need their own kernel (the random ones: ``_rng``)
FACTORIES: dict[Any, Callable[..., Any]] = {}


# id(OpOverload) -> (it, its handler), filled as ops are first seen (hashing an OpOverload
# calls a Python __hash__; torch makes each one once, and the entry holds it)
_HANDLERS: dict[int, tuple[Any, Handler]] = {}


def register_op(*packets: Any) -> Callable[[Handler], Handler]:
    """Register a handler for the aten ops ``packets`` (overload packets)."""
    def deco(fn: Handler) -> Handler:
        for p in packets:
            OPS[p] = fn
        _HANDLERS.clear()
        forget_lanes()
        return fn
    return deco


def register_default(kind: str) -> Callable[[Handler], Handler]:
    """Register the handler of every ``"view"`` op or every other (``"op"``) without its own."""
    def deco(fn: Handler) -> Handler:
        _DEFAULTS[kind] = fn
        _HANDLERS.clear()
        forget_lanes()
        return fn
    return deco


def _handler(func: Any) -> Handler:
    handler = OPS.get(func.overloadpacket)
    if handler is None:
        handler = _DEFAULTS["view" if func.is_view else "op"]
    _HANDLERS[id(func)] = (func, handler)
    return handler


def _active() -> SimState:
    return active()


# --------------------------------------------------------------------------------------------
# the tensor types


_CPU = torch.device("cpu")
_STRIDED = torch.strided
_make_wrapper = torch.Tensor._make_wrapper_subclass


class _Probe(torch.Tensor):
    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:
        return NotImplemented

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]


def _positional() -> bool:
    """Whether this torch's ``_make_wrapper_subclass`` takes (cls, size, strides,
    storage_offset, memory_format, dtype, layout, device) by position, as its stub says:
    its argument parser is cheaper so (keywords, else)."""
    try:
        r = _make_wrapper(_Probe, (2, 3), (1, 2), 1, None, torch.float16, _STRIDED,
                          torch.device("meta"))
        return bool(r.dtype is torch.float16 and r.shape == (2, 3) and r.stride() == (1, 2)
                    and r.storage_offset() == 1 and r.device.type == "meta")
    except Exception:  # noqa: BLE001 - (another signature)
        return False


_POSITIONAL = _positional()
if _POSITIONAL:
    def _make(cls: Any, size: Any, strides: Any, offset: Any, dtype: torch.dtype,
              layout: Any, device: torch.device) -> Any:
        if _inference():
            INFERENCE_MADE[0] = True
        return _make_wrapper(cls, size, strides, offset, None, dtype, layout, device)
else:
    def _make(cls: Any, size: Any, strides: Any, offset: Any, dtype: torch.dtype,
              layout: Any, device: torch.device) -> Any:
        if _inference():
            INFERENCE_MADE[0] = True
        return _make_wrapper(cls, size, strides=strides, storage_offset=offset, dtype=dtype,
                             layout=layout, device=device)


# whether a simulated tensor has been made in inference mode (an inference tensor) in this
# process: until one has, no lane checks whether the tensors it writes are
INFERENCE_MADE = [False]


def _wrapper(cls: Any, inner: torch.Tensor, device: torch.device, host: Any,
             reported: torch.device, block: Any = None) -> torch.Tensor:
    """A tensor of type ``cls`` with ``inner``'s layout, reporting ``reported`` as its device,
    whose data is ``inner`` on simulated ``device``."""
    r = _make(cls, inner.size(), inner.stride(), inner.storage_offset(), inner.dtype,
              inner.layout, reported)
    r._inner = inner
    r._host = host
    r._sim_device = device
    r._block = block  # the allocator's handle of its memory: freed when the last goes
    return r


def wrap_fresh(inner: torch.Tensor, shape: Any, stride: Any, dtype: torch.dtype,
               device: torch.device, block: Any) -> SimTensor:
    """``SimTensor(inner, device, None, block)`` of a fresh allocation (``inner`` of that
    layout, at its block's start), its metadata known (reading it is three calls into
    torch)."""
    if _POSITIONAL:  # (_make, one call fewer)
        if _inference():
            INFERENCE_MADE[0] = True
        r = _make_wrapper(SimTensor, shape, stride, 0, None, dtype, _STRIDED, device)
    else:
        r = _make(SimTensor, shape, stride, 0, dtype, _STRIDED, device)
    r._inner = inner  # (and _host None: the class's)
    r._sim_device = device
    r._block = block
    return r  # type: ignore[no-any-return]


class SimTensor(torch.Tensor):
    """A tensor on a simulated CUDA device; its data lives in ``_inner`` (a CPU tensor)."""

    _inner: torch.Tensor
    _host: Any = None  # the pinned host memory this aliases (a UVA view), else None
    _sim_device: torch.device
    _block: Any
    _proxy: Proxy  # this tensor seen as ``cpu``, once made (``_to_proxy``)
    # the number of its layout (layout_id): its part of the simulator's cache keys, found
    # once (and again after an in-place view op changes it: _ops._inplace_view)
    _lk: Any = None

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        """A copy on the same simulated device: a device-to-device copy queued on the
        current stream, as ``copy.deepcopy`` of a CUDA tensor does."""
        done = memo.get(id(self))
        if done is None:
            done = memo[id(self)] = self.clone(memory_format=torch.preserve_format)
        return done  # type: ignore[no-any-return]

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            f"a simulated CUDA tensor ({self._sim_device}) cannot be pickled or saved with "
            "torch.save: the simulator does not serialize device tensors; save t.cpu() and "
            "load it with map_location='cpu', then move it to the device")

    @staticmethod
    def __new__(cls, inner: torch.Tensor, device: torch.device, host: Any = None,
                block: Any = None) -> SimTensor:
        return _wrapper(cls, inner, device, host, reported=device,  # type: ignore[return-value]
                        block=block)

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


class Proxy(torch.Tensor):
    """A :class:`SimTensor` seen as ``cpu`` by torch's Python bindings (see module doc)."""

    _inner: torch.Tensor
    _host: Any
    _sim_device: torch.device

    _block: Any
    _lk: Any = None

    @staticmethod
    def __new__(cls, inner: torch.Tensor, device: torch.device, host: Any = None,
                block: Any = None) -> Proxy:
        return _wrapper(cls, inner, device, host, reported=_CPU,  # type: ignore[return-value]
                        block=block)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:
        return _torch_dispatch(func, args, kwargs or {})


_DEV = (SimTensor, Proxy)


def is_device(x: Any) -> bool:
    return isinstance(x, _DEV)


def wrap(inner: torch.Tensor, device: torch.device, host: Any = None,
         proxy: bool = False, block: Any = None) -> torch.Tensor:
    return (Proxy if proxy else SimTensor)(inner, device, host, block)


def _to_proxy(x: Any) -> Any:
    """``x`` seen as ``cpu`` (made once per tensor: the same memory and metadata)."""
    if not isinstance(x, SimTensor):
        return x
    p = x.__dict__.get("_proxy")
    if p is None:  # (it references nothing that references x: no cycle to collect)
        with like_inference(x):  # (an inference tensor's proxy is one: torch's checks see it)
            p = x._proxy = Proxy(x._inner, x._sim_device, x._host, x._block)
    return p


def _from_proxy(x: Any) -> Any:
    if not isinstance(x, Proxy):
        return x
    with like_inference(x):  # (a normal result stays one: a view of a normal tensor, say)
        return SimTensor(x._inner, x._sim_device, x._host, x._block)


def like_inference(t: torch.Tensor) -> Any:
    """Where wrappers of ``t``'s memory are made as inference tensors if and only if ``t``
    is one (a wrapper made in inference mode is one; torch's view of a normal tensor is
    normal there too, as outside it a view of an inference tensor is one)."""
    with torch._C.DisableTorchFunctionSubclass():
        inference = t.is_inference()
    if inference != torch.is_inference_mode_enabled():
        return torch.inference_mode(inference)
    return contextlib.nullcontext()


def empty_device(sim: SimState, shape: Any, dtype: torch.dtype, index: int,
                 stride: Any = None) -> SimTensor:
    """Fresh simulated device memory (the caching allocator's): garbage until written, as on
    a GPU."""
    inner, block = sim.device_empty(shape, stride, dtype, index)
    return SimTensor(inner, torch.device("cuda", index), None, block)


# --------------------------------------------------------------------------------------------
# __torch_function__: the Python-level methods that must not reach a CUDA device guard


def _torch_function(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    handler = _TF.get(func)
    if handler is not None:
        if current() is None:  # its simulator closed: its memory stays readable on the host
            return _after_close(func, args, kwargs)
        return handler(*args, **kwargs)
    if func not in _VIA_PROXY:
        try:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        except RuntimeError as exc:  # a binding that takes a CUDA device guard first
            if "not linked with support for cuda" not in str(exc):
                raise
            _VIA_PROXY.add(func)
    orig = args
    args, kwargs = map_args(_to_proxy, args, kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        # (an in-place method bumps its proxy's version counter: the tensor's is bumped as
        # many times, after)
        seen = [(a, p, p._version) for a, p in zip(orig, args)
                if type(p) is Proxy and a is not p and not p.is_inference()]
        out = func(*args, **kwargs)
        bumps = [(a, p._version - v) for a, p, v in seen]
    for a, n in bumps:
        for _ in range(n):
            _bump_version([a])
    if isinstance(out, Proxy):  # an in-place method returns its tensor itself
        for a, p in zip(orig, args):
            if p is out and a is not p:
                return a
    return map_out(_from_proxy, out)


_SEQ = (list, tuple, torch.Size)


def map_args(fn: Callable[[Any], Any], args: Any, kwargs: dict[str, Any]
             ) -> tuple[Any, dict[str, Any]]:
    """``pytree.tree_map(fn, (args, kwargs))`` for what torch's functions take (leaves, and
    lists/tuples of leaves), without pytree's cost; anything nested deeper goes to pytree."""
    out = []
    for a in args:
        if type(a) in _SEQ:
            if any(isinstance(y, (list, tuple, dict)) for y in a):
                return pytree.tree_map(fn, (args, kwargs))  # type: ignore[no-any-return]
            out.append(type(a)(fn(y) for y in a))
        elif isinstance(a, (list, tuple, dict)):
            return pytree.tree_map(fn, (args, kwargs))  # type: ignore[no-any-return]
        else:
            out.append(fn(a))
    if not kwargs:
        return tuple(out), {}
    kw = {}
    for k, a in kwargs.items():
        if type(a) in _SEQ:
            if any(isinstance(y, (list, tuple, dict)) for y in a):
                return pytree.tree_map(fn, (args, kwargs))  # type: ignore[no-any-return]
            kw[k] = type(a)(fn(y) for y in a)
        elif isinstance(a, (list, tuple, dict)):
            return pytree.tree_map(fn, (args, kwargs))  # type: ignore[no-any-return]
        else:
            kw[k] = fn(a)
    return tuple(out), kw


def map_out(fn: Callable[[Any], Any], out: Any) -> Any:
    """``pytree.tree_map(fn, out)`` for an op's result: a tensor, or a list/tuple of them
    (``split``, ``unbind``), else pytree."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    if type(out) in _SEQ and all(isinstance(o, torch.Tensor) for o in out):
        return type(out)(fn(o) for o in out)
    return pytree.tree_map(fn, out)


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
    args = (self, src, non_blocking)
    if not _nothing_between():
        aten.copy_.default(*args)  # (see _direct_function)
        return self
    # (keyed as the binding's call: z.copy_(y) finds its lane in the function mode)
    lane_key = _lane_key(_T.copy_, args if non_blocking is not False else args[:2])
    lane: Any = _LANES.get(lane_key) if lane_key is not None else False
    if lane and lane(args) is not NO_LANE:
        return self
    if _learning_lane(lane, lane_key, aten.copy_.default, None, args, {}, _COPY_WRITES) \
            is _THROUGH_TORCH:
        aten.copy_.default(*args)
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
    sim = current()
    return sim is not None and self.device.type == "cpu" and sim.is_pinned(self)


def _data_ptr(self: Any) -> int:
    return int(self._inner.data_ptr() if is_device(self) else _T.data_ptr(self))


def _record_stream(self: torch.Tensor, stream: Any) -> None:
    """The allocator holds this memory, once freed, until ``stream``'s work so far is done."""
    block = getattr(self, "_block", None)
    if block is not None:
        block.record(stream)


def _type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False,
          **kwargs: Any) -> Any:
    if dtype is None:
        name = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half",
                torch.bfloat16: "BFloat16", torch.int64: "Long", torch.int32: "Int",
                torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
                torch.bool: "Bool"}.get(self.dtype, "")
        return f"torch.cuda.{name}Tensor"
    target = _legacy_target(dtype)
    if target is not None:  # a legacy type: its device and dtype ('torch.DoubleTensor': CPU)
        cuda, dt = target
        device = self.device if cuda else _CPU
        return _to(self, device, dt, non_blocking=bool(non_blocking))
    with torch._C.DisableTorchFunctionSubclass():
        return _from_proxy(_T.type(_to_proxy(self), dtype, non_blocking, **kwargs))


_LEGACY_DTYPES = {"Float": torch.float32, "Double": torch.float64, "Half": torch.float16,
                  "BFloat16": torch.bfloat16, "Long": torch.int64, "Int": torch.int32,
                  "Short": torch.int16, "Char": torch.int8, "Byte": torch.uint8,
                  "Bool": torch.bool}


def _legacy_target(t: Any) -> tuple[bool, torch.dtype] | None:
    """(on CUDA?, dtype) of a legacy tensor type, by name (``'torch.cuda.FloatTensor'``) or
    as a type (``torch.cuda.FloatTensor``, ``torch.DoubleTensor``); ``None`` otherwise."""
    if isinstance(t, str):
        cuda = t.startswith("torch.cuda.")
        name = t[len("torch.cuda."):] if cuda else t[len("torch."):] \
            if t.startswith("torch.") else ""
        dt = _LEGACY_DTYPES.get(name[:-len("Tensor")]) if name.endswith("Tensor") else None
        return None if dt is None else (cuda, dt)
    of_type, on_cuda = getattr(t, "dtype", None), getattr(t, "is_cuda", None)
    if isinstance(t, type) and isinstance(of_type, torch.dtype) and isinstance(on_cuda, bool):
        return on_cuda, of_type
    return None


def _mode_type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False,
               **kwargs: Any) -> Any:
    """``Tensor.type`` of a host tensor: a CUDA legacy type moves it to the device."""
    target = _legacy_target(dtype) if dtype is not None else None
    if target is not None and target[0]:
        return _to(self, torch.device("cuda"), target[1], non_blocking=bool(non_blocking))
    with torch._C.DisableTorchFunction():
        if dtype is None:
            return _T.type(self)
        return _T.type(self, dtype, non_blocking, **kwargs)


def _new_tensor(self: torch.Tensor, data: Any, dtype: Any = None, device: Any = None,
                requires_grad: bool = False, **kwargs: Any) -> torch.Tensor:
    device = device if device is not None else self.device
    dtype = dtype or self.dtype
    if _is_cuda(device):
        return _factory(_active(), torch.tensor, (data,), {"dtype": dtype, "device": device})
    return torch.tensor(data, dtype=dtype, device=device)


def _new(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The legacy ``Tensor.new``: sizes give uninitialized memory, a tensor is returned as
    it is, other data is copied; on ``self``'s device and dtype (it returned a CPU tensor)."""
    if not is_device(self):
        with torch._C.DisableTorchFunction():
            return _T.new(self, *args, **kwargs)  # type: ignore[no-any-return]
    dtype = kwargs.pop("dtype", None) or self.dtype
    device = kwargs.pop("device", None) or self.device
    if kwargs:
        raise TypeError(f"new() got unexpected keyword arguments {sorted(kwargs)}")
    sizes: Any = args[0] if len(args) == 1 and isinstance(args[0], torch.Size) else \
        (args or (0,))  # (no arguments: an empty tensor)
    if all(isinstance(n, int) and not isinstance(n, bool) for n in sizes):
        return _factory(_active(), torch.empty, (tuple(sizes),),
                        {"dtype": dtype, "device": device})
    if len(args) == 1 and isinstance(args[0], torch.Tensor):
        return args[0]
    return _new_tensor(self, args[0] if len(args) == 1 else list(args), dtype, device)


def _to(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``Tensor.to`` for host tensors going to a simulated device and for device tensors."""
    if is_device(self) and current() is None:
        return _after_close(_T.to, (self, *args), kwargs)
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
            raise _no_autograd()
        if device is None or device.type != "cuda":
            with torch._C.DisableTorchFunction():
                return _T.to(self, *args, copy=copy, **kwargs)  # type: ignore[call-overload]
        index = sim.sched.device_index(device)
        stride = like_strides(self) if memory_format in (None, torch.preserve_format) \
            else None
        dst = empty_device(sim, self.shape, dtype, index, stride)
        aten.copy_.default(dst, self, bool(non_blocking))  # host -> device
        return dst
    here = self._sim_device
    if device is None or (device.type == "cuda" and sim.sched.device_index(device) == here.index):
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
    if device.type == "cuda":  # device -> device: the copy keeps the layout (preserve_format)
        stride = like_strides(self._inner) if memory_format in (None, torch.preserve_format) \
            else None
        dst = empty_device(sim, self.shape, dtype, sim.sched.device_index(device), stride)
        aten.copy_.default(dst, self, bool(non_blocking))
        return dst
    raise RuntimeError(f"cannot move a simulated {here} tensor to {device}")


def _cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False,
          **kwargs: Any) -> Any:
    sim = _active()
    if device is not None and not isinstance(device, int) and \
            torch.device(device).type != "cuda":
        raise RuntimeError("Invalid device, must be cuda device")  # (torch's words)
    index = sim.sched.device_index(device)
    return _to(self, torch.device("cuda", index), non_blocking=non_blocking)


def _cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    if not is_device(self):
        with torch._C.DisableTorchFunction():
            return _T.cpu(self, *args, **kwargs)
    return _to(self, "cpu")


def like_strides(t: torch.Tensor) -> tuple[int, ...] | None:
    """The strides ``empty_like(t)`` (preserve_format) gives, or None when contiguous."""
    if t.is_contiguous():
        return None
    return tuple(torch.empty_like(torch.empty_strided(t.shape, t.stride(), device="meta"))
                 .stride())


def _no_autograd() -> NotImplementedError:
    return NotImplementedError(
        "the simulated CUDA does not support autograd: tensors that require grad "
        "(nn.Module parameters, requires_grad=True) cannot live on a simulated device; run "
        "the model under torch.no_grad() on CPU tensors, or test it on a real GPU")


def _requires_grad_(self: torch.Tensor, requires_grad: bool = True) -> torch.Tensor:
    if requires_grad:
        raise _no_autograd()  # (never dropped silently)
    return self


def _set_data(self: torch.Tensor, value: Any) -> None:
    """``x.data = y``: ``x`` takes ``y``'s memory, shape, strides and dtype (torch's
    ``set_data``; its version counter and autograd state stay its own). Between a simulated
    tensor and one elsewhere it is refused (torch would move ``x`` off the device)."""
    if not (type(self) is SimTensor and type(value) is SimTensor):
        if is_device(self) or is_device(value):
            raise NotImplementedError(
                f"x.data = y with x a {_kind(self)} and y a {_kind(value)}: the simulated CUDA "
                "supports it between two simulated cuda tensors only; copy the values "
                "(x.copy_(y)) or rebind the name instead")
        with torch._C.DisableTorchFunctionSubclass():
            _DATA.__set__(self, value)
        return
    with torch._C.DisableTorchFunctionSubclass():
        _DATA.__set__(self, value)  # (the wrapper's metadata, and torch's own checks)
    self._inner = value._inner
    self._host = value._host
    self._sim_device = value._sim_device
    self._block = value._block
    self._lk = None  # (its layout number, worked out again)
    self.__dict__.pop("_proxy", None)  # (its cpu view, of the old memory)


def _kind(t: Any) -> str:
    if type(t) is SimTensor:
        return "simulated cuda tensor"
    if is_device(t):
        return "simulated cuda tensor seen as cpu"
    return f"{t.device.type} tensor" if isinstance(t, torch.Tensor) else type(t).__name__


_DATA: Any = _T.data  # (the descriptor: its __set__ is what x.data = y calls)

_TF: dict[Any, Callable[..., Any]] = {
    _T.item: _item, _T.__bool__: _bool, _T.__int__: _scalar(int),
    _T.__float__: _scalar(float), _T.__index__: _scalar(int), _T.__complex__: _scalar(complex),
    _T.tolist: _tolist, _T.numpy: _numpy, _T.__array__: _numpy, _T.__repr__: _repr,
    _T.__str__: _repr, _T.__format__: _format, _T.copy_: _copy_, _T.pin_memory: _pin_memory,
    _T.is_pinned: _is_pinned, _T.data_ptr: _data_ptr, _T.record_stream: _record_stream,
    _T.to: _to, _T.cuda: _cuda, _T.cpu: _cpu, _T.type: _type, _T.new_tensor: _new_tensor,
    _T.requires_grad_: _requires_grad_, _T.new: _new, _DATA.__set__: _set_data,
}
_VIA_PROXY = {
    _T.__getitem__, _T.__setitem__, _T.contiguous, _T.float, _T.double, _T.half,
    _T.bfloat16, _T.int, _T.long, _T.short, _T.char, _T.byte, _T.bool,
    getattr(_T, "cfloat", _T.float), getattr(_T, "cdouble", _T.double), _T.index_put_,
    _T.index_put, _T.masked_fill_, _T.put_, _T.index_fill_,
    _T.nonzero, _T.new_zeros, _T.new_ones, _T.new_empty, _T.new_full, _T.__len__,
    _T.element_size, _T.apply_, _T.map_, _T.set_,
}


# --------------------------------------------------------------------------------------------
# __torch_dispatch__: what each aten op means on the simulated device


def _after_close(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """A device tensor used after its simulator closed (everything queued has run): the op
    runs on the host, over the memory's final values, and gives host tensors (a result
    that would be the memory itself is a copy, as ``.cpu()`` of a device tensor is)."""
    inners = [x._inner for x in pytree.tree_leaves((args, kwargs)) if is_device(x)]
    a, k = pytree.tree_map(inner_of, (args, kwargs))
    with torch._C.DisableTorchFunction():
        out = func(*a, **k)
        return pytree.tree_map_only(
            torch.Tensor, lambda t: t.clone() if any(t is i for i in inners) else t, out)


def _torch_dispatch(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    sim = current()
    if sim is None:
        return _after_close(func, args, kwargs)
    with sim.sched.lock:
        known = _HANDLERS.get(id(func))
        handler = known[1] if known is not None else _handler(func)
        learn = _race_entry.learn
        if learn is None:
            return handler(sim, func, args, kwargs)
        seen = [func, args, kwargs, None]  # (see _direct_function: its result next)
        learn.append(seen)
        seen[3] = handler(sim, func, args, kwargs)
        return seen[3]


def devices_of(flat: list[Any], allow_cpu: bool) -> tuple[torch.device, bool]:
    device: torch.device | None = None
    proxy = False
    for x in flat:
        if is_device(x):
            proxy = proxy or isinstance(x, Proxy)
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


def inner_of(x: Any) -> Any:
    return x._inner if is_device(x) else x


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


def _factory(sim: SimState, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    index = sim.sched.device_index(kwargs["device"])
    kw = dict(kwargs)
    kw["device"] = "cpu"
    kw.pop("pin_memory", None)
    if kw.pop("requires_grad", False):
        raise _no_autograd()  # (never dropped silently)
    special = FACTORIES.get(func)
    if special is not None:
        return special(sim, func, args, kw, index)
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
    leaves = pytree.tree_leaves((args, kwargs))
    if any(is_device(x) for x in leaves):
        if name.endswith("_like"):
            args, kw = pytree.tree_map(inner_of, (args, kw))
        else:
            args, kw = pytree.tree_map(lambda x: _to(x, "cpu") if is_device(x) else x,
                                       (args, kw))
    memory = _device_memory_first(sim, func, args, kw, index, leaves)
    out = func(*args, **kw)
    if not isinstance(out, torch.Tensor):
        return out
    return _device_result(sim, out, index, empty=name.startswith("empty") or
                          name == "new_empty", memory=memory)


def _device_memory_first(sim: SimState, func: Any, args: Any, kw: dict[str, Any],
                         index: int, leaves: list[Any]) -> tuple[torch.Tensor, Any] | None:
    """The device memory of a factory's result, taken before its values are made on the
    host: a request larger than the device fails with CUDA's out-of-memory error (not the
    host allocator's, or a host that runs out first). Only for results over a MiB (shapes
    from the meta device cost a few microseconds)."""
    n = 1
    for a in leaves:  # (the call's arguments, flattened once by the caller)
        if type(a) is int and a > 1:
            n *= a
    if n < 2**18:
        return None  # (a small result, or a shape given otherwise: allocated after)
    try:
        meta = func(*args, **dict(kw, device="meta"))
    except Exception:  # noqa: BLE001 - (no meta kernel: allocated after, as before)
        return None
    if not isinstance(meta, torch.Tensor):
        return None
    return sim.device_empty(meta.shape, meta.stride(), meta.dtype, index)  # type: ignore[no-any-return]


def _device_result(sim: SimState, values: torch.Tensor, index: int, empty: bool,
                   memory: tuple[torch.Tensor, Any] | None = None) -> SimTensor:
    """A factory's result on simulated device ``index``. Only ``empty`` is free: the values
    of ``zeros``/``arange``/``randn``... are written by a kernel on the current stream
    (captured in a graph, ordered against other streams), so until it runs they are poison."""
    if memory is not None and memory[0].shape == values.shape and \
            memory[0].dtype == values.dtype and memory[0].stride() == values.stride():
        inner, block = memory
    else:
        inner, block = sim.device_empty(values.shape, values.stride(), values.dtype, index)
    if empty:
        return SimTensor(inner, torch.device("cuda", index), None, block)
    sim.sched.enqueue(sim.sched.current_stream(index), Op(
        "fill (factory kernel)", lambda _: inner.copy_(values),
        acc=("fill (factory kernel)", (), (inner,)), plain=True))
    return SimTensor(inner, torch.device("cuda", index), None, block)


def _pinned_factory(sim: SimState, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
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

    def __init__(self, sim: SimState) -> None:
        super().__init__()
        self.sim = sim

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        frame = sys._getframe(1)  # (the race checker names the user's line from here)
        if func in _LANE_FUNCS and not kwargs and types == _SIM_TYPES:  # (seen: a lane)
            lane = _LANES.get(_lane_key(func, args))
            if lane and not _len_tf() and _len_td() == 1 and not _autocast() and \
                    not _functorch() and not _inference():  # (_nothing_between())
                out = lane(args, frame)
                if out is not NO_LANE:
                    return out
        e = _race_entry
        prev = e.frame
        e.frame = frame
        try:
            return self._function(func, types, args, kwargs or {})
        finally:
            e.frame = prev

    def _function(self, func: Any, types: Any, args: Any, kwargs: dict[str, Any]) -> Any:
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
        if types and all(t is SimTensor for t in types):
            # what ``func(...)`` would do next, without going back through torch to find
            # SimTensor.__torch_function__ (most of the cost of a small simulated op is such
            # round trips)
            if type(func) in _BINDINGS and func not in _TF:
                basic = _BASIC_INDEXING.get(func)
                if basic is not None and not kwargs and len(args) >= 2 and \
                        type(args[0]) is SimTensor and _nothing_between():
                    idx = _basic_index(args[1])
                    if idx is not _NOT_BASIC:
                        return basic(args[0], idx, *args[2:])
                    idx = args[1]
                    if func is _T.__getitem__ and type(idx) is SimTensor and idx.dim() and \
                            idx.dtype in _INDEX_DTYPES:  # t[indices]: what the binding runs
                        return _getitem_indices(args[0], idx)
                return _direct_function(func, args, kwargs)
            return _torch_function(func, args, kwargs)
        if sim.sched.races.watch and all(t is torch.Tensor for t in types) and \
                _users_host_call():
            return _host_op(sim, func, args, kwargs)
        return func(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# the direct path: a torch binding that is one aten op on the same arguments

# torch's C bindings (Tensor methods, torch.* functions, slots such as __add__): what they do
# on a simulated tensor is parse the arguments, run the dispatcher down to the Python key and
# come back up into the simulator (most of a small op's cost)
_BINDINGS = (types.MethodDescriptorType, types.BuiltinFunctionType,
             types.WrapperDescriptorType)
# (binding, argument types, keyword names and types) -> (aten overload, the positions and
# names of the arguments it writes), or None: not one aten op on the same arguments
_DIRECT: dict[Any, Any] = {}
_len_tf = torch._C._len_torch_function_stack
_len_td = torch._C._len_torch_dispatch_stack
_pop_td = torch._C._pop_torch_dispatch_stack
_push_td = torch._C._push_on_torch_dispatch_stack
_autocast = torch._C._is_any_autocast_enabled
_functorch = torch._C._are_functorch_transforms_active
_bump_version = torch._C._increment_version
_inference = torch.is_inference_mode_enabled
_NO_SUBCLASS_TF = torch._C.DisableTorchFunctionSubclass


def _direct_function(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """``func(*args, **kwargs)`` of a torch binding on simulated tensors. The first call of a
    kind (the binding, its arguments' types, its keywords) goes through torch and is watched:
    if torch's dispatcher reached the simulator with exactly one aten op, over the same
    argument objects, and gave back its result unchanged, later calls of that kind go to
    that op's handler directly, as the dispatcher would (the version counters of what it
    writes bumped, as torch's ADInplaceOrView kernel does). Only while nothing else could
    have come between: no other function or dispatch mode, no autocast, no functorch
    transform (each could change what the dispatcher does)."""
    lane_key = None if kwargs else _lane_key(func, args)
    lane: Any = _LANES.get(lane_key) if lane_key is not None else False
    if lane and _nothing_between():
        out = lane(args)
        if out is not NO_LANE:
            return out
    key = (func, tuple(map(type, args)), tuple(kwargs), tuple(map(type, kwargs.values()))) \
        if kwargs else (func, tuple(map(type, args)))
    known = _DIRECT.get(key, _UNSEEN)
    if known is None or not _nothing_between():
        return _torch_function(func, args, kwargs)
    if known is _UNSEEN:
        return _learn(key, func, args, kwargs)
    op, written = known
    out = _learning_lane(lane, lane_key, op, func, args, kwargs, written)
    return _torch_function(func, args, kwargs) if out is _THROUGH_TORCH else out


def _learning_lane(lane: Any, lane_key: Any, op: Any, host_call: Any, args: Any,
                   kwargs: dict[str, Any], written: Any, flat_call: Any = None) -> Any:
    """:func:`_run_direct`; if this kind of call has not been tried for a lane yet
    (``lane`` None), its handler may make one (``_ops._Lane``; its kernel ``flat_call`` of
    the flattened arguments, if not the binding), else none is made."""
    if lane is not None:
        return _run_direct(op, host_call, args, kwargs, written)
    e = _race_entry
    prev = e.lane
    e.lane = (lane_key, args, kwargs, flat_call)
    try:
        return _run_direct(op, host_call, args, kwargs, written)
    finally:
        e.lane = prev
        if lane_key not in _LANES:
            keep_lane(lane_key, False)


# (a torch binding, each argument's shape, stride and dtype or number, the device) ->
# _ops._Lane: that call's work on the direct path, known (False: none can be made; cleared
# with the handlers)
_LANES: dict[Any, Any] = {}
_LANE_FUNCS: set[Any] = set()  # the bindings with a lane
_SIM_TYPES = (SimTensor,)
NO_LANE = object()


def keep_lane(key: Any, lane: Any) -> None:
    """``_LANES[key] = lane`` (``False``: this kind of call has none)."""
    if len(_LANES) > 4096:
        forget_lanes()
    _LANES[key] = lane
    if lane:
        _LANE_FUNCS.add(key[0])


def forget_lanes() -> None:
    _LANES.clear()
    _LANE_FUNCS.clear()  # a _Lane's answer where the general path must run
_LANE_NUMBERS = (int, float, bool)


# (shape, stride, dtype) -> its number: a simulated tensor's layout in the keys of the
# simulator's caches is this number (_lk), cheaper to hash than the layout itself
_LAYOUT_IDS: dict[tuple[Any, Any, torch.dtype], int] = {}
_NEXT_LAYOUT = itertools.count(1)


def layout_id(inner: torch.Tensor) -> int:
    """The number of ``inner``'s layout (a simulated tensor's: its host tensor's, read
    without the wrapper's __torch_function__); numbers are never reused."""
    key = (inner.shape, inner.stride(), inner.dtype)
    known = _LAYOUT_IDS.get(key)
    if known is None:
        if len(_LAYOUT_IDS) > 65536:
            _LAYOUT_IDS.clear()
        known = _LAYOUT_IDS[key] = next(_NEXT_LAYOUT)
    return known


def _lane_key(func: Any, args: Any) -> Any:
    """The key of a direct call in :data:`_LANES`: positional simulated tensors (not UVA
    views) on one device and numbers only, else ``None``."""
    if len(args) == 2:  # (the common call, a binary op or a method of one argument: in fewer
        a, b = args  # steps, the same key)
        if type(a) is SimTensor and a._host is None:
            lk = a._lk
            if lk is None:
                lk = a._lk = layout_id(a._inner)
            dev = a._sim_device
            t = type(b)
            if t is SimTensor:
                if b._host is not None:
                    return None
                d = b._sim_device
                if d is not dev and d != dev:
                    return None
                lb = b._lk
                if lb is None:
                    lb = b._lk = layout_id(b._inner)
                return (func, lk, lb, dev)
            if t in _LANE_NUMBERS:
                return (func, lk, (t, b), dev)
            return None
    parts = [func]
    device = None
    for a in args:
        t = type(a)
        if t is SimTensor:
            if a._host is not None:
                return None
            lk = a._lk
            if lk is None:
                lk = a._lk = layout_id(a._inner)
            d = a._sim_device
            if device is None:
                device = d
            elif d != device:
                return None
            parts.append(lk)
        elif t in _LANE_NUMBERS:
            parts.append((t, a))
        else:
            return None
    parts.append(device)
    return tuple(parts)


_UNSEEN = object()
_THROUGH_TORCH = object()
_COPY_WRITES = schema_writes(aten.copy_.default)


def _run_direct(op: Any, host_call: Any, args: Any, kwargs: dict[str, Any],
                written: Any) -> Any:
    """aten ``op`` on simulated tensors as the dispatcher runs it (:func:`_dispatch_direct`),
    the version counters of the arguments ``written`` names (schema_writes) bumped after,
    as torch's ADInplaceOrView kernel does; ``_THROUGH_TORCH`` without running it if one of
    those is an inference tensor (outside inference mode: torch's error is torch's to
    raise)."""
    if not written:
        return _dispatch_direct(op, host_call, args, kwargs)
    bumped = [w for j, name in written if isinstance(
        w := kwargs[name] if name in kwargs else args[j] if j < len(args) else None,
        torch.Tensor)]
    for w in bumped:
        if w.is_inference():
            return _THROUGH_TORCH
    out = _dispatch_direct(op, host_call, args, kwargs)
    if bumped:
        _bump_version(bumped)
    return out


def _dispatch_direct(op: Any, host_call: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """:func:`_dispatch_now`, the op's kernel run as ``host_call`` (the torch binding that
    stands for it, if given) on the host tensors."""
    if host_call is None:
        return _dispatch_now(op, args, kwargs)
    e = _race_entry
    prev = e.direct
    e.direct = (op, host_call)
    try:
        return _dispatch_now(op, args, kwargs)
    finally:
        e.direct = prev


def _getitem_indices(x: Any, idx: Any) -> Any:
    """``x[idx]`` of a simulated tensor of integer indices: ``aten.index.Tensor(x, [idx])``
    on the direct path, its kernel ``x[idx]`` on the host tensors (in a lane, once known)."""
    flat = (x, idx)
    lane_key = _lane_key(_T.__getitem__, flat)
    lane: Any = _LANES.get(lane_key) if lane_key is not None else False
    if lane:
        out = lane(flat)
        if out is not NO_LANE:
            return out
    return _learning_lane(lane, lane_key, aten.index.Tensor, _host_index, (x, [idx]), {}, (),
                          _T.__getitem__)


def _host_index(x: torch.Tensor, indices: list[torch.Tensor]) -> torch.Tensor:
    """``aten.index.Tensor(x, [i])`` as ``x[i]`` (``i`` of integers): torch's binding."""
    return x[indices[0]]


def _dispatch_now(op: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """What torch's dispatcher does with aten ``op`` on simulated tensors, when nothing is
    between the simulator's modes: the simulator's handler, its dispatch mode off while it
    runs (as torch does while a dispatch mode's handler runs)."""
    mode = _pop_td(None)
    try:
        with _NO_SUBCLASS_TF():
            return _torch_dispatch(op, args, kwargs)
    finally:
        _push_td(mode)


def _nothing_between() -> bool:
    """Whether torch would go from the simulator's function mode straight to its dispatch
    mode: no other function or dispatch mode, no autocast, no functorch transform, no
    inference mode (its tensors keep no version counter)."""
    return not _len_tf() and _len_td() == 1 and not _autocast() and not _functorch() and \
        not _inference()


# basic indexing: ints, slices of ints, None and Ellipsis (a view, no device value read)
_INDEX_TYPES = (int, type(None), type(Ellipsis))


def _basic_index(idx: Any) -> Any:
    """``idx`` of ``__getitem__``/``__setitem__`` if it is basic indexing, else
    ``_NOT_BASIC``. A slice's bounds may be device tensors: they are read on the host
    (``__index__``: the host waits for the stream, as torch's binding does)."""
    for i in (idx if type(idx) is tuple else (idx,)):
        t = type(i)
        if t is slice:
            for b in (i.start, i.stop, i.step):
                if type(b) not in _INDEX_TYPES:
                    if type(b) is SimTensor and b.dim() == 0:
                        return _host_bounds(idx)
                    return _NOT_BASIC
        elif t not in _INDEX_TYPES:
            return _NOT_BASIC
    return idx


_NOT_BASIC = object()


def _host_bounds(idx: Any) -> Any:
    def bound(b: Any) -> Any:
        return b if type(b) in _INDEX_TYPES else operator.index(b)

    def one(i: Any) -> Any:
        return slice(bound(i.start), bound(i.stop), bound(i.step)) if type(i) is slice else i

    return tuple(one(i) for i in idx) if type(idx) is tuple else one(idx)


_INDEX_DTYPES = (torch.int64, torch.int32)


def _getitem(self: Any, idx: Any) -> Any:
    """``t[idx]`` by basic indexing: the same view of its memory, made on the host tensor
    (what torch's binding does through the views it dispatches, one wrapper each)."""
    with _NO_DISPATCH():  # (host tensors only: the simulator's dispatch mode need not see it)
        view = self._inner[idx]
    return SimTensor(view, self._sim_device, self._host, self._block)


_NUMBERS = (int, float, bool)


def _setitem(self: Any, idx: Any, value: Any) -> None:
    """``t[idx] = value`` by basic indexing (outside inference mode), of a number or a
    simulated tensor: a fill or a copy into that view, queued as torch's binding queues it,
    its checks in torch's order (the number's conversion, the indexing, the inference
    tensor, elements in one place). The view is made here, not by torch's view ops, so it
    keeps no version counter shared with ``t``: ``t``'s is bumped here, as torch's is."""
    number = type(value) in _NUMBERS
    if not number and type(value) is not SimTensor:
        _torch_function(_T.__setitem__, (self, idx, value), {})
        return
    dtype = self._inner.dtype
    fill = number and _in_range(value, dtype)  # (then fill_ of the number is the same)
    if number and not fill:
        # (torch's binding makes the number a CPU tensor of the target's dtype, as its
        # valueToTensor does: scalar_tensor, which refuses what overflows the dtype (float32,
        # integers) and makes inf of it for float16 and bfloat16; then at::indexing::copy_to:
        # fill_ from it, copy_ into a 0-dim view)
        if type(value) is int and not -2**63 <= value < 2**63:  # (torch's parser's)
            raise ValueError("Overflow when unpacking long long")
        with _NO_DISPATCH(), torch._C.DisableTorchFunction():
            value = torch.scalar_tensor(value, dtype=dtype)
    with _NO_DISPATCH():  # (host tensors only: the simulator's dispatch mode need not see it)
        target = self._inner[idx]
    with _NO_SUBCLASS_TF():  # (a SimTensor's method goes to its __torch_function__)
        inference = self.is_inference()
    if inference:
        raise RuntimeError(_INFERENCE_INPLACE)
    _no_overlap(target)
    if fill and _fill_basic(self, target, value):
        _bump_version([self])
        return
    view = SimTensor(target, self._sim_device, self._host, self._block)
    if fill or (number and target.dim()):
        _direct_function(_T.fill_, (view, value), {})
    else:
        _torch_function(_T.copy_, (view, value), {})
    _bump_version([self])


def _fill_basic(self: Any, view: torch.Tensor, value: Any) -> bool:
    """``self[idx] = value`` (basic indexing: ``view`` is ``self._inner[idx]``; a number
    ``fill_`` takes as torch's assignment does) queued as the fill_ of that view its lane
    would queue, without making the view a simulated tensor: ``False`` where that lane
    would not run (see ``_ops._Lane``)."""
    sim = current()
    if sim is None or self._host is not None or type(self) is not SimTensor:
        return False
    sched = sim.sched
    device = self._sim_device
    stream = sched.shortcut_stream(device.index or 0)
    if stream is None:
        return False
    label = _FILL_LABELS.get(device)
    if label is None:
        label = _FILL_LABELS[device] = f"fill_ on {device}"

    with sched.lock:
        sched.kernel(stream, label, view.fill_, (value,), None, "fill_", (view,), (view,))
    return True


_FILL_LABELS: dict[torch.device, str] = {}
_internal_overlap = torch._debug_has_internal_overlap  # (1: yes, 0: no, 2: too hard to tell)


def _no_overlap(view: torch.Tensor) -> None:
    """torch's check of an assignment's target (its copy_ into the view): no two of its
    elements in one place (an expanded tensor's)."""
    if _internal_overlap(view) == 1:
        raise RuntimeError(
            "unsupported operation: more than one element of the written-to tensor refers to "
            "a single memory location. Please clone() the tensor before performing the "
            "operation.")


_INFERENCE_INPLACE = (  # (torch's words)
    "Inplace update to inference tensor outside InferenceMode is not allowed.You can make a "
    "clone to get a normal tensor before doing inplace update.See "
    "https://github.com/pytorch/rfcs/pull/17 for more details.")


# dtype -> (lowest, highest, the Python number types) for which fill_ of a number does what
# torch's indexing assignment does (ints or floats into a floating dtype, ints into an
# integer one, in its range; anything else goes the binding's way)
_RANGES: dict[torch.dtype, tuple[Any, Any, tuple[type, ...]]] = {}


def _in_range(value: Any, dtype: torch.dtype) -> bool:
    known = _RANGES.get(dtype)
    if known is None:
        if dtype.is_floating_point:
            info = torch.finfo(dtype)
            known = (float(info.min), float(info.max), (int, float))
        elif not dtype.is_complex and dtype is not torch.bool:
            iinfo = torch.iinfo(dtype)
            known = (iinfo.min, iinfo.max, (int,))
        else:
            known = (0, 0, ())
        _RANGES[dtype] = known
    lo, hi, kinds = known
    return type(value) is bool or (type(value) in kinds and lo <= value <= hi and (
        type(value) is not int or -2**63 <= value < 2**63))  # (past int64: torch's parser's)


_BASIC_INDEXING: dict[Any, Callable[..., Any]] = {_T.__getitem__: _getitem,
                                                  _T.__setitem__: _setitem}


def _learn(key: Any, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """The first call of a kind, through torch, watched: see :func:`_direct_function`."""
    e = _race_entry
    prev = e.learn
    seen: list[list[Any]] = []
    e.learn = seen
    try:
        out = _torch_function(func, args, kwargs)
    finally:
        e.learn = prev
    direct = None
    if len(seen) == 1:
        op, a, k, res = seen[0]
        if isinstance(op, torch._ops.OpOverload) and len(a) == len(args) and \
                all(_same_arg(x, y) for x, y in zip(a, args)) and k.keys() == kwargs.keys() \
                and all(_same_arg(k[n], kwargs[n]) for n in k) and "device" not in k and (
                    out is res or (type(out) is type(res) and type(out) in (tuple, list) and
                                   len(out) == len(res) and
                                   all(x is y for x, y in zip(out, res)))) and \
                op.overloadpacket.__name__ == getattr(func, "__name__", None) and \
                not op.is_view:
            # (the binding's own op: another one was a decomposition, narrow -> slice, matmul
            # -> mm or dot, chosen by the arguments' values, shapes or dtypes, which the
            # learned key does not hold; not a view op: torch's ADInplaceOrView kernel makes
            # its result a view of its base, _base and version counter shared)
            direct = (op, schema_writes(op))
    if len(_DIRECT) > 4096:
        _DIRECT.clear()
    _DIRECT[key] = direct
    return out


def _same_arg(seen: Any, given: Any) -> bool:
    """Whether the dispatcher passed the binding's argument ``given`` on as ``seen``: the
    same object, or the same Python number (torch's argument parser makes a float a new
    object of the same value)."""
    return seen is given or (type(seen) is type(given) and type(seen) in _LANE_NUMBERS and (
        seen == given or (seen != seen and given != given)))


# the simulator's own files: their torch calls on host memory are its own, never the user's
_SIM_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _users_host_call() -> bool:
    """Whether the torch call being simulated now is the user's host code (not a kernel's
    body, not the simulator's own work)."""
    if in_kernel():
        return False
    frame = _race_entry.frame
    return frame is not None and not frame.f_code.co_filename.startswith(_SIM_DIR)


def _host_op(sim: SimState, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """A torch call of the user's on host tensors while pinned memory has device accesses
    the host has not waited for: the aten ops it runs are checked (SimDispatchMode)."""
    what = _READ_WITHOUT_DISPATCH.get(func)
    if what is not None and args and isinstance(args[0], torch.Tensor):
        sim.sched.races.host_access(what, (args[0],))
    e = _race_entry
    prev = e.host_op
    e.host_op = True
    try:
        return func(*args, **kwargs)
    finally:
        e.host_op = prev


# Tensor methods that read a host tensor's data with no aten op the dispatch mode would see
# (tolist reads it in C++; printing turns the dispatch modes off)
_READ_WITHOUT_DISPATCH = {_T.tolist: ".tolist()", _T.__repr__: "repr()", _T.__str__: "str()",
                          _T.__format__: "format()"}

# host ops that read no tensor data (a shape, a stride, a new empty tensor)
_METADATA_ONLY = {aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty,
                  aten.new_empty_strided, aten.zeros_like, aten.ones_like, aten.full_like,
                  aten.is_pinned, aten.sym_size, aten.sym_stride, aten.sym_numel,
                  aten.sym_storage_offset, aten.detach, aten.alias, aten.lift_fresh}


def _check_host_op(sim: SimState, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
    if func.is_view or func.overloadpacket in _METADATA_ONLY:
        return
    reads = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    sim.sched.races.host_access(func.overloadpacket.__name__, reads,
                                host_written(func, args, kwargs))


class SimDispatchMode(TorchDispatchMode):
    """Allocations that torch's C++ code makes on a simulated tensor's device (a scalar
    wrapped on ``self.device()``, a composite op's temporary) reach the dispatcher with
    ``device=cuda`` and no tensor to dispatch on: they are made here, in host memory."""

    def __init__(self, sim: SimState) -> None:
        super().__init__()
        self.sim = sim

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # (torch wraps a mode's __torch_dispatch__ in torch._dynamo.disable otherwise, which
        # costs every op, simulated or not, several microseconds; nothing here is compiled)
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is None:
            if types and all(t is SimTensor or t is Proxy for t in types):
                # what ``func(...)`` would do next: the simulated tensors' own dispatch
                return _torch_dispatch(func, args, kwargs)
            if _race_entry.host_op:  # (the user's op on host memory: see _host_op)
                sim = current()
                if sim is not None:
                    _check_host_op(sim, func, args, kwargs)
            return func(*args, **kwargs)
        sim = current()
        if sim is not None and _is_cuda(device) and \
                not any(is_device(x) for x in args):
            index = sim.sched.device_index(device)
            kw = dict(kwargs)
            kw["device"] = torch.device("cpu")
            kw.pop("pin_memory", None)
            out = func(*args, **kw)
            if isinstance(out, torch.Tensor):
                return _device_result(sim, out, index,
                                      empty=func.overloadpacket in _EMPTY_OPS)
            return out
        if types and all(t is SimTensor or t is Proxy for t in types):
            return _torch_dispatch(func, args, kwargs)
        return func(*args, **kwargs)


_EMPTY_OPS = {aten.empty, aten.empty_strided, aten.new_empty, aten.new_empty_strided,
              aten.empty_like}


def _mode_copy_(self: torch.Tensor, src: Any, non_blocking: bool = False) -> torch.Tensor:
    if is_device(self) or is_device(src):
        return _copy_(self, src, non_blocking)
    sim = current()
    if sim is not None and sim.sched.races.watch and _users_host_call():
        sim.sched.races.host_access("copy_", (src,) if isinstance(src, torch.Tensor) else (),
                                    (self,))
    with torch._C.DisableTorchFunction():
        return self.copy_(src, non_blocking)


_MODE: dict[Any, Callable[..., Any]] = {
    _T.to: _to, _T.cuda: _cuda, _T.cpu: _cpu, _T.pin_memory: _pin_memory,
    _T.is_pinned: _is_pinned, _T.copy_: _mode_copy_, _T.type: _mode_type,
}


# --------------------------------------------------------------------------------------------
# threads started while the simulator is open see it too

_spread_lock = threading.Lock()


def spread_to_new_threads(sim: SimState) -> None:
    """Threads started from now on enter the function mode before they run."""

    previous = threading.getprofile() if hasattr(threading, "getprofile") else None

    def hook(frame: Any, event: str, arg: Any) -> Any:
        sys.setprofile(previous)  # the user's own profile hook, if any, takes over
        if not sim.closed:
            _at_thread_exit.leave = _Leave(enter_modes(sim))
        return previous(frame, event, arg) if previous is not None else None  # type: ignore[arg-type]

    with _spread_lock:
        _saved_profile[:] = [previous]
        threading.setprofile(hook)


_saved_profile: list[Any] = [None]


class _Leave:
    """Leaves a thread's modes when the thread ends (its thread-local data is cleared while
    it still holds the GIL). Left in place, torch's thread-local mode stack would be freed
    by the OS thread's C++ destructors after Python let go of it, and a race with interpreter
    exit ends the process with ``terminate called without an active exception``."""

    def __init__(self, leave: Callable[[], None]) -> None:
        self._leave = leave

    def __del__(self) -> None:
        try:
            self._leave()
        except Exception:  # noqa: BLE001 - (the modes were left already)
            pass


_at_thread_exit = threading.local()


def enter_modes(sim: SimState) -> Callable[[], None]:
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


to = _to  # Tensor.to on simulated tensors (the aten handlers use it for .tolist() and such)
from_proxy = _from_proxy
record_stream = _record_stream  # Tensor.record_stream on simulated tensors
