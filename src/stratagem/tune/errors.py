"""The errors of a tuning job: bad arguments (nothing started), or a study that cannot go on.

Their own module, so that the study's storage, the trial scheduler and the job raise the same
classes without importing one another; ``sg.tune`` and ``tune.tuning_job`` export them.
"""

from __future__ import annotations

from stratagem.errors import StratagemError


class TuningConfigError(StratagemError, ValueError):
    """The arguments of a tuning job are invalid; nothing was started."""


class TuningError(StratagemError, RuntimeError):
    """A study cannot go on: every trial would fail the same way, or another tuner runs it."""
