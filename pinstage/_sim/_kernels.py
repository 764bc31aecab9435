"""PyTorch stand-ins for Triton kernels, and the pointer lookup they need.

Engine code launches Triton kernels as ``kernel[grid](*args)``; some take tables of raw
device pointers (vLLM's block tables). ``register_kernel(kernel, fn)`` makes such a launch
run ``fn(*args, grid=grid, **kwargs)`` instead: on the simulated CUDA as one kernel queued on
the current stream (``sim.launch``), on the CPU target at once. Inside ``fn``,
``tensor_at(ptr, shape, dtype)`` turns an address read from such a table into a tensor over
that memory (simulated device memory is host memory, so the address is a host address).
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._core import current

__all__ = ["register_kernel", "tensor_at"]

# storage base address -> (bytes, weak reference to a tensor owning that storage). A cache:
# filled by scanning live tensors on a miss, entries whose tensor died are dropped.
_known: dict[int, tuple[int, weakref.ref[torch.Tensor]]] = {}
_lock = threading.Lock()


def _reset_after_fork() -> None:
    global _lock
    _lock = threading.Lock()
    _known.clear()


def _lookup(ptr: int, nbytes: int) -> torch.Tensor | None:
    for base, (size, ref) in list(_known.items()):
        if base <= ptr and ptr + nbytes <= base + size:
            t = ref()
            if t is not None and t.untyped_storage().data_ptr() == base:
                return t
            del _known[base]
    return None


def _scan() -> None:
    """Note every live CPU tensor's storage afresh (the simulator's device tensors keep their
    memory in such tensors); entries of dead tensors go."""
    _known.clear()
    for o in gc.get_objects():
        if type(o) is not torch.Tensor or o.device.type != "cpu":
            continue
        try:
            st = o.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        base, size = st.data_ptr(), st.nbytes()
        if size and _known.get(base, (0,))[0] < size:
            _known[base] = (size, weakref.ref(o))


def tensor_at(ptr: int, shape: Sequence[int] | int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` over the memory at address ``ptr`` (a
    ``data_ptr()`` of a live tensor, plus an offset), for a kernel stand-in to read and write.
    ``ValueError`` when no live tensor's memory holds that whole range, or ``ptr`` is not
    aligned to ``dtype``."""
    if isinstance(ptr, torch.Tensor):
        ptr = int(ptr.item())
    if not isinstance(ptr, int) or isinstance(ptr, bool):
        raise TypeError(f"ptr must be an int address, got {type(ptr).__name__}")
    dims = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise ValueError(f"shape must not be negative, got {dims}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    item = torch.empty((), dtype=dtype, device="cpu").element_size()
    numel = 1
    for d in dims:
        numel *= d
    nbytes = max(numel * item, 1)
    with _lock:
        owner = _lookup(ptr, nbytes)
        if owner is None:
            _scan()
            owner = _lookup(ptr, nbytes)
    if owner is None:
        raise ValueError(f"no live tensor's memory holds {nbytes} bytes at address {ptr:#x} "
                         f"(shape {dims}, {dtype})")
    storage = owner.untyped_storage()
    offset = ptr - storage.data_ptr()
    if offset % item:
        raise ValueError(f"address {ptr:#x} is not aligned to {dtype} ({item} bytes)")
    strides: list[int] = []
    step = 1
    for d in reversed(dims):
        strides.insert(0, step)
        step *= max(d, 1)
    out = torch.empty(0, dtype=dtype, device="cpu")
    return out.set_(storage, offset // item, dims, strides)


class _StandIn:
    """What ``kernel.run`` becomes: the launch of a registered stand-in."""

    def __init__(self, kernel: Any, fn: Callable[..., Any], previous: Any) -> None:
        self.kernel, self.fn, self.previous = kernel, fn, previous
        self.__name__ = getattr(fn, "__name__", "stand_in")

    def __call__(self, *args: Any, grid: Any = None, warmup: bool = False,
                 **kwargs: Any) -> None:
        if callable(grid):
            grid = grid(kwargs)
        grid = (grid,) if isinstance(grid, int) else tuple(grid)
        fn = self.fn
        sim = current()
        if sim is not None and not sim.closed:
            sim.launch(fn, *args, grid=grid, **kwargs)  # type: ignore[attr-defined]
        else:
            fn(*args, grid=grid, **kwargs)


def register_kernel(kernel: Any, fn: Callable[..., Any]) -> Callable[[], None]:
    """Make ``kernel[grid](*args, **kwargs)`` (a Triton ``JITFunction``, or anything whose
    ``[grid]`` launch calls its ``run(*args, grid=..., warmup=..., **kwargs)``) run
    ``fn(*args, grid=grid, **kwargs)``: queued as one kernel on the simulated CUDA, at once
    on the CPU target. ``fn`` gets device tensors as plain tensors over their memory. Returns
    a function that undoes the registration."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not hasattr(kernel, "__getitem__"):
        raise TypeError(f"kernel must be a Triton kernel (launched as kernel[grid](...)), got "
                        f"{type(kernel).__name__}")
    previous = kernel.__dict__.get("run") if hasattr(kernel, "__dict__") else None
    stand_in = _StandIn(kernel, fn, previous)
    try:
        kernel.run = stand_in
    except AttributeError:
        raise TypeError(f"cannot register a stand-in on {type(kernel).__name__}: its run "
                        "attribute is read-only") from None

    def undo() -> None:
        if kernel.__dict__.get("run") is stand_in:
            if previous is None:
                del kernel.run
            else:
                kernel.run = previous

    return undo
