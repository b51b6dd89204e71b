"""Running a study's trials: up to ``parallel_trial_count`` launcher jobs at once.

One tuner thread (the caller's) owns the Optuna study; each running trial is a launcher job in a
thread of its own. The scheduler asks Optuna for parameters (its sampler: TPE, or random),
starts up to ``parallel_trial_count`` trials with the values as ``--name value`` arguments and
the machine's threads divided between their tasks, reads the metric file each trial's script
reports to, passes the intermediate reports to the median pruner (stopping a trial's job when it
falls below the median), and tells Optuna how each trial ended.
"""

from __future__ import annotations

import math
import signal
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from stratagem.cluster import launcher
from stratagem.jobs.custom_job import CustomJob, JobResult, failed_task_log
from stratagem.jobs.directories import JobDirectories
from stratagem.jobs.state import JobState
from stratagem.tune.errors import TuningError
from stratagem.tune.hparams import trial_run_name, write_trial_hparams
from stratagem.tune.parameter_specs import ParameterSpec, distributions, format_value
from stratagem.tune.report import (
    METRIC_FILE_VARIABLE,
    MetricReport,
    ReportReader,
    final_measurement,
)
from stratagem.tune.study import counted, requeue
from stratagem.tune.trials import Trial, study_trial, trial_id

if TYPE_CHECKING:
    import optuna


class TrialDirectories(JobDirectories):
    """A trial's job folders (``<study>/trials/<n>``), but for TensorBoard's: the study's
    ``tensorboard/trial-<n>``, so that TensorBoard names the run by the trial."""

    @property
    def tensorboard(self) -> Path:
        return self.root.parent.parent / "tensorboard" / trial_run_name(int(self.root.name))


# How often the tuner reads the trials' metric files when no trial has ended meanwhile.
_POLL_S = 0.05
_UNKNOWN_ARGUMENTS = "unrecognized arguments:"


def threads_per_task(custom_job: CustomJob, parallel_trial_count: int, max_trial_count: int) -> int:
    """OMP_NUM_THREADS of each task, so parallel trials x tasks do not oversubscribe."""
    tasks = custom_job.replica_count + custom_job.ps_replica_count
    parallel = min(parallel_trial_count, max_trial_count)
    return max(1, launcher.usable_cpus() // (parallel * tasks))


def median_pruner(
    median_stopping: bool, min_trials: int, warmup_steps: int
) -> optuna.pruners.BasePruner:
    """The median rule (after ``min_trials`` finished trials and ``warmup_steps``), or none."""
    import optuna

    if not median_stopping:
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=min_trials, n_warmup_steps=warmup_steps)


class TrialPlan(Protocol):
    """What the scheduler reads of a study's job: a ``HyperparameterTuningJob`` is one. The
    scheduler sits below the job that runs it, so it names only these members."""

    display_name: str
    custom_job: CustomJob  # the trial template
    metric_id: str
    goal: str  # "maximize" or "minimize"
    measurement_selection: str  # "best" or "last"
    parameter_spec: Mapping[str, ParameterSpec]
    max_trial_count: int
    parallel_trial_count: int
    max_failed_trial_count: int
    device_groups: list[str]  # a CUDA_VISIBLE_DEVICES value per trial that may run at once
    study_dir: Path

    def threads_per_task(self) -> int: ...


@dataclass(eq=False)
class RunningTrial:
    """A trial whose job runs in ``thread``; ``result`` is set when the job has ended."""

    trial: optuna.trial.Trial
    directories: JobDirectories
    reader: ReportReader
    interrupts: launcher.Interrupts
    thread: threading.Thread | None = None
    result: JobResult | None = None
    reports: list[MetricReport] = field(default_factory=list)
    stopped: str | None = None  # why the median rule stopped it
    steps: set[int] = field(default_factory=set)  # steps already reported to Optuna
    devices: str | None = None  # its CUDA_VISIBLE_DEVICES, with devices_per_trial


