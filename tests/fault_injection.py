"""Kill or stop one task of a training job and read how the others fail: the fault matrix.

Shared by tests/test_fault_matrix.py (the verdicts: named, one block, every process exits) and
benchmarks/fault_matrix.py (the figures: faults injected / named / hung, seconds to the error).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path

from cluster_utils import WORKERS, Cluster, Process, Result

SCRIPT = WORKERS / "fault_matrix.py"
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
# What each fault must be reported as by the survivors.
EXPECTED = {"kill": "PeerLostError", "stop": "CollectiveTimeoutError"}
OP_TIMEOUT_S = 5.0


@dataclass
class Outcome:
    survivor: Result
    victim: Result | None  # None for a killed victim (it printed nothing more)
    victim_name: str
    seconds_to_error: float  # from the signal to the survivor's report


def _wait_for(proc: Process, text: str, deadline: float, *, err: bool = False) -> None:
    """Poll ``proc``'s output until it shows ``text``; fail if it exits or the deadline passes
    first (the deadline only bounds a hang; it decides nothing else)."""
    # stderr read with a newline in front: a report is found whether or not a line precedes it.
    read = (lambda: "\n" + proc.errors_so_far()) if err else proc.output_so_far
    while text not in read():
        if proc.proc.poll() is not None and text not in read():
            raise AssertionError(f"{proc.name} exited before printing {text!r}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{proc.name} did not print {text!r} in time (a hang)")
        time.sleep(0.02)


def inject(
    strategy: str, fault: str, victim: int, workdir: Path, *, op_timeout: float = OP_TIMEOUT_S
) -> Outcome:
    """Train ``strategy`` on two tasks; when both have taken 10 steps, send ``fault`` to task
    ``victim``. The survivor must end with a report; a stopped victim is then resumed and must
    end by itself too (its peer is gone by then)."""
    env = {"STRATEGY": strategy, "STRATAGEM_OP_TIMEOUT": str(op_timeout)}
    with Cluster(SCRIPT, 2, workdir, env=env) as cluster:
        deadline = time.monotonic() + 180
        for p in cluster.processes:
            _wait_for(p, "step 10", deadline)
        target, survivor = cluster.processes[victim], cluster.processes[1 - victim]
        target.kill_group(SIGNALS[fault])
        sent = time.monotonic()
        _wait_for(survivor, "\nstratagem: ", sent + 120, err=True)
        seconds = time.monotonic() - sent
        survived = survivor.wait(timeout=60)
        resumed = None
        if fault == "stop":
            target.kill_group(signal.SIGCONT)
            resumed = target.wait(timeout=60)
    name = f"worker {victim} (localhost:{cluster.ports[victim]})"
    return Outcome(survived, resumed, name, seconds)
