"""Issue 14, "every fault named, none hangs": kill -9 or SIGSTOP of a task of a training job,
under each strategy whose tasks run collectives together.

The survivor must end with one readable block naming the lost or stopped task and the
operation (``PeerLostError`` for a killed task, ``CollectiveTimeoutError`` for a stopped one,
whose liveness port still accepts but never answers); a stopped task, once resumed, must end
by itself; nothing may hang. MultiWorkerMirroredStrategy's kill -9 of either task is in
test_failures.py; the full matrix with its timings is benchmarks/fault_matrix.py.
Parameter servers' faults are in test_parameter_server.py; Mirrored and CentralStorage run in
one process (a replica is a thread, not a task that can be lost).
"""

from __future__ import annotations

import pytest

from fault_injection import EXPECTED, inject

pytestmark = pytest.mark.multiprocess

# One cell per code path (the full matrix of 12 is the benchmark's): torch's own collectives
# under a mesh, lost and stopped (the silent liveness port), and a pipeline schedule's sends.
CASES = [
    ("mesh", "kill", 1),
    ("mesh", "stop", 0),
    # A mesh job's own loop: DTensor's collectives outside stratagem's operations.
    ("mesh_loop", "kill", 0),
    ("mesh_loop", "stop", 1),
    ("pipeline", "kill", 0),
]


@pytest.mark.parametrize(("strategy", "fault", "victim"), CASES, ids=lambda v: str(v))
def test_a_lost_or_stopped_task_is_named_in_one_block(tmp_path, strategy, fault, victim):
    outcome = inject(strategy, fault, victim, tmp_path, op_timeout=3.0)
    stderr = outcome.survivor.stderr
    assert outcome.survivor.returncode != 0
    # The report is the last thing said (after the start line, "[stratagem] worker 0 of ...").
    _, marker, rest = ("\n" + stderr).partition("\nstratagem: ")
    report = (marker + rest).lstrip("\n") if marker else stderr
    survivor = f"worker {1 - victim} (localhost:"
    assert report.startswith(f"stratagem: {EXPECTED[fault]} on {survivor}"), stderr
    assert outcome.victim_name in report, report
    # The operation it was in: ours ("all_reduce of ...") or torch's ("DTensor's collectives").
    assert " during " in report or " timed out after " in report, report
    if fault == "stop":
        assert "does not answer (stopped or stuck)" in report, report
    # One block: no traceback, no gloo source locations, a handful of lines.
    assert "Traceback" not in report and ".cc:" not in report, report
    assert len(report.strip().splitlines()) <= 6, report
    if outcome.victim is not None:  # the stopped task, resumed: its peer is gone by then
        assert outcome.victim.returncode != 0
        assert "stratagem: PeerLostError" in outcome.victim.stderr, outcome.victim.stderr
