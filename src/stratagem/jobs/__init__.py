"""Training jobs: a script run as a local N-task cluster job, with Vertex AI's names.

``sg.jobs.CustomJob(display_name, script_path, args, replica_count, ps_replica_count,
environment_variables).run()`` runs the script through the launcher in a fresh job directory
and hands every task the model, checkpoint and TensorBoard folders (``STRATAGEM_*_DIR`` and the
seed's ``AIP_*_DIR``). Imports no torch.
"""

from __future__ import annotations

from stratagem.jobs.custom_job import (
    CustomJob,
    JobConfigError,
    JobFailedError,
    JobResult,
)
from stratagem.jobs.directories import DIRECTORY_VARIABLES, JOB_DIR_VARIABLE, JobDirectories
from stratagem.jobs.state import JobState

__all__ = [
    "DIRECTORY_VARIABLES",
    "JOB_DIR_VARIABLE",
    "CustomJob",
    "JobConfigError",
    "JobDirectories",
    "JobFailedError",
    "JobResult",
    "JobState",
]
