"""``stratagem.comm.gloo_drain``: a job's process lets gloo's worker threads finish their last
work before the interpreter shuts down (a thread dropping it after that aborts the process).
The race itself is measured by ``benchmarks/exit_aborts.py`` (5 aborts in 80 exits without the
wait, none in 80 with it, alternating, on the 2-core machine); here, what the wait must do."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cluster_utils import WORKERS, child_env, run_cluster

pytestmark = pytest.mark.multiprocess


def test_without_gloo_threads_the_wait_returns_at_once():
    # In a process of its own: this one may hold groups of earlier tests.
    code = (
        "from stratagem.comm.gloo_drain import wait_for_gloo_threads\n"
        "assert wait_for_gloo_threads(limit_s=0.0)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_wait_sees_the_threads_settle_and_does_not_wait_for_a_blocked_collective(tmp_path):
    results = run_cluster(WORKERS / "gloo_drain_check.py", 2, tmp_path, args=[str(tmp_path)])
    for i, r in enumerate(results):
        r.check(f"worker {i}")
    reports = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for report in reports:
        # Two groups (the default one and the held one), two worker threads each.
        assert report["threads"] == 4, report
        assert report["after_collectives"] and report["at_the_end"], report
        assert set(report["states"]) <= {"S", "D"}, report
    # True, not the limit's False: the thread blocked in the pending collective counted as
    # sleeping, so the wait ended before its limit, with the collective still pending (it can
    # only complete once the wait has returned: rank 1 joins it after that). No clock needed.
    blocked = reports[0]
    assert blocked["while_blocked"] and not blocked["pending_done_then"], blocked
