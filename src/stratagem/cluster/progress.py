"""What a task says about its own start: one-line messages on stderr, as ``[stratagem] ...``.

A task waiting for its peers says who has arrived and who is missing, and a strategy says once
that it has started; without them a hand-started worker waits in silence. They go through the
``logging`` logger ``"stratagem"`` at INFO, so a program may route them like any log;
``STRATAGEM_LOG_LEVEL`` (``debug``, ``info``, ``warning``, ``error``; default ``info``) sets how
much is said, and ``stratagem run --quiet`` sets it to ``warning`` in every task.

Lowest layer on purpose (no torch, nothing of ours): the rendezvous and the strategies both use it.
"""

from __future__ import annotations

import logging
import os
import sys

LOGGER_NAME = "stratagem"
LEVEL_VARIABLE = "STRATAGEM_LOG_LEVEL"
LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
PREFIX = "[stratagem] "


class _StderrHandler(logging.Handler):
    """Writes to whatever ``sys.stderr`` is at the time (a test's capture, a notebook's cell)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(PREFIX + record.getMessage() + "\n")
            sys.stderr.flush()
        except (OSError, ValueError):  # nobody reads stderr any more: say nothing
            pass


def log_level(environ: dict[str, str] | None = None) -> int:
    """The level ``STRATAGEM_LOG_LEVEL`` asks for; a bad value is an error naming the choices."""
    raw = (os.environ if environ is None else environ).get(LEVEL_VARIABLE, "").strip()
    if not raw:
        return logging.INFO
    level = LEVELS.get(raw.lower())
    if level is None:
        raise ValueError(
            f"{LEVEL_VARIABLE}={raw!r} is not a log level; expected one of {', '.join(LEVELS)}"
        )
    return level


def logger() -> logging.Logger:
    """The ``"stratagem"`` logger, with our stderr handler unless the program gave it one."""
    log = logging.getLogger(LOGGER_NAME)
    if not log.handlers:
        log.addHandler(_StderrHandler())
        log.propagate = False  # said once, not again by a root handler a library configured
    log.setLevel(log_level())  # read each time: a test or a notebook may change it
    return log


def info(message: str) -> None:
    """Say ``message`` at INFO (start messages, roll-call progress)."""
    logger().info(message)


def debug(message: str) -> None:
    """Say ``message`` at DEBUG (a single-process strategy's start)."""
    logger().debug(message)
