"""Let gloo's worker threads finish their last work before the interpreter shuts down.

Why: a ``ProcessGroupGloo`` runs its collectives on threads of its own (``pt_gloo_runloop``).
After a collective completes (the Python side's ``wait`` returns), its thread still holds the
work for a moment and then drops it, with the work's tensors. A tensor whose Python object
died while the work still held it is kept alive by torch for its Python object's sake, so
dropping it takes the GIL. If the main thread has reached interpreter shutdown by then,
CPython 3.11 ends a foreign thread that asks for the GIL with ``pthread_exit``, which unwinds
through gloo's C++ and aborts the whole process: "terminate called without an active
exception", SIGABRT, after a job that did everything right.

The threads live as long as the group, and a group lives as long as Python holds it: a
``DeviceMesh`` keeps its groups (``_pg_registry``), as does any ``new_group`` handle, so
neither ``destroy_process_group`` nor the backend's ``shutdown()``/``abort()`` ends them
(checked with torch 2.13: the threads stay). Two processes doing 50 functional all-reduces on
a held group, as DTensor issues them, and exiting: 5 aborts in 80 exits, none in 80 exits that
waited first (``benchmarks/exit_aborts.py --rounds 40``, alternating, on a 2-core machine).

What this does, at a clean exit of a job's process (``ProcessGroupCommunicator.shutdown``):
wait, with the GIL released, until every gloo worker thread of this process sleeps, seen so
in a few consecutive looks a millisecond apart. A thread that drops its last work needs the
GIL, which this wait leaves free, and then returns to its sleep; a thread blocked inside a
collective whose peer is gone sleeps too, so a failed job is not held up. Bounded (2 s): at
worst the exit goes on as before.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

# The name torch gives ProcessGroupGloo's worker threads (``c10::setThreadName``).
RUNLOOP_THREAD = "pt_gloo_runloop"
_LOOKS = 3  # consecutive looks in which every worker thread sleeps
_INTERVAL_S = 0.001
_LIMIT_S = 2.0


def _runloop_states() -> list[str]:
    """The scheduler state (R running, S sleeping, ...) of each gloo worker thread of this
    process; empty where /proc cannot say (not Linux), where there is nothing to wait for."""
    states = []
    tasks = Path(f"/proc/{os.getpid()}/task")
    try:
        tids = os.listdir(tasks)
    except OSError:
        return []
    for tid in tids:
        try:
            if (tasks / tid / "comm").read_text().strip() != RUNLOOP_THREAD:
                continue
            # The field after "(comm)"; the name holds no ")" here.
            states.append((tasks / tid / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            continue  # the thread ended meanwhile
    return states


def wait_for_gloo_threads(limit_s: float = _LIMIT_S) -> bool:
    """Wait until every gloo worker thread sleeps (see the module); whether they did within
    ``limit_s``. Returns at once in a process without any."""
    deadline = time.monotonic() + limit_s
    quiet = 0
    while quiet < _LOOKS:
        states = _runloop_states()
        if not states:
            return True
        quiet = quiet + 1 if all(s in ("S", "D") for s in states) else 0
        if time.monotonic() >= deadline:
            return False
        time.sleep(_INTERVAL_S)  # the GIL free for a thread dropping its work
    return True
