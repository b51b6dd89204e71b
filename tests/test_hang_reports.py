"""Hangs named under every strategy: when one worker misses a collective, every worker reports,
within the operation timeout + 5 s, one block naming the missing worker, the operation's number
and the line of the script that issued it, and ends.

Two ways to miss it (``workers/hang_reports.py``): ``skip`` goes on to the job's final barrier,
which the other worker never reaches (a DTensor mesh's step, FSDP's step, a pipeline's schedule:
their collectives run on other groups than the barrier); ``busy`` stays out of collectives, as a
worker stuck in its own code (MultiWorkerMirrored: there a skipped all-reduce meets the barrier
on the same gloo group, whose size check aborts the process in C++ with no report possible).
All jobs run at once to keep the suite short; each verdict reads its own job's output only.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from cluster_utils import WORKERS, Cluster, Result
from stratagem.comm.liveness import (
    TIMED_OUT,
    LivenessServer,
    linger,
    operation_position,
    whereabouts,
)

OP_TIMEOUT_S = 3.0
SKIPPER = 1
CASES = {"mwms": "busy", "mesh": "skip", "fsdp": "skip", "pipeline": "skip"}


# After its report, a process's interpreter shutdown (torch's and gloo's teardown) took 3.5 to 6 s
# on the loaded 2-core machine these tests were written on, with or without this report: the
# report's bound is the claim, the exit's only bounds a hang.
EXIT_SLACK_S = 30.0


@dataclass
class Ended:
    result: Result
    # From the skip (or, for a busy worker, from its release) to its report, and to its exit.
    reported: float
    exited: float


def _run_all(root: Path) -> dict[str, list[Ended]]:
    """Start every case's job, release each busy worker once its peer has ended, and time
    every exit from the moment the worker it waits for missed the collective."""
    jobs: dict[str, Cluster] = {}
    for kind, hang in CASES.items():
        (root / kind).mkdir()
        env = {
            "STRATEGY": kind,
            "HANG": hang,
            "SKIPPER": str(SKIPPER),
            "SKIP_STEP": "4",
            "STRATAGEM_OP_TIMEOUT": f"{OP_TIMEOUT_S:g}",
        }
        jobs[kind] = Cluster(WORKERS / "hang_reports.py", 2, root / kind, env=env)
    ended: dict[str, dict[int, tuple[int, float]]] = {k: {} for k in jobs}
    reported: dict[tuple[str, int], float] = {}
    skipped: dict[str, float] = {}
    released: dict[str, float] = {}
    deadline = time.monotonic() + 300  # bounds a hang of the test itself; decides nothing
    try:
        while any(len(ended[k]) < 2 for k in jobs):
            assert time.monotonic() < deadline, f"jobs still running: {ended}"
            for kind, job in jobs.items():
                said = re.search(
                    r"skipping step 4 at ([\d.]+)", job.processes[SKIPPER].output_so_far()
                )
                if said and kind not in skipped:
                    skipped[kind] = float(said.group(1))
                for rank, p in enumerate(job.processes):
                    gone = p.proc.poll() is not None  # then its whole output is written
                    if (kind, rank) not in reported and "\nstratagem: " in "\n" + p.errors_so_far():
                        reported[(kind, rank)] = time.time()
                    if rank not in ended[kind] and gone:
                        ended[kind][rank] = (p.proc.returncode, time.time())
                        reported.setdefault((kind, rank), time.time())  # no report: see below
                if CASES[kind] == "busy" and 1 - SKIPPER in ended[kind] and kind not in released:
                    (root / kind / "resume").write_text("")
                    released[kind] = time.time()
            time.sleep(0.05)
        out: dict[str, list[Ended]] = {}
        for kind, job in jobs.items():
            results = [p.finish(ended[kind][r][0]) for r, p in enumerate(job.processes)]
            start = [skipped[kind], skipped[kind]]
            if kind in released:
                start[SKIPPER] = released[kind]
            out[kind] = [
                Ended(res, reported[(kind, r)] - start[r], ended[kind][r][1] - start[r])
                for r, res in enumerate(results)
            ]
        return out
    finally:
        for job in jobs.values():
            job.__exit__(None, None, None)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, list[Ended]]:
    return _run_all(tmp_path_factory.mktemp("hangs"))


def _report(stderr: str) -> str:
    """The block the process ended with (after its start line, ``[stratagem] worker 0 of ...``)."""
    _, marker, rest = ("\n" + stderr).partition("\nstratagem: ")
    assert marker, stderr
    return "stratagem: " + rest


def _name(rank: int, stderr: str) -> str:
    """``worker r (localhost:port)``, as the start lines say it."""
    found = re.search(rf"worker {rank} \(localhost:\d+\)", stderr)
    assert found, stderr
    return found.group(0)


def _check_one_block(report: str) -> None:
    assert "Traceback" not in report and ".cc:" not in report, report
    assert len(report.strip().splitlines()) <= 6, report
    # The user's line that issued the collective: the step, the replica's body, the barrier.
    assert re.search(r"raised at hang_reports\.py:\d+, in (step|replica|final_barrier)", report)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", [k for k, h in CASES.items() if h == "skip"])
def test_a_skipped_collective_is_named_by_both_workers_within_the_timeout(outcomes, kind):
    waiting, skipper = outcomes[kind]
    names = [_name(r, e.result.stderr) for r, e in enumerate(outcomes[kind])]
    numbers = []
    for me, ended in enumerate((waiting, skipper)):
        report = _report(ended.result.stderr)
        assert ended.result.returncode != 0
        assert report.startswith(f"stratagem: CollectiveTimeoutError on {names[me]}"), report
        # This process's operation, with its number, and where the other one is instead.
        # Timed out itself, or cut short by the other's timeout a moment before its own.
        mine = re.search(
            r"\(operation #(\d+)\) (timed out after 3s|was cut short on .* timed out waiting)",
            report,
        )
        other = re.search(
            rf"{re.escape(names[1 - me])} has not reached it: it is in #(\d+) \(", report
        )
        assert mine and other, report
        numbers.append((int(mine.group(1)), int(other.group(1))))
        _check_one_block(report)
        assert ended.reported <= OP_TIMEOUT_S + 5, (ended.reported, report)
        assert ended.exited <= OP_TIMEOUT_S + EXIT_SLACK_S, (ended.exited, report)
    # Each names the other's operation by the number the other reports for itself.
    assert numbers[0] == numbers[1][::-1], numbers
    assert "in final_barrier" in _report(skipper.result.stderr)


@pytest.mark.multiprocess
def test_a_worker_stuck_outside_collectives_is_named_and_ends_when_it_goes_on(outcomes):
    waiting, busy = outcomes["mwms"]
    names = [_name(r, e.result.stderr) for r, e in enumerate(outcomes["mwms"])]
    report = _report(waiting.result.stderr)
    assert waiting.result.returncode != 0
    assert report.startswith(f"stratagem: CollectiveTimeoutError on {names[0]}"), report
    op = re.search(r"all_reduce of gradients .*\(operation #(\d+)\) timed out after 3s", report)
    assert op, report
    assert re.search(
        rf"{re.escape(names[1])} has not reached it: it completed #(\d+) \(all_reduce of "
        r"gradients.*\) and has started no collective since",
        report,
    ), report
    _check_one_block(report)
    assert waiting.reported <= OP_TIMEOUT_S + 5, (waiting.reported, report)
    assert waiting.exited <= OP_TIMEOUT_S + EXIT_SLACK_S, (waiting.exited, report)
    # Let go, the stuck worker meets its peer gone at once, in the same operation.
    late = _report(busy.result.stderr)
    assert late.startswith(f"stratagem: PeerLostError on {names[1]}"), late
    assert f"{names[0]} was lost during all_reduce of gradients" in late
    assert f"(operation #{op.group(1)})" in late, late
    _check_one_block(late)
    assert busy.reported <= 5, (busy.reported, late)
    assert busy.exited <= EXIT_SLACK_S, (busy.exited, late)


# ------------------------------------------------------------------ the wording, in one process


def test_a_peer_s_position_says_how_it_stands_to_this_operation():
    mine = operation_position(13, "all_gather of the replicas' batch sizes")
    assert mine == "#13 (all_gather of the replicas' batch sizes)"
    assert whereabouts(mine, mine) is None  # in it too: not missing
    skipped = whereabouts(operation_position(13, "barrier of the end of training"), mine)
    assert skipped == (
        "has not reached it: it is in #13 (barrier of the end of training) instead, after as "
        "many operations (one of the two skipped a collective the other ran)"
    )
    behind = whereabouts(operation_position(11, "broadcast of x"), mine)
    assert behind == "has not reached it: it is in #11 (broadcast of x) instead"
    # Waiting in a collective of the script's own (no number): where the peer was last.
    last = whereabouts(operation_position(2, "barrier of z", done=True), None)
    assert last == (
        "was last in operation #2 (barrier of z) (the script's own collectives have no numbers)"
    )
    stuck = whereabouts(operation_position(12, "all_reduce of y", done=True), mine)
    assert stuck == (
        "has not reached it: it completed #12 (all_reduce of y) and has started no collective "
        "since (it is computing, or stuck outside collectives)"
    )


def test_a_timed_out_process_lingers_only_while_a_peer_waits_in_an_operation():
    waiting, done, timed_out = (LivenessServer("127.0.0.1") for _ in range(3))
    try:
        waiting.position = operation_position(5, "all_reduce of z")
        done.position = operation_position(5, "all_reduce of z", done=True)
        timed_out.status = TIMED_OUT
        start = time.monotonic()
        linger({1: done.address, 2: timed_out.address}, seconds=30)
        assert time.monotonic() - start < 5  # nobody will ask: no wait (30 s bounds a bug)
        start = time.monotonic()
        linger({1: waiting.address}, seconds=0.5)
        assert time.monotonic() - start >= 0.5  # it may still ask: the whole allowance
    finally:
        for server in (waiting, done, timed_out):
            server.close("ok")
