"""A job's directory: where the platform tells the script to put its model, checkpoints and logs.

On Vertex AI the chief saves to the paths in ``AIP_MODEL_DIR``, ``AIP_CHECKPOINT_DIR`` and
``AIP_TENSORBOARD_LOG_DIR``; here they are folders of the job directory, handed to every task
under stratagem's names and, as aliases, under Vertex AI's, so that the seed's script runs as is.
"""

from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass
from pathlib import Path

#: stratagem's variable and its Vertex AI alias, for each directory a task is handed.
DIRECTORY_VARIABLES = {
    "model": ("STRATAGEM_MODEL_DIR", "AIP_MODEL_DIR"),
    "checkpoints": ("STRATAGEM_CHECKPOINT_DIR", "AIP_CHECKPOINT_DIR"),
    "tensorboard": ("STRATAGEM_TENSORBOARD_LOG_DIR", "AIP_TENSORBOARD_LOG_DIR"),
}
#: The job directory itself.
JOB_DIR_VARIABLE = "STRATAGEM_JOB_DIR"


def slug(display_name: str) -> str:
    """A display name made safe as a folder name: ``my job/1`` -> ``my-job-1``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", display_name).strip("-.") or "job"


def new_job_dir(base_output_dir: Path, display_name: str) -> Path:
    """A fresh folder ``<base>/<name>-<UTC time>[-n]`` that no other job uses."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    base_output_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{slug(display_name)}-{stamp}"
    for n in range(1000):
        path = base_output_dir / (stem if n == 0 else f"{stem}-{n}")
        try:
            path.mkdir()  # atomic: two jobs started in the same second get different folders
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"no free job directory named {stem}-<n> in {base_output_dir}")


@dataclass(frozen=True)
class JobDirectories:
    """The folders of one job; ``create`` makes them."""

    root: Path

    @property
    def model(self) -> Path:
        return self.root / "model"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def logs(self) -> Path:
        """Each task's output (``chief.log``, ``worker-1.log``) and the launcher's."""
        return self.root / "logs"

    @property
    def state_file(self) -> Path:
        return self.root / "job.json"

    def create(self) -> JobDirectories:
        for folder in (self.model, self.checkpoints, self.tensorboard, self.logs):
            folder.mkdir(parents=True, exist_ok=True)
        return self

    def environment(self) -> dict[str, str]:
        """The variables every task gets: absolute paths, valid whatever the task's cwd."""
        env = {JOB_DIR_VARIABLE: str(self.root.resolve())}
        for name, variables in DIRECTORY_VARIABLES.items():
            path = str((self.root / name).resolve())
            env.update(dict.fromkeys(variables, path))
        return env

    def model_saved(self) -> bool:
        """Whether the chief wrote anything to the model directory."""
        return self.model.is_dir() and any(os.scandir(self.model))
