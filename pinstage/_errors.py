"""Errors raised by pinstage: the whole tree, in one place.

The tree::

    PinstageError                       base of every error pinstage defines
    ├── ValueOverflowError(ValueError, OverflowError)
    │                                   a value does not fit the target dtype (refused, never
    │                                   wrapped)
    ├── NotANumberError(TypeError, ValueError)
    │                                   a value that is not a number (None, a string, bytes)
    │                                   where numbers are expected
    ├── UnavailableError(RuntimeError)  what was asked cannot be done in this process (no CUDA,
    │                                   no pinned memory, no UVA); ``reasons`` says why
    ├── CaptureError(RuntimeError)      refused while a CUDA graph is being captured
    ├── BusyError(RuntimeError)         an object (or the staging arena) is in use in a way
    │                                   that cannot proceed: two threads in one object, a
    │                                   region held across another request
    ├── DriverError(RuntimeError)       a CUDA/HIP runtime call pinstage made failed (with its
    │                                   error code); probes catch this, never a bug
    ├── HiddenSyncError(RuntimeError)   the audit found an operation that makes the host wait
    └── HazardError(RuntimeError)       (pinstage.testing) the simulated CUDA found what would
                                        be garbage or a crash on a GPU

User mistakes raise ``ValueError`` / ``TypeError`` / ``IndexError`` (the contract's types),
built-in or one of the classes above that also derive from them, with a message that names the
bad value and what was expected.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["PinstageError", "ValueOverflowError", "NotANumberError", "UnavailableError",
           "CaptureError", "BusyError", "DriverError", "HiddenSyncError", "HazardError",
           "describe"]


class PinstageError(Exception):
    """Base class of the errors pinstage defines."""


class ValueOverflowError(PinstageError, ValueError, OverflowError):
    """A value does not fit the dtype it is written as; it is refused, never wrapped."""


class NotANumberError(PinstageError, TypeError, ValueError):
    """A value that is not a number where numbers are expected (``None``, a string...).

    Both a ``TypeError`` (the value has the wrong type) and a ``ValueError`` (the contract's
    type for refused values), so either ``except`` clause catches it."""


class UnavailableError(PinstageError, RuntimeError):
    """What was asked cannot be done in this process: no CUDA, no pinned host memory, no UVA.

    ``reasons``: the plain-English lines (as in ``capabilities().reasons``) that say why."""

    def __init__(self, message: str, reasons: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.reasons: tuple[str, ...] = tuple(reasons)


class CaptureError(PinstageError, RuntimeError):
    """Refused while the current stream captures a CUDA graph: the call would make a replay
    read recycled memory, or would synchronize (illegal during capture)."""


class BusyError(PinstageError, RuntimeError):
    """An object is used in a way that cannot proceed now: entered by two threads at once, or
    the staging arena full behind a region the calling thread itself still holds."""


class DriverError(PinstageError, RuntimeError):
    """A CUDA/HIP runtime call pinstage made failed; ``code`` is its error number (``None``
    when the call could not be made at all, e.g. the runtime library is missing)."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class HiddenSyncError(PinstageError, RuntimeError):
    """An audited operation makes (or on a real accelerator would make) the host wait."""


class HazardError(PinstageError, RuntimeError):
    """The simulated CUDA found what would be garbage or a crash on a GPU: host memory that
    queued device work reads was changed or freed before it ran, pinned memory that queued
    device work writes read or written by the host before it waited, or two streams touched
    memory without ordering."""


# Where users import them from (``repr`` and tracebacks show these paths).
for _cls in (PinstageError, ValueOverflowError, NotANumberError, UnavailableError, CaptureError,
             BusyError, DriverError, HiddenSyncError):
    _cls.__module__ = "pinstage"
HazardError.__module__ = "pinstage.testing"
del _cls


def describe(value: object, limit: int = 60) -> str:
    """A short repr of a user value for error messages."""
    text = repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{text} ({type(value).__name__})"
