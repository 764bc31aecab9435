"""Deliver ``KeyboardInterrupt`` at every line pinstage executes during a call.

``line_events(call)`` counts the line events in pinstage's own frames while ``call()`` runs;
``interrupt_at(call, k)`` runs it again with a trace function that raises ``KeyboardInterrupt``
at the k-th of them (the harshest form of Ctrl-C: between any two lines, including the line
that ends a ``with`` block, where a real signal can land too; not in a ``weakref.finalize``
callback the collector happens to run meanwhile). A test calls ``call`` once per
point and checks afterwards that nothing leaked: no lock held, staging memory back, the next
call right.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import pinstage

PKG = os.path.dirname(os.path.abspath(pinstage.__file__)) + os.sep


def _in_finalizer(frame: Any, depth: int = 8) -> bool:
    """Whether ``frame`` runs inside a ``weakref.finalize`` callback (the collector runs one
    wherever it happens to run: an interrupt there is CPython's "unraisable", not the call's,
    which the timed-signal tests cover)."""
    f = frame.f_back
    for _ in range(depth):
        if f is None:
            return False
        code = f.f_code
        if code.co_name == "__call__" and code.co_filename.endswith(_WEAKREF):
            return True
        f = f.f_back
    return False


_WEAKREF = os.sep + "weakref.py"


def _tracer(counter: list[int], target: int | None,
            only: Callable[[str], bool]) -> Callable[..., Any]:
    def trace(frame: Any, event: str, arg: Any) -> Any:
        fn = frame.f_code.co_filename
        if not fn.startswith(PKG) or not only(fn) or (event == "call" and _in_finalizer(frame)):
            return None  # no line events for this frame
        if event == "line":
            counter[0] += 1
            if target is not None and counter[0] == target:
                raise KeyboardInterrupt(f"injected at {os.path.basename(fn)}:{frame.f_lineno}")
        return trace
    return trace


def _run(call: Callable[[], Any], tracer: Callable[..., Any]) -> None:
    old = sys.gettrace()
    threading.settrace(tracer)
    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(old)
        threading.settrace(old)  # type: ignore[arg-type]


def line_events(call: Callable[[], Any], only: Callable[[str], bool] = lambda fn: True) -> int:
    """How many line events pinstage's frames have while ``call()`` runs."""
    counter = [0]
    _run(call, _tracer(counter, None, only))
    return counter[0]


def interrupt_at(call: Callable[[], Any], k: int,
                 only: Callable[[str], bool] = lambda fn: True) -> bool:
    """Run ``call()`` with a ``KeyboardInterrupt`` at pinstage's k-th line; True if it was
    interrupted (False: it finished first, e.g. a shorter path this time)."""
    counter = [0]
    try:
        _run(call, _tracer(counter, k, only))
    except KeyboardInterrupt:
        return True
    return False
