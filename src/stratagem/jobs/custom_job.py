"""``sg.jobs.CustomJob``: a script run as an N-task cluster job, as on Vertex AI, locally.

The job runs through the local launcher (``stratagem.cluster.launcher.run_job``): one chief and
``replica_count - 1`` workers (Vertex AI's worker pools: the first replica is the chief), plus
``ps_replica_count`` parameter servers. It gets a fresh job directory whose ``model``,
``checkpoints`` and ``tensorboard`` folders every task finds in ``STRATAGEM_MODEL_DIR``... and in
the ``AIP_*`` aliases; each task's output goes to ``logs/<task>.log``; ``job.json`` says the
state, times, exit reason and where the model is.
"""

from __future__ import annotations

import datetime
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stratagem.cluster import launcher
from stratagem.errors import StratagemError
from stratagem.jobs.directories import JobDirectories, new_job_dir
from stratagem.jobs.logs import FileConsole, task_log_name
from stratagem.jobs.state import JobState, write_json_atomic

#: Where jobs go when no ``base_output_dir`` is given (relative to the working directory).
DEFAULT_BASE_OUTPUT_DIR = "stratagem_jobs"
_FAILED_TASK = re.compile(r"^(chief|evaluator|worker \d+|ps \d+) failed")
_LOG_TAIL_LINES = 20


class JobConfigError(StratagemError, ValueError):
    """A job's arguments are invalid; nothing was started."""


class JobFailedError(StratagemError, RuntimeError):
    """A job ended without success; the message says why and where its logs are."""


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _check_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise JobConfigError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class JobResult:
    """How one run of a job ended."""

    state: JobState
    exit_code: int
    reason: str
    directories: JobDirectories


