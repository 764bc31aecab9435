"""aten ops that CUDA has and a CPU build of torch lacks, as kernels of the simulated device:
SyncBatchNorm's statistics (``batch_norm_stats``, ``batch_norm_gather_stats`` and
``_with_counts``, ``batch_norm_elemt``), computed on the host memory from the same formulas
as CUDA's kernels. Each goes through the default op handler like any other op (queued on its
stream, shape inferred on ``meta`` tensors by the same formulas).

The ``running_mean``/``running_var`` updates of the gather kernels are done, as on CUDA,
though the op's schema does not mark them written: the race detector does not see them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._core import SimState
from ._tensor import _DEFAULTS, register_op

aten = torch.ops.aten


def _channel_dims(x: torch.Tensor) -> list[int]:
    return [d for d in range(x.dim()) if d != 1]


def _acc(dtype: torch.dtype) -> torch.dtype:
    """CUDA's accumulate type: float for the half types."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _stats(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel (dim 1): the mean and 1/sqrt(biased variance + eps)."""
    var, mean = torch.var_mean(x.to(_acc(x.dtype)), dim=_channel_dims(x), correction=0)
    return mean, torch.rsqrt(var + eps)


def _gather_with_counts(x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                        running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                        momentum: float, eps: float,
                        counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine per-group (row) means and invstds of ``counts`` elements each into the whole
    batch's, and move the running statistics (unbiased variance) towards them."""
    n = counts.to(mean.dtype).reshape(-1, 1)
    total = n.sum()
    g_mean = (n * mean).sum(0) / total
    var = (n * (invstd.pow(-2) - eps + (mean - g_mean).pow(2))).sum(0) / total
    if running_mean is not None:
        running_mean.copy_(running_mean * (1 - momentum) + g_mean * momentum)
    if running_var is not None:
        unbiased = var * total / (total - 1)
        running_var.copy_(running_var * (1 - momentum) + unbiased * momentum)
    return g_mean, torch.rsqrt(var + eps)


def _gather(x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
            running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
            momentum: float, eps: float, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.full((mean.shape[0],), float(count), dtype=mean.dtype, device=mean.device)
    return _gather_with_counts(x, mean, invstd, running_mean, running_var, momentum, eps,
                               counts)


def _elemt(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
           mean: torch.Tensor, invstd: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize ``x`` per channel: (x - mean) * invstd * weight + bias."""
    shape = [1] * x.dim()
    shape[1] = -1
    y = (x.to(mean.dtype) - mean.reshape(shape)) * invstd.reshape(shape)
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return y.to(x.dtype)


class _HostKernel:
    """An aten op as the default handler sees it, computed by ``impl`` (on host memory when
    it runs, on meta tensors for the output's shape); attributes are the op's."""

    __slots__ = ("func", "impl")

    def __init__(self, func: Any, impl: Callable[..., Any]) -> None:
        self.func, self.impl = func, impl

    @property
    def sim_wrapped(self) -> Any:
        return self.func

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch._C.DisableTorchFunction():
            return self.impl(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.func, name)


_IMPLS: dict[Any, Callable[..., Any]] = {
    aten.batch_norm_stats: _stats,
    aten.batch_norm_gather_stats: _gather,
    aten.batch_norm_gather_stats_with_counts: _gather_with_counts,
    aten.batch_norm_elemt: _elemt,
}
_KERNELS: dict[int, _HostKernel] = {}  # id(OpOverload) -> its kernel (made once)


def _host_kernel(sim: SimState, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    kernel = _KERNELS.get(id(func))
    if kernel is None:
        kernel = _KERNELS[id(func)] = _HostKernel(func, _IMPLS[func.overloadpacket])
    return _DEFAULTS["op"](sim, kernel, args, kwargs)


register_op(*_IMPLS)(_host_kernel)
