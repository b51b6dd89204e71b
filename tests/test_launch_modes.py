"""The same worker script under SLURM's variables (faked on this machine), end to end."""

from __future__ import annotations

import sys

import pytest

from cluster_utils import WORKERS, Process, child_env, free_ports

pytestmark = pytest.mark.multiprocess


def test_a_two_task_slurm_step_trains(tmp_path):
    base = free_ports(1)[0]
    procs = []
    for rank in range(2):
        env = child_env(
            {
                "SLURM_PROCID": str(rank),
                "SLURM_NTASKS": "2",
                "SLURM_LOCALID": str(rank),
                "SLURM_STEP_ID": "0",
                "SLURM_STEP_NODELIST": "localhost",
                "SLURM_STEP_TASKS_PER_NODE": "2",
                "STRATAGEM_PORT": str(base),
                "MODE": "ok",
            }
        )
        argv = [sys.executable, str(WORKERS / "faults.py")]
        procs.append(Process(argv, env, tmp_path, f"t{rank}"))
    results = [p.wait(timeout=120) for p in procs]
    for r in results:
        r.check("slurm task")
        assert "done" in r.stdout
    assert "worker 0 joined" in results[0].stdout and "worker 1 joined" in results[1].stdout
