"""Who called: the one place that walks the stack to find the user's line.

The audit's findings, the simulated CUDA's labels and hazards, and the count of host stalls
all ask the same question: which frame is the user's (the first outside pinstage, PyTorch and
the standard library's plumbing), and was it a pinstage call that led here (then a host wait
is a stall pinstage caused, and the call's name belongs in the message)?

``bench.py``, ``cli.py`` and the pytest plugin use pinstage as a user would, so their frames
count as the user's.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CallSite", "call_site", "explicit_wait", "in_pinstage_call"]

_PKG = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_CONTEXTLIB = os.path.dirname(os.path.abspath(contextlib.__file__)) + os.sep + "contextlib.py"
# pinstage files that act as a user of the library (their lines are what a finding names)
_AS_USER = frozenset(os.path.join(_PKG, f) for f in ("bench.py", "cli.py", "_pytest_plugin.py"))
# pinstage files that are machinery, never "the pinstage call" (the simulated device itself)
_MACHINERY = (os.path.join(_PKG, "_sim") + os.sep, os.path.join(_PKG, "_callsite.py"),
              os.path.join(_PKG, "testing.py"), os.path.join(_PKG, "_audit.py"))


@dataclass(frozen=True)
class CallSite:
    """``where``: ``file:line`` of the user's frame; ``call``: the pinstage function the user
    called that led here (its qualified name), or ``None`` when the user's own code did."""

    where: str
    call: str | None

    def describe(self, what: str) -> str:
        """``what by CALL, queued at WHERE`` (or ``what, queued at WHERE``)."""
        by = f" by {self.call}" if self.call else ""
        return f"{what}{by}, queued at {self.where}"


def _skipped(fn: str) -> bool:
    return fn.startswith("<frozen") or fn.startswith(_TORCH) or fn == _CONTEXTLIB


def call_site(depth: int = 1) -> CallSite:
    """The user's frame above the caller (``depth`` frames up), and the pinstage call."""
    frame: Any = sys._getframe(depth + 1)
    call: str | None = None
    while frame is not None:
        code = frame.f_code
        fn = code.co_filename
        if not _skipped(fn):
            if not fn.startswith(_PKG) or fn in _AS_USER:
                return CallSite(f"{fn}:{frame.f_lineno}", call)
            if not fn.startswith(_MACHINERY):
                call = getattr(code, "co_qualname", code.co_name)
        frame = frame.f_back
    return CallSite("<unknown>", call)


class _Explicit(threading.local):
    depth = 0


_explicit = _Explicit()


@contextlib.contextmanager
def explicit_wait() -> Iterator[None]:
    """Marks host waits pinstage makes because the user asked for one (``synchronize()``):
    they are not host stalls."""
    _explicit.depth += 1
    try:
        yield
    finally:
        _explicit.depth -= 1


def in_pinstage_call(depth: int = 1) -> bool:
    """Whether a host wait happening now is a stall inside a pinstage call: the stack leads
    from the user's code into a pinstage function, and not one the user asked to wait."""
    if _explicit.depth > 0:
        return False
    return call_site(depth + 1).call is not None