class TrialScheduler:
    """Runs the trials of ``job``'s ``study`` until ``job.max_trial_count`` of them count.

    ``progress(event, trial)`` is called with ``"started"`` and ``"ended"`` for each trial.
    """

    def __init__(
        self,
        job: TrialPlan,
        study: optuna.Study,
        progress: Callable[[str, Trial], None],
    ) -> None:
        self.job = job
        self.study = study
        self.progress = progress
        self._wake = threading.Event()
        self._free_devices = list(job.device_groups)  # each running trial holds one group

    def run(self) -> None:
        """Run trials to the count; stop and requeue those in flight if anything goes wrong."""
        job, study = self.job, self.study
        space = distributions(job.parameter_spec)
        running: dict[int, RunningTrial] = {}
        count, failed = counted(study)
        try:
            while True:
                for r in list(running.values()):
                    # Whether the job had ended before this read: then the read takes in all it
                    # reported. Checked after the read, a job ending in between would lose its
                    # last reports (a loaded machine widens that gap).
                    ended = r.result is not None
                    self._read_reports(r)
                    if not ended:
                        continue
                    assert r.thread is not None
                    r.thread.join()
                    del running[r.trial.number]
                    self._release_devices(r)
                    count += 1
                    failed += self._end_trial(r)
                    self.progress("ended", study_trial(study, r.trial.number, job.metric_id))
                    if job.max_failed_trial_count and failed >= job.max_failed_trial_count:
                        raise TuningError(
                            f"{launcher.plural(failed, 'trial')} failed (max_failed_trial_count="
                            f"{job.max_failed_trial_count}); the last: trial "
                            f"{trial_id(r.trial.number)} in {r.directories.root}"
                        )
                while (
                    len(running) < job.parallel_trial_count
                    and count + len(running) < job.max_trial_count
                ):
                    r = self._start_trial(space)
                    running[r.trial.number] = r
                    self.progress("started", study_trial(study, r.trial.number, job.metric_id))
                if not running:
                    return
                self._wake.wait(_POLL_S)
                self._wake.clear()
        finally:
            if running:
                self._stop_all(running)

    def _start_trial(self, space: Mapping[str, Any]) -> RunningTrial:
        job = self.job
        trial = self.study.ask(dict(space))
        directories = TrialDirectories(job.study_dir / "trials" / trial_id(trial.number))
        directories.create()
        metric_file = directories.root / "metrics.jsonl"
        metric_file.unlink(missing_ok=True)  # a folder left by an interrupted run
        trial.set_user_attr("job_dir", str(directories.root))
        args = []
        for name in job.parameter_spec:
            args += [f"--{name}", format_value(trial.params[name])]
        env = {
            METRIC_FILE_VARIABLE: str(metric_file),
            "STRATAGEM_TRIAL_ID": trial_id(trial.number),
            "CLOUD_ML_TRIAL_ID": trial_id(trial.number),  # Vertex AI's name
            "STRATAGEM_STUDY_NAME": job.display_name,
        }
        r = RunningTrial(trial, directories, ReportReader(metric_file), launcher.Interrupts())
        if self.job.device_groups:
            # The scheduler never runs more trials than groups (checked when the job is made).
            r.devices = self._free_devices.pop(0)
            env["CUDA_VISIBLE_DEVICES"] = r.devices
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # the numbers nvidia-smi shows
            trial.set_user_attr("cuda_visible_devices", r.devices)
        omp_threads = job.threads_per_task()

        def run() -> None:
            try:
                r.result = job.custom_job.execute(
                    directories,
                    extra_args=args,
                    extra_env=env,
                    omp_threads=omp_threads,
                    stream_logs=False,
                    interrupts=r.interrupts,
                )
            except Exception as exc:  # recorded as the trial's failure, never lost in a thread
                r.result = JobResult(JobState.JOB_STATE_FAILED, 1, repr(exc), directories)
            finally:
                self._wake.set()

        r.thread = threading.Thread(
            target=run, name=f"stratagem-trial-{trial_id(trial.number)}", daemon=True
        )
        r.thread.start()
        return r

    def _release_devices(self, r: RunningTrial) -> None:
        if r.devices is not None:
            self._free_devices.append(r.devices)
            # In the machine's order again, so which trial gets which group is reproducible.
            self._free_devices.sort(key=self.job.device_groups.index)

    def _read_reports(self, r: RunningTrial) -> None:
        """Take in new reports; give the objective's to Optuna's pruner, stop the trial if told."""
        metric_id = self.job.metric_id
        for report in r.reader.read_new():
            r.reports.append(report)
            if report.tag != metric_id or not math.isfinite(report.value):
                continue
            step = report.global_step
            if step is None:  # numbered by report order, as steps must be for the median rule
                step = sum(x.tag == metric_id for x in r.reports) - 1
            if step in r.steps or r.stopped is not None:
                continue
            r.steps.add(step)
            r.trial.report(report.value, step)
            if r.result is None and r.trial.should_prune():
                r.stopped = (
                    f"stopped by the median rule at step {step}: {metric_id}="
                    f"{report.value:.6g} is worse than the median of the other trials there"
                )
                r.interrupts(signal.SIGTERM, None)  # the job stops its tasks, as on a signal

    def _end_trial(self, r: RunningTrial) -> int:
        """Tell Optuna how the trial ended; return 1 if it failed. Raise for a setup error."""
        from optuna.trial import TrialState

        job, study = self.job, self.study
        assert r.result is not None
        trial, result = r.trial, r.result
        final = final_measurement(r.reports, job.metric_id, job.goal, job.measurement_selection)
        if final is not None:
            trial.set_user_attr("final_measurement", final)
        value = final["metrics"].get(job.metric_id) if final is not None else None
        if r.stopped is not None:
            state = "STOPPED"
        elif result.state is JobState.JOB_STATE_SUCCEEDED and value is not None:
            state = "SUCCEEDED" if math.isfinite(value) else "FAILED"
        else:
            state = "FAILED"
        write_trial_hparams(
            r.directories.tensorboard, trial.params, r.reports, job.metric_id, value, state
        )
        if r.stopped is not None:
            trial.set_user_attr("error", r.stopped)
            study.tell(trial, state=TrialState.PRUNED)
            return 0
        if result.state is JobState.JOB_STATE_SUCCEEDED:
            if final is None:
                tags = sorted({x.tag for x in r.reports})
                message = (
                    f"trial {trial_id(trial.number)}: the script exited 0 but never reported "
                    f"metric {job.metric_id!r} (it reported {tags or 'nothing'}); call "
                    f"sg.tune.report_hyperparameter_tuning_metric(hyperparameter_metric_tag="
                    f"{job.metric_id!r}, metric_value=..., global_step=...)"
                )
                trial.set_user_attr("error", message)
                study.tell(trial, state=TrialState.FAIL)
                raise TuningError(message)
            value = final["metrics"][job.metric_id]
            if not math.isfinite(value):
                trial.set_user_attr("error", f"reported {job.metric_id}={value!r}")
                study.tell(trial, state=TrialState.FAIL)
                return 1
            study.tell(trial, value)
            return 0
        log = failed_task_log(result)
        unknown = self._unknown_parameter(log)
        message = f"{result.reason}; log: {log or result.directories.logs}"
        trial.set_user_attr("error", message)
        study.tell(trial, state=TrialState.FAIL)
        if unknown is not None:
            name, line = unknown
            raise TuningError(
                f"parameter {name!r} is not accepted by script {str(job.custom_job.script_path)!r}"
                f" (trial {trial_id(trial.number)}: {line.strip()}); the names in parameter_spec "
                f"must be the script's command-line options (--{name})"
            )
        return 1

    def _unknown_parameter(self, log: Path | None) -> tuple[str, str] | None:
        """The parameter argparse refused in a failed trial's log, and its error line."""
        if log is None:
            return None
        for line in log.read_text(errors="replace").splitlines():
            if _UNKNOWN_ARGUMENTS in line:
                refused = line.split(_UNKNOWN_ARGUMENTS, 1)[1].split()
                for name in self.job.parameter_spec:
                    if f"--{name}" in refused:
                        return name, line
        return None

    def _stop_all(self, running: Mapping[int, RunningTrial]) -> None:
        """Stop the trials in flight; record them as failed by the tuner, to be run again."""
        for r in running.values():
            r.interrupts(signal.SIGTERM, None)
        for r in running.values():
            assert r.thread is not None
            r.thread.join()
        requeue(self.study, {number: r.trial.params for number, r in running.items()})
