"""The ``pinstage`` logger: a ``NullHandler`` (library convention), its level from
``PINSTAGE_LOG_LEVEL``, and warnings that still reach a user who configured no logging.

Python's last-resort handler would print a bare message with no hint of where it came from;
with the ``NullHandler`` it prints nothing, so :func:`warn` writes ``pinstage: warning: ...``
to stderr itself while no handler is configured (the application's handlers take over as soon
as there are any, and ``PINSTAGE_LOG_LEVEL=ERROR`` silences both).
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["LOG_LEVEL_VARIABLE", "configured", "level_from_env", "logger", "warn"]

LOG_LEVEL_VARIABLE = "PINSTAGE_LOG_LEVEL"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

logger = logging.getLogger("pinstage")

# an invalid PINSTAGE_LOG_LEVEL found at import: said with the first warning (it only matters
# once something is logged; `pinstage doctor` reports it as a usage error)
_env_error: str | None = None


def level_from_env() -> int | None:
    """The level ``PINSTAGE_LOG_LEVEL`` names (a name such as ``info``, or a number), None
    when unset. ``ValueError`` naming the value and the valid ones when it is not a level."""
    raw = os.environ.get(LOG_LEVEL_VARIABLE, "")
    value = raw.strip()
    if not value:
        return None
    if value.isdigit():
        return int(value)
    level = logging.getLevelName(value.upper())
    if value.upper() not in _LEVELS or not isinstance(level, int):
        raise ValueError(f"{LOG_LEVEL_VARIABLE}={raw!r} is not a valid setting: expected one "
                         f"of {', '.join(_LEVELS)} (any case) or a number")
    return level


def configured() -> bool:
    """Whether a record of the ``pinstage`` logger reaches a handler other than a
    ``NullHandler`` (the application or a test runner configured logging)."""
    log: logging.Logger | None = logger
    while log is not None:
        if any(not isinstance(h, logging.NullHandler) for h in log.handlers):
            return True
        if not log.propagate:
            return False
        log = log.parent
    return False


def warn(message: str) -> None:
    """Log ``message`` at WARNING; also print it as ``pinstage: warning: ...`` on stderr when
    no logging is configured (so a fallback is never silent by default)."""
    global _env_error
    pending, _env_error = _env_error, None
    if pending is not None:
        warn(pending)
    logger.warning("%s", message)
    if logger.isEnabledFor(logging.WARNING) and not configured():
        try:
            print(f"pinstage: warning: {message}", file=sys.stderr)
        except (OSError, ValueError):  # stderr closed: nothing more can be said
            pass


def _setup() -> None:
    global _env_error
    if not any(isinstance(h, logging.NullHandler) for h in logger.handlers):
        logger.addHandler(logging.NullHandler())
    try:
        level = level_from_env()
    except ValueError as exc:  # never fail an import over it
        _env_error = f"{exc}; ignored"
        return
    if level is not None:
        logger.setLevel(level)


_setup()