class CustomJob:
    """A training script run as a local cluster job, with Vertex AI's ``CustomJob`` arguments.

    ``args`` go to the script unchanged; ``environment_variables`` are added to every task's
    environment. ``base_output_dir`` (default ``./stratagem_jobs``) holds one folder per run.
    ``max_restarts`` and ``grace_period`` are the launcher's. ``accelerator_count`` (and
    ``accelerator_type``, recorded only) is Vertex AI's GPUs per machine: a job run here sees
    this machine's GPUs, and a tuning study with this job as its template gives each running
    trial its own ``accelerator_count`` of them (``devices_per_trial``).
    """

    def __init__(
        self,
        display_name: str,
        script_path: str | os.PathLike[str],
        args: Sequence[object] | None = None,
        replica_count: int = 1,
        ps_replica_count: int = 0,
        environment_variables: Mapping[str, str] | None = None,
        *,
        base_output_dir: str | os.PathLike[str] | None = None,
        max_restarts: int = 0,
        grace_period: float = 5.0,
        accelerator_type: str | None = None,
        accelerator_count: int = 0,
    ) -> None:
        if not isinstance(display_name, str) or not display_name.strip():
            raise JobConfigError(f"display_name must be a non-empty string, got {display_name!r}")
        script = Path(script_path)
        if not script.is_file():
            what = "is a directory" if script.is_dir() else "not found"
            raise JobConfigError(f"script_path {str(script)!r} {what}; expected a Python file")
        if args is not None and (isinstance(args, str) or not isinstance(args, Sequence)):
            raise JobConfigError(f"args must be a list of strings, got {args!r}")
        env = dict(environment_variables or {})
        bad_env = {k: v for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str)}
        if bad_env:
            raise JobConfigError(
                f"environment_variables must map strings to strings, got {bad_env!r}"
            )
        self.display_name = display_name
        self.script_path = script
        self.args = [str(a) for a in args or []]
        self.replica_count = _check_count("replica_count", replica_count, 1)
        self.ps_replica_count = _check_count("ps_replica_count", ps_replica_count, 0)
        self.environment_variables = env
        self.base_output_dir = Path(base_output_dir or DEFAULT_BASE_OUTPUT_DIR)
        self.max_restarts = _check_count("max_restarts", max_restarts, 0)
        self.accelerator_type = accelerator_type
        self.accelerator_count = _check_count("accelerator_count", accelerator_count, 0)
        self.grace_period = grace_period
        self.state = JobState.JOB_STATE_QUEUED
        self.job_dir: Path | None = None
        self.exit_code: int | None = None
        self.error: str | None = None  # the exit reason of a job that did not succeed

    @classmethod
    def from_local_script(
        cls,
        display_name: str,
        script_path: str | os.PathLike[str],
        args: Sequence[object] | None = None,
        replica_count: int = 1,
        ps_replica_count: int = 0,
        environment_variables: Mapping[str, str] | None = None,
        base_output_dir: str | os.PathLike[str] | None = None,
        accelerator_type: str | None = None,
        accelerator_count: int = 0,
    ) -> CustomJob:
        """Vertex AI's constructor of the same name; the script runs here, so no container."""
        return cls(
            display_name,
            script_path,
            args,
            replica_count,
            ps_replica_count,
            environment_variables,
            base_output_dir=base_output_dir,
            accelerator_type=accelerator_type,
            accelerator_count=accelerator_count,
        )

    @property
    def model_dir(self) -> Path | None:
        """The folder the chief saves the model to (``AIP_MODEL_DIR``), once the job ran."""
        return None if self.job_dir is None else JobDirectories(self.job_dir).model

    @property
    def log_dir(self) -> Path | None:
        return None if self.job_dir is None else JobDirectories(self.job_dir).logs

    def run(self, *, stream_logs: bool = True) -> CustomJob:
        """Run the job to its end; raise ``JobFailedError`` if it did not succeed.

        ``stream_logs``: print every task's output with its prefix (it goes to the log files
        in any case).
        """
        root = new_job_dir(self.base_output_dir, self.display_name).resolve()
        directories = JobDirectories(root)
        self.job_dir = directories.root
        result = self.execute(directories, stream_logs=stream_logs)
        self.state, self.exit_code = result.state, result.exit_code
        if result.state is not JobState.JOB_STATE_SUCCEEDED:
            self.error = result.reason
            raise JobFailedError(failure_message(self.display_name, result))
        return self

    def execute(
        self,
        directories: JobDirectories,
        *,
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        omp_threads: int | None = None,
        stream_logs: bool = True,
        interrupts: launcher.Interrupts | None = None,
    ) -> JobResult:
        """Run the job once in ``directories``, with ``extra_args`` after its own; never raises
        for the job's failure (the tuner runs trials with this and records how they ended).
        """
        directories.create()
        env = {**os.environ, **self.environment_variables, **directories.environment()}
        env.update(extra_env or {})
        if "OMP_NUM_THREADS" in self.environment_variables:  # the user's choice wins
            omp_threads = None
        state: dict[str, Any] = {
            "display_name": self.display_name,
            "script_path": str(self.script_path),
            "args": [*self.args, *extra_args],
            "replica_count": self.replica_count,
            "ps_replica_count": self.ps_replica_count,
            "model_dir": str(directories.model),
            "checkpoint_dir": str(directories.checkpoints),
            "tensorboard_log_dir": str(directories.tensorboard),
            "log_dir": str(directories.logs),
            "state": str(JobState.JOB_STATE_RUNNING),
            "start_time": _now(),
            "end_time": None,
            "exit_code": None,
            "exit_reason": None,
            "model_saved": False,
        }
        write_json_atomic(directories.state_file, state)
        console = FileConsole(directories.logs, stream=stream_logs)
        try:
            outcome = launcher.run_job(
                [str(self.script_path), *self.args, *extra_args],
                workers=self.replica_count - 1,
                chief=True,
                ps=self.ps_replica_count,
                max_restarts=self.max_restarts,
                grace_period=self.grace_period,
                python=sys.executable,
                console=console,
                base_env=env,
                omp_threads=omp_threads,
                interrupts=interrupts,
            )
        except launcher.LaunchError as exc:
            outcome = launcher.Outcome(2, str(exc))
        finally:
            console.close()
        if interrupts is not None and interrupts.signum is not None:
            job_state = JobState.JOB_STATE_CANCELLED
        elif outcome.exit_code == 0:
            job_state = JobState.JOB_STATE_SUCCEEDED
        else:
            job_state = JobState.JOB_STATE_FAILED
        state.update(
            state=str(job_state),
            end_time=_now(),
            exit_code=outcome.exit_code,
            exit_reason=outcome.reason,
            model_saved=directories.model_saved(),
        )
        write_json_atomic(directories.state_file, state)
        return JobResult(job_state, outcome.exit_code, outcome.reason, directories)


def failed_task_log(result: JobResult) -> Path | None:
    """The log file of the task whose failure ended the job, if the reason names one."""
    match = _FAILED_TASK.match(result.reason)
    if match is None:
        return None
    path = result.directories.logs / task_log_name(f"[{match.group(1)}] ")
    return path if path.exists() else None


def log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def failure_message(display_name: str, result: JobResult) -> str:
    """``job 'x' failed: worker 1 failed: exit code 3 ...; logs in DIR``, then the log's end."""
    what = "was cancelled" if result.state is JobState.JOB_STATE_CANCELLED else "failed"
    message = f"job {display_name!r} {what}: {result.reason}; logs in {result.directories.logs}"
    log = failed_task_log(result)
    if log is not None:
        message += f"\n--- last lines of {log.name}\n{log_tail(log)}"
    return message
