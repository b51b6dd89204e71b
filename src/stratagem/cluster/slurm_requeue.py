"""Requeue the SLURM job this process belongs to (``scontrol requeue``), as Lightning does.

A job submitted with ``#SBATCH --signal=USR1@90`` (and ``--requeue``) gets SIGUSR1 90 s before
its time limit; the training saves a checkpoint (``sg.train.PreemptionCheckpointHandler`` with
``sg.train.slurm_requeue_config()``), then the chief runs ``scontrol requeue <job>`` and the
job starts again later from that checkpoint. Array jobs are requeued by
``<array job id>_<task id>``, as Lightning's ``SLURMEnvironment`` names them.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping

from stratagem.errors import ClusterConfigError


def slurm_job_id(environ: Mapping[str, str] | None = None) -> str:
    """``SLURM_JOB_ID``, or ``<SLURM_ARRAY_JOB_ID>_<SLURM_ARRAY_TASK_ID>`` for an array task."""
    env = os.environ if environ is None else environ
    array_job = env.get("SLURM_ARRAY_JOB_ID", "").strip()
    if array_job:
        return f"{array_job}_{env.get('SLURM_ARRAY_TASK_ID', '').strip()}"
    job = env.get("SLURM_JOB_ID", "").strip()
    if not job:
        raise ClusterConfigError(
            "cannot requeue: SLURM_JOB_ID is not set, so this process is not part of a SLURM job"
        )
    return job


def requeue_command(environ: Mapping[str, str] | None = None) -> list[str]:
    """``["scontrol", "requeue", <job id>]`` for this process's job."""
    return ["scontrol", "requeue", slurm_job_id(environ)]


def requeue_job(
    environ: Mapping[str, str] | None = None,
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
) -> None:
    """Run ``scontrol requeue``; raise ``ClusterConfigError`` naming the job when it fails."""
    command = requeue_command(environ)
    try:
        done = run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ClusterConfigError(f"{' '.join(command)} could not run: {e}") from None
    if done.returncode != 0:
        raise ClusterConfigError(
            f"{' '.join(command)} exited {done.returncode}: {(done.stderr or '').strip()}"
        )
