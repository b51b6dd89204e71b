"""``sg.tune.HyperparameterTuningJob``: a study of trials, each a ``CustomJob`` run of the script.

One tuner thread (the caller's) owns the Optuna study, stored in SQLite under the study folder;
each running trial is a launcher job in a thread of its own. The tuner asks Optuna for
parameters (TPE, or random), starts up to ``parallel_trial_count`` trials with the values as
``--name value`` arguments, reads the metric file each trial's script reports to, passes the
intermediate reports to the median pruner (stopping a trial's job when it falls below the
median), and tells Optuna how each trial ended. Since every state change is in the database,
a tuner killed at any moment resumes: running it again marks the trials that were in flight as
failed (the tuner, not the script, failed them), runs their parameters again, and goes on to
``max_trial_count`` trials.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import signal
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from stratagem.cluster import launcher
from stratagem.errors import StratagemError
from stratagem.jobs.custom_job import CustomJob, JobResult, failed_task_log
from stratagem.jobs.directories import JobDirectories, slug
from stratagem.jobs.state import JobState, write_json_atomic
from stratagem.tune.parameter_specs import (
    ParameterSpec,
    check_parameter_spec,
    distributions,
    format_value,
    spec_to_json,
)
from stratagem.tune.report import METRIC_FILE_VARIABLE, Report, ReportReader
from stratagem.tune.search import check_search_algorithm, make_sampler
from stratagem.tune.trials import Trial, trial_from_optuna, trial_id

if TYPE_CHECKING:
    import optuna

GOALS = ("maximize", "minimize")
MEASUREMENT_SELECTIONS = ("best", "last")
# How often the tuner reads the trials' metric files when no trial has ended meanwhile.
_POLL_S = 0.05
_UNKNOWN_ARGUMENTS = "unrecognized arguments:"
_INTERRUPTED = "the tuner stopped while this trial ran; its parameters are run again"


class TuningConfigError(StratagemError, ValueError):
    """The arguments of a tuning job are invalid; nothing was started."""


class TuningError(StratagemError, RuntimeError):
    """A study cannot go on: every trial would fail the same way, or another tuner runs it."""


def _check_positive(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TuningConfigError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_metric_spec(metric_spec: object) -> tuple[str, str]:
    if not isinstance(metric_spec, Mapping) or len(metric_spec) != 1:
        raise TuningConfigError(
            f"metric_spec must name one metric and its goal, as {{'accuracy': 'maximize'}}; "
            f"got {metric_spec!r}"
        )
    ((metric, goal),) = metric_spec.items()
    if not isinstance(metric, str) or not metric:
        raise TuningConfigError(f"metric_spec: the metric must be a non-empty name, got {metric!r}")
    if goal not in GOALS:
        raise TuningConfigError(
            f"metric_spec: unknown goal {goal!r} for {metric!r}; expected 'maximize' or 'minimize'"
        )
    return metric, goal


@dataclass(eq=False)
class _Running:
    """A trial whose job runs in ``thread``; ``result`` is set when the job has ended."""

    trial: optuna.trial.Trial
    directories: JobDirectories
    reader: ReportReader
    interrupts: launcher.Interrupts
    thread: threading.Thread | None = None
    result: JobResult | None = None
    reports: list[Report] = field(default_factory=list)
    stopped: str | None = None  # why the median rule stopped it
    steps: set[int] = field(default_factory=set)  # steps already reported to Optuna


class HyperparameterTuningJob:
    """Vertex AI's ``HyperparameterTuningJob``, run locally with Optuna.

    ``custom_job`` is the trial template (script, args, replicas, environment).
    ``metric_spec`` names the metric the script reports and its goal; ``parameter_spec`` the
    search space (names are the script's ``--options``). ``search_algorithm`` None is Bayesian
    optimization (TPE), ``"random"`` random search. ``measurement_selection`` picks a trial's
    final value from its reports: the ``"best"`` (Vertex AI's default) or the ``"last"``.
    ``max_failed_trial_count`` > 0 stops the study after that many failed trials.

    stratagem's additions: the study lives in ``base_output_dir/<display_name>/`` (default: the
    custom job's base output dir), so running the same job again resumes it; ``seed`` makes the
    search reproducible; ``median_stopping`` stops a trial whose intermediate report is worse
    than the median of the other trials at the same step, once ``median_stopping_min_trials``
    trials finished and after ``median_stopping_warmup_steps`` steps.
    """

    def __init__(
        self,
        display_name: str,
        custom_job: CustomJob,
        metric_spec: Mapping[str, str],
        parameter_spec: Mapping[str, ParameterSpec],
        max_trial_count: int,
        parallel_trial_count: int,
        max_failed_trial_count: int = 0,
        search_algorithm: str | None = None,
        measurement_selection: str = "best",
        *,
        base_output_dir: str | os.PathLike[str] | None = None,
        seed: int | None = None,
        median_stopping: bool = True,
        median_stopping_min_trials: int = 3,
        median_stopping_warmup_steps: int = 0,
    ) -> None:
        if not isinstance(display_name, str) or not display_name.strip():
            raise TuningConfigError(
                f"display_name must be a non-empty string, got {display_name!r}"
            )
        if not isinstance(custom_job, CustomJob):
            raise TuningConfigError(
                f"custom_job must be a sg.jobs.CustomJob (the trial template), got {custom_job!r}"
            )
        if measurement_selection not in MEASUREMENT_SELECTIONS:
            raise TuningConfigError(
                f"unknown measurement_selection {measurement_selection!r}; expected 'best' or "
                "'last'"
            )
        try:
            check_search_algorithm(search_algorithm)
        except ValueError as exc:
            raise TuningConfigError(str(exc)) from None
        self.display_name = display_name
        self.custom_job = custom_job
        self.metric_id, self.goal = _check_metric_spec(metric_spec)
        self.parameter_spec = check_parameter_spec(parameter_spec)
        self.max_trial_count = _check_positive("max_trial_count", max_trial_count, 1)
        self.parallel_trial_count = _check_positive("parallel_trial_count", parallel_trial_count, 1)
        self.max_failed_trial_count = _check_positive(
            "max_failed_trial_count", max_failed_trial_count, 0
        )
        self.search_algorithm = search_algorithm
        self.measurement_selection = measurement_selection
        self.seed = seed
        self.median_stopping = median_stopping
        self.median_stopping_min_trials = _check_positive(
            "median_stopping_min_trials", median_stopping_min_trials, 1
        )
        self.median_stopping_warmup_steps = _check_positive(
            "median_stopping_warmup_steps", median_stopping_warmup_steps, 0
        )
        base = Path(base_output_dir) if base_output_dir else custom_job.base_output_dir
        self.study_dir = (base / slug(display_name)).resolve()
        self.state = JobState.JOB_STATE_QUEUED
        self._wake = threading.Event()

    # --- where the study is ------------------------------------------------------------------

    @property
    def storage_url(self) -> str:
        return f"sqlite:///{self.study_dir / 'study.db'}"

    def threads_per_task(self) -> int:
        """OMP_NUM_THREADS of each task, so parallel trials x tasks do not oversubscribe."""
        tasks = self.custom_job.replica_count + self.custom_job.ps_replica_count
        parallel = min(self.parallel_trial_count, self.max_trial_count)
        return max(1, launcher._usable_cpus() // (parallel * tasks))

    @property
    def trials(self) -> list[Trial]:
        """Every trial of the study so far, by id (also of an earlier run of the study)."""
        study = self._load_existing()
        if study is None:
            return []
        notes = study.user_attrs.get("notes", {})
        return [trial_from_optuna(t, self.metric_id, notes) for t in study.get_trials()]

    @property
    def best_trial(self) -> Trial | None:
        """The succeeded trial with the best final value (None before any succeeded)."""
        done = [t for t in self.trials if t.final_measurement.get(self.metric_id) is not None]
        done = [t for t in done if t.state == "SUCCEEDED"]
        if not done:
            return None
        key = lambda t: t.final_measurement.get(self.metric_id)  # noqa: E731
        return max(done, key=key) if self.goal == "maximize" else min(done, key=key)

    def plot(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Draw the study (objective by trial, best so far, parameter importance) to a PNG.

        Default path: ``study.png`` in the study folder. Returns the path written.
        """
        from stratagem.tune.plot import plot_study

        study = self._load_existing()
        if study is None:
            raise TuningError(f"study {self.display_name!r} has no trials yet in {self.study_dir}")
        trials = self.trials
        target = Path(path) if path is not None else self.study_dir / "study.png"
        title = f"{self.display_name}: {len(trials)} trials"
        return plot_study(trials, study, self.metric_id, self.goal, target, title)

    # --- running the study -------------------------------------------------------------------

    def run(self, progress: Callable[[str, Trial], None] | None = None) -> HyperparameterTuningJob:
        """Run (or resume) the study to ``max_trial_count`` trials; return this job.

        ``progress(event, trial)`` is called with ``"started"`` and ``"ended"`` for each trial.
        Raises ``TuningError`` when the study cannot go on (the script does not accept a
        parameter, or ends without reporting the metric); the trials in flight are then
        stopped and recorded as failed, to be run again by the next run.
        """
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.study_dir.mkdir(parents=True, exist_ok=True)
        with open(self.study_dir / "tuner.lock", "a+") as lock:
            self._lock(lock)
            study = self._open_study()
            self._recover_interrupted(study)
            self.state = JobState.JOB_STATE_RUNNING
            try:
                self._run_trials(study, progress or (lambda event, trial: None))
            except KeyboardInterrupt:
                self.state = JobState.JOB_STATE_CANCELLED
                raise
            except BaseException:
                self.state = JobState.JOB_STATE_FAILED
                raise
            else:
                self.state = JobState.JOB_STATE_SUCCEEDED
            finally:
                self._write_summary(study)
        return self

    def _lock(self, lock: IO[str]) -> None:
        # flock is released by the kernel when the holder dies, even by SIGKILL: a killed tuner
        # never blocks the next one.
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "?"
            raise TuningError(
                f"study {self.display_name!r} in {self.study_dir} is being run by another tuner "
                f"(pid {holder})"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(str(os.getpid()))
        lock.flush()

    def _space_json(self) -> dict[str, Any]:
        return {
            "metric_spec": {self.metric_id: self.goal},
            "parameter_spec": {k: spec_to_json(v) for k, v in self.parameter_spec.items()},
        }

    def _load_existing(self) -> optuna.Study | None:
        import optuna

        if not (self.study_dir / "study.db").exists():
            return None
        try:
            return optuna.load_study(study_name=self.display_name, storage=self.storage_url)
        except KeyError:  # the database exists, this study is not in it (yet)
            return None

    def _open_study(self) -> optuna.Study:
        import optuna

        direction = self.goal
        pruner = (
            optuna.pruners.MedianPruner(
                n_startup_trials=self.median_stopping_min_trials,
                n_warmup_steps=self.median_stopping_warmup_steps,
            )
            if self.median_stopping
            else optuna.pruners.NopPruner()
        )
        storage = optuna.storages.RDBStorage(
            self.storage_url, engine_kwargs={"connect_args": {"timeout": 60}}
        )
        study = optuna.create_study(
            storage=storage,
            study_name=self.display_name,
            direction=direction,
            pruner=pruner,
            load_if_exists=True,
        )
        space = self._space_json()
        stored = study.user_attrs.get("space")
        if stored is None:
            study.set_user_attr("space", space)
        elif stored != json.loads(json.dumps(space)):
            raise TuningError(
                f"study {self.display_name!r} in {self.study_dir} was created with {stored}, "
                f"not {space}; give this search another display_name or base_output_dir"
            )
        # A resumed study must not replay the first run's random draws: offset the seed.
        seed = None if self.seed is None else self.seed + len(study.get_trials(deepcopy=False))
        study.sampler = make_sampler(self.search_algorithm, seed, self.max_trial_count)
        return study

    def _recover_interrupted(self, study: optuna.Study) -> None:
        """Trials left running by a tuner that died: failed by the tuner, run again."""
        from optuna.trial import TrialState

        stale = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if not stale:
            return
        notes = dict(study.user_attrs.get("notes", {}))
        interrupted = list(study.user_attrs.get("interrupted", []))
        for frozen in stale:
            study.tell(frozen.number, state=TrialState.FAIL)
            notes[str(frozen.number)] = _INTERRUPTED
            interrupted.append(frozen.number)
            study.enqueue_trial(frozen.params)
        study.set_user_attr("notes", notes)
        study.set_user_attr("interrupted", sorted(interrupted))

    def _counted(self, study: optuna.Study) -> tuple[int, int]:
        """(trials that count toward max_trial_count, of which failed), interrupted ones aside."""
        from optuna.trial import TrialState

        interrupted = set(study.user_attrs.get("interrupted", []))
        ended = [
            t
            for t in study.get_trials(
                deepcopy=False,
                states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL),
            )
            if t.number not in interrupted
        ]
        return len(ended), sum(t.state == TrialState.FAIL for t in ended)

    def _run_trials(self, study: optuna.Study, progress: Callable[[str, Trial], None]) -> None:
        space = distributions(self.parameter_spec)
        running: dict[int, _Running] = {}
        counted, failed = self._counted(study)
        try:
            while True:
                for r in list(running.values()):
                    self._read_reports(r)
                    if r.result is None:
                        continue
                    assert r.thread is not None
                    r.thread.join()
                    del running[r.trial.number]
                    counted += 1
                    failed += self._end_trial(study, r)
                    progress("ended", self._view(study, r.trial.number))
                    if self.max_failed_trial_count and failed >= self.max_failed_trial_count:
                        raise TuningError(
                            f"{failed} trials failed (max_failed_trial_count="
                            f"{self.max_failed_trial_count}); the last: trial "
                            f"{trial_id(r.trial.number)} in {r.directories.root}"
                        )
                while (
                    len(running) < self.parallel_trial_count
                    and counted + len(running) < self.max_trial_count
                ):
                    r = self._start_trial(study, space)
                    running[r.trial.number] = r
                    progress("started", self._view(study, r.trial.number))
                if not running:
                    return
                self._wake.wait(_POLL_S)
                self._wake.clear()
        finally:
            if running:
                self._stop_all(study, running)

    def _view(self, study: optuna.Study, number: int) -> Trial:
        frozen = study.get_trials(deepcopy=False)[number]
        return trial_from_optuna(frozen, self.metric_id, study.user_attrs.get("notes", {}))

    def _start_trial(self, study: optuna.Study, space: Mapping[str, Any]) -> _Running:
        trial = study.ask(dict(space))
        directories = JobDirectories(self.study_dir / "trials" / trial_id(trial.number))
        directories.create()
        metric_file = directories.root / "metrics.jsonl"
        metric_file.unlink(missing_ok=True)  # a folder left by an interrupted run
        trial.set_user_attr("job_dir", str(directories.root))
        args = []
        for name in self.parameter_spec:
            args += [f"--{name}", format_value(trial.params[name])]
        env = {
            METRIC_FILE_VARIABLE: str(metric_file),
            "STRATAGEM_TRIAL_ID": trial_id(trial.number),
            "CLOUD_ML_TRIAL_ID": trial_id(trial.number),  # Vertex AI's name
            "STRATAGEM_STUDY_NAME": self.display_name,
        }
        r = _Running(trial, directories, ReportReader(metric_file), launcher.Interrupts())
        omp_threads = self.threads_per_task()

        def run() -> None:
            try:
                r.result = self.custom_job.execute(
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

    def _read_reports(self, r: _Running) -> None:
        """Take in new reports; give the objective's to Optuna's pruner, stop the trial if told."""
        for report in r.reader.read_new():
            r.reports.append(report)
            if report.tag != self.metric_id or not math.isfinite(report.value):
                continue
            step = report.global_step
            if step is None:  # numbered by report order, as steps must be for the median rule
                step = sum(x.tag == self.metric_id for x in r.reports) - 1
            if step in r.steps or r.stopped is not None:
                continue
            r.steps.add(step)
            r.trial.report(report.value, step)
            if r.result is None and r.trial.should_prune():
                r.stopped = (
                    f"stopped by the median rule at step {step}: {self.metric_id}="
                    f"{report.value:.6g} is worse than the median of the other trials there"
                )
                r.interrupts(signal.SIGTERM, None)  # the job stops its tasks, as on a signal

    def _final_measurement(self, r: _Running) -> dict[str, Any] | None:
        objective = [x for x in r.reports if x.tag == self.metric_id]
        if not objective:
            return None
        if self.measurement_selection == "last":
            chosen = objective[-1]
        else:
            pick = max if self.goal == "maximize" else min
            # A NaN never wins; all NaN, and the trial fails on its non-finite value.
            finite = [x for x in objective if math.isfinite(x.value)] or objective
            chosen = pick(finite, key=lambda x: x.value)
        metrics = {x.tag: x.value for x in r.reports}  # the last value of every other tag
        metrics[self.metric_id] = chosen.value
        return {"step_count": chosen.global_step, "metrics": metrics}

    def _end_trial(self, study: optuna.Study, r: _Running) -> int:
        """Tell Optuna how the trial ended; return 1 if it failed. Raise for a setup error."""
        from optuna.trial import TrialState

        assert r.result is not None
        trial, result = r.trial, r.result
        final = self._final_measurement(r)
        if final is not None:
            trial.set_user_attr("final_measurement", final)
        if r.stopped is not None:
            trial.set_user_attr("error", r.stopped)
            study.tell(trial, state=TrialState.PRUNED)
            return 0
        if result.state is JobState.JOB_STATE_SUCCEEDED:
            if final is None:
                tags = sorted({x.tag for x in r.reports})
                message = (
                    f"trial {trial_id(trial.number)}: the script exited 0 but never reported "
                    f"metric {self.metric_id!r} (it reported {tags or 'nothing'}); call "
                    f"sg.tune.report_hyperparameter_tuning_metric(hyperparameter_metric_tag="
                    f"{self.metric_id!r}, metric_value=..., global_step=...)"
                )
                trial.set_user_attr("error", message)
                study.tell(trial, state=TrialState.FAIL)
                raise TuningError(message)
            value = final["metrics"][self.metric_id]
            if not math.isfinite(value):
                trial.set_user_attr("error", f"reported {self.metric_id}={value!r}")
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
                f"parameter {name!r} is not accepted by script {str(self.custom_job.script_path)!r}"
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
                for name in self.parameter_spec:
                    if f"--{name}" in refused:
                        return name, line
        return None

    def _stop_all(self, study: optuna.Study, running: Mapping[int, _Running]) -> None:
        """Stop the trials in flight; record them as failed by the tuner, to be run again."""
        from optuna.trial import TrialState

        for r in running.values():
            r.interrupts(signal.SIGTERM, None)
        for r in running.values():
            assert r.thread is not None
            r.thread.join()
        notes = dict(study.user_attrs.get("notes", {}))
        interrupted = list(study.user_attrs.get("interrupted", []))
        for number, r in running.items():
            study.tell(r.trial, state=TrialState.FAIL)
            notes[str(number)] = _INTERRUPTED
            interrupted.append(number)
            study.enqueue_trial(r.trial.params)
        study.set_user_attr("notes", notes)
        study.set_user_attr("interrupted", sorted(interrupted))

    def _write_summary(self, study: optuna.Study) -> None:
        """``study.json``: the state and every trial, for people and programs that read files."""
        notes = study.user_attrs.get("notes", {})
        trials = [trial_from_optuna(t, self.metric_id, notes) for t in study.get_trials()]
        best = self.best_trial
        write_json_atomic(
            self.study_dir / "study.json",
            {
                "display_name": self.display_name,
                "state": str(self.state),
                "metric_spec": {self.metric_id: self.goal},
                "max_trial_count": self.max_trial_count,
                "parallel_trial_count": self.parallel_trial_count,
                "best_trial": None if best is None else best.id,
                "trials": [
                    {
                        "id": t.id,
                        "state": str(t.state),
                        "parameters": dict(t.parameters),
                        "final_measurement": {
                            m.metric_id: m.value for m in t.final_measurement.metrics
                        },
                        "error": t.error,
                        "job_dir": None if t.job_dir is None else str(t.job_dir),
                    }
                    for t in trials
                ],
            },
        )
