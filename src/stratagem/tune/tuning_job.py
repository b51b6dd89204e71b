"""``sg.tune.HyperparameterTuningJob``: a study of trials, each a ``CustomJob`` run of the script.

The job checks its arguments when made; ``run`` takes the study's lock, opens (or resumes) the
Optuna study stored in SQLite under the study folder (``study.py``), sets its sampler
(``search.py``), has the scheduler run the trials (``scheduling.py``: parallel launcher jobs,
their reports, the median rule) and writes ``study.json``. ``job.trials`` and ``job.best_trial``
read the stored study as the seed reads it (``trials.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stratagem.cluster import launcher
from stratagem.jobs.custom_job import CustomJob
from stratagem.jobs.directories import slug
from stratagem.jobs.state import JobState, write_json_atomic
from stratagem.tune import scheduling
from stratagem.tune.errors import TuningConfigError, TuningError
from stratagem.tune.gpu_groups import device_groups
from stratagem.tune.parameter_specs import ParameterSpec, check_parameter_spec, spec_to_json
from stratagem.tune.report import MEASUREMENT_SELECTIONS
from stratagem.tune.search import check_search_algorithm, make_sampler
from stratagem.tune.study import (
    load_study,
    open_study,
    recover_interrupted,
    resumed_seed,
    storage_url,
    study_lock,
)
from stratagem.tune.trials import Trial, best_trial, study_trials, trial_summary

if TYPE_CHECKING:
    import optuna

__all__ = ["HyperparameterTuningJob", "TuningConfigError", "TuningError"]

GOALS = ("maximize", "minimize")


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
    ``devices_per_trial=k`` gives each running trial its own ``k`` GPUs through
    ``CUDA_VISIBLE_DEVICES`` (the visible GPUs cut into groups of ``k``; there must be enough
    for ``parallel_trial_count`` trials at once); 0 leaves the GPUs alone. The default is the
    template's ``accelerator_count`` (Vertex AI's ``CustomJob.from_local_script(...,
    accelerator_count=2)``: 2 GPUs per trial), 0 unless set. On CPU, the cores are divided
    between parallel trials' tasks either way.
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
        devices_per_trial: int | None = None,
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
        if devices_per_trial is None:  # Vertex AI's spelling: the trial template's GPU count
            devices_per_trial = custom_job.accelerator_count
        self.devices_per_trial = _check_positive("devices_per_trial", devices_per_trial, 0)
        # Decided now, from this process's environment, so a machine too small fails at once.
        self.device_groups = (
            device_groups(
                os.environ, devices_per_trial, min(self.parallel_trial_count, self.max_trial_count)
            )
            if devices_per_trial
            else []
        )
        base = Path(base_output_dir) if base_output_dir else custom_job.base_output_dir
        self.study_dir = (base / slug(display_name)).resolve()
        self.state = JobState.JOB_STATE_QUEUED

    # --- where the study is ------------------------------------------------------------------

    @property
    def storage_url(self) -> str:
        return storage_url(self.study_dir)

    def threads_per_task(self) -> int:
        """OMP_NUM_THREADS of each task, so parallel trials x tasks do not oversubscribe."""
        return scheduling.threads_per_task(
            self.custom_job, self.parallel_trial_count, self.max_trial_count
        )

    @property
    def trials(self) -> list[Trial]:
        """Every trial of the study so far, by id (also of an earlier run of the study)."""
        study = load_study(self.study_dir, self.display_name)
        if study is None:
            return []
        return study_trials(study, self.metric_id)

    @property
    def best_trial(self) -> Trial | None:
        """The succeeded trial with the best final value (None before any succeeded)."""
        return best_trial(self.trials, self.metric_id, self.goal)

    def plot(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Draw the study (objective by trial, best so far, parameter importance) to a PNG.

        Default path: ``study.png`` in the study folder. Returns the path written.
        """
        from stratagem.tune.plot import plot_study

        study = load_study(self.study_dir, self.display_name)
        if study is None:
            raise TuningError(f"study {self.display_name!r} has no trials yet in {self.study_dir}")
        trials = self.trials
        target = Path(path) if path is not None else self.study_dir / "study.png"
        title = f"{self.display_name}: {launcher.plural(len(trials), 'trial')}"
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
        with study_lock(self.study_dir, self.display_name):
            pruner = scheduling.median_pruner(
                self.median_stopping,
                self.median_stopping_min_trials,
                self.median_stopping_warmup_steps,
            )
            study = open_study(
                self.study_dir,
                self.display_name,
                self.goal,
                pruner,
                self._space_json(),
                self.metric_id,
            )
            seed = resumed_seed(self.seed, study)
            study.sampler = make_sampler(self.search_algorithm, seed, self.max_trial_count)
            recover_interrupted(study)
            self.state = JobState.JOB_STATE_RUNNING
            scheduler = scheduling.TrialScheduler(
                self, study, progress or (lambda event, trial: None)
            )
            try:
                scheduler.run()
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

    def _space_json(self) -> dict[str, Any]:
        return {
            "metric_spec": {self.metric_id: self.goal},
            "parameter_spec": {k: spec_to_json(v) for k, v in self.parameter_spec.items()},
        }

    def _write_summary(self, study: optuna.Study) -> None:
        """``study.json``: the state and every trial, for people and programs that read files."""
        trials = study_trials(study, self.metric_id)
        best = best_trial(trials, self.metric_id, self.goal)
        write_json_atomic(
            self.study_dir / "study.json",
            {
                "display_name": self.display_name,
                "state": str(self.state),
                "metric_spec": {self.metric_id: self.goal},
                "max_trial_count": self.max_trial_count,
                "parallel_trial_count": self.parallel_trial_count,
                "best_trial": None if best is None else best.id,
                "trials": [trial_summary(t) for t in trials],
            },
        )
