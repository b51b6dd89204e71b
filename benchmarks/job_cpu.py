"""The CPU a job's processes have used: a steadier figure than a rate on a shared machine.

A job's tasks are the children of one launcher (``stratagem run``, or ``coordinator_tf.py``'s
own). A task that times the job reads this before and after; the difference over the updates
made in between is the job's CPU per update, which another job's load changes far less than it
changes the updates per second. Standard library only: TensorFlow's Python imports it too.
"""

from __future__ import annotations

import os
from pathlib import Path


def job_cpu_seconds() -> float | None:
    """User and system CPU seconds so far of every thread of this process's launcher's children
    (this task and its siblings). None where ``/proc`` cannot tell (not Linux)."""
    launcher = os.getppid()
    try:
        children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    except OSError:
        return None
    ticks = 0
    for pid in children:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:  # ended since: its CPU is not counted either time
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        ticks += int(fields[11]) + int(fields[12])  # utime, stime: all its threads
    return ticks / os.sysconf("SC_CLK_TCK")


def per_update_ms(before: float | None, after: float | None, updates: int) -> float | None:
    """The job's CPU milliseconds per update between two readings (None without them)."""
    if before is None or after is None or updates <= 0:
        return None
    return 1000 * (after - before) / updates
