"""Errors raised by pinstage.

The tree::

    PinstageError                      base of pinstage's own errors (never for user mistakes alone)
    ├── HiddenSyncError(RuntimeError)  the audit found an operation that makes the host wait
    └── HazardError(RuntimeError)      (pinstage.testing) queued simulated work read host memory
                                       that the host changed after queueing it
    ValueOverflowError(ValueError, OverflowError)
                                       a value does not fit the target dtype
    NotANumberError(TypeError, ValueError)
                                       a value that is not a number (None, a string, bytes)
                                       where numbers are expected

User mistakes raise the built-in ``ValueError`` / ``TypeError`` / ``IndexError`` with a message
that names the bad value and what was expected, as the contract asks.
"""

from __future__ import annotations

__all__ = ["PinstageError", "HiddenSyncError", "HazardError", "ValueOverflowError",
           "NotANumberError"]


class PinstageError(Exception):
    """Base class of the errors pinstage defines."""


class HiddenSyncError(PinstageError, RuntimeError):
    """An audited operation makes (or on a real accelerator would make) the host wait."""


class HazardError(PinstageError, RuntimeError):
    """The simulated CUDA found what would be garbage or a crash on a GPU: host memory that
    queued device work reads was changed or freed before it ran, or a pending device-to-host
    destination was written by the host."""


HazardError.__module__ = "pinstage.testing"  # where users import it from


class ValueOverflowError(ValueError, OverflowError):
    """A value does not fit the dtype it is written as; it is refused, never wrapped."""


class NotANumberError(TypeError, ValueError):
    """A value that is not a number where numbers are expected (``None``, a string, bytes...).

    Both a ``TypeError`` (the value has the wrong type) and a ``ValueError`` (the contract's
    type for refused values), so either ``except`` clause catches it."""


def describe(value: object, limit: int = 60) -> str:
    """A short repr of a user value for error messages."""
    text = repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{text} ({type(value).__name__})"
