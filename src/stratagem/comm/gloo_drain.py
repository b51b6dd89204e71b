"""Let gloo's worker threads finish their last work before the interpreter shuts down.

A gloo worker thread drops a completed work, and its tensors (which takes the GIL), a moment
after the Python side's ``wait`` returned; if the main thread has reached interpreter shutdown
by then, the process aborts with SIGABRT ("terminate called without an active exception") after
a job that did everything right. ``wait_for_gloo_threads``, called at a clean exit
(``ProcessGroupCommunicator.shutdown``), waits with the GIL released until every gloo worker
thread of this process has been seen asleep in a few consecutive looks a millisecond apart. A
thread blocked in a collective whose peer is gone sleeps too, so a failed job is not held up;
the wait is bounded (2 s), after which the exit goes on regardless.
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
