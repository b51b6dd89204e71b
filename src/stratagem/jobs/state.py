"""The state of a job, kept in ``job.json`` in its directory and rewritten atomically.

Names follow Vertex AI's ``JobState`` so that code checking ``job.state`` ports unchanged.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class JobState(str, enum.Enum):
    """Where a job is: queued until it starts, then running, then one of the three ends."""

    JOB_STATE_QUEUED = "JOB_STATE_QUEUED"
    JOB_STATE_RUNNING = "JOB_STATE_RUNNING"
    JOB_STATE_SUCCEEDED = "JOB_STATE_SUCCEEDED"
    JOB_STATE_FAILED = "JOB_STATE_FAILED"
    JOB_STATE_CANCELLED = "JOB_STATE_CANCELLED"

    def __str__(self) -> str:
        return self.value


def write_json_atomic(path: Path, data: Mapping[str, Any]) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename.

    A reader (a test, ``stratagem tune``'s table, another process) sees the old file or the
    new one, never half of one, even if this process dies in the middle.
    """
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
