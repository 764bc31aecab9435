"""A simulated CUDA for CPU-only CI: unmodified GPU code runs, in stream order, and its async
bugs become deterministic errors.

``simulated_accelerator(mode, seed, pin_memory, uva, device_count)`` opens it: while open,
``torch.cuda`` answers for ``device_count`` simulated devices, tensors made with
``device="cuda"`` report ``cuda`` and keep their data in host memory, and every operation on
them (torch's and pinstage's) is queued on the current stream of its device. The queues run
at once (``"eager"``), only when the host must wait (``"lazy"``), or at seeded random points
(``"random"``). What would be garbage or a crash on a GPU raises :class:`HazardError`: a queued
copy whose host source changed before it ran, pinned memory pinstage freed while queued work
still read it, a host write into the destination of a queued device-to-host copy, a tensor or
array held in a list staged by ``stage_write`` and changed before ``apply_write``; in random
mode duplicate positions in one scatter land in shuffled order.
``register_kernel(triton_kernel, torch_fn)`` runs a PyTorch stand-in for a Triton kernel
(queued as one kernel), and ``tensor_at(ptr, shape, dtype)`` turns a raw pointer read from a
table into a tensor over that memory, so Triton-using engine code runs in CPU CI. Like httpx's
mock transport, it ships in the library so users test their own engine code with it.
"""

from __future__ import annotations

from ._errors import HazardError
from ._sim import MODES, SimStats, Simulator, register_kernel, simulated_accelerator, tensor_at

__all__ = ["MODES", "HazardError", "SimStats", "Simulator", "register_kernel",
           "simulated_accelerator", "tensor_at"]
