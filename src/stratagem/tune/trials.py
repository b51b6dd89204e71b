"""A study's trials as the seed reads them: ``trial.id``, ``trial.parameters``, ``trial.state``,
``trial.final_measurement.metrics`` (each with ``.metric_id`` and ``.value``).

Vertex AI returns protobuf messages; these are plain frozen dataclasses built from Optuna's
stored trials, so they read the same and print readably. ``parameters`` is a dict name -> value
(Vertex AI's is a list of ``parameter_id``/``value`` pairs; docs/porting.md says so).
Also here: the best trial of a study, and a trial's entry in ``study.json``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import optuna
    from optuna.trial import FrozenTrial


class TrialState(str, enum.Enum):
    """Vertex AI's trial states; ``STOPPED`` is a trial the median rule ended early, ``FAILED``
    one whose script failed or never reported (Vertex AI's ``INFEASIBLE``)."""

    REQUESTED = "REQUESTED"
    ACTIVE = "ACTIVE"
    SUCCEEDED = "SUCCEEDED"
    STOPPED = "STOPPED"
    FAILED = "FAILED"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class TrialMetric:
    """One metric of a measurement (Vertex AI's ``Measurement.Metric``; ``sg.tune.Metric``)."""

    metric_id: str
    value: float


@dataclass(frozen=True)
class Measurement:
    """The metrics of one step; an empty ``metrics`` for a trial that measured nothing."""

    step_count: int | None = None
    metrics: tuple[TrialMetric, ...] = ()

    def get(self, metric_id: str) -> float | None:
        return next((m.value for m in self.metrics if m.metric_id == metric_id), None)


@dataclass(frozen=True)
class Trial:
    id: str
    parameters: Mapping[str, Any]
    state: TrialState
    final_measurement: Measurement
    measurements: tuple[Measurement, ...] = ()  # the intermediate reports of the objective
    job_dir: Path | None = None  # the trial's job directory: logs/, model/, job.json
    error: str | None = None  # why a trial failed or was stopped
    number: int = field(default=0, repr=False)  # Optuna's trial number (the id, as an int)


def trial_id(number: int) -> str:
    """A trial's id: Optuna's trial number, from 0, which optuna-dashboard shows. Vertex AI
    numbers from 1; one numbering everywhere (the table, the logs, the trial's folder,
    TensorBoard's run, the dashboard) matters more (the README's porting table says so)."""
    return str(number)


def trial_from_optuna(frozen: FrozenTrial, metric_id: str, notes: Mapping[str, str]) -> Trial:
    """The seed-shaped view of a stored trial; ``notes`` are reasons kept at the study level."""
    from optuna.trial import TrialState as OptunaState

    state = {
        OptunaState.WAITING: TrialState.REQUESTED,
        OptunaState.RUNNING: TrialState.ACTIVE,
        OptunaState.COMPLETE: TrialState.SUCCEEDED,
        OptunaState.PRUNED: TrialState.STOPPED,
        OptunaState.FAIL: TrialState.FAILED,
    }[frozen.state]
    attrs = frozen.user_attrs
    final = attrs.get("final_measurement")
    if final is not None:
        metrics = tuple(TrialMetric(k, float(v)) for k, v in sorted(final["metrics"].items()))
        final_measurement = Measurement(final["step_count"], metrics)
    else:
        final_measurement = Measurement()
    measurements = tuple(
        Measurement(step, (TrialMetric(metric_id, value),))
        for step, value in sorted(frozen.intermediate_values.items())
    )
    job_dir = attrs.get("job_dir")
    return Trial(
        id=trial_id(frozen.number),
        parameters=dict(frozen.params),
        state=state,
        final_measurement=final_measurement,
        measurements=measurements,
        job_dir=Path(job_dir) if job_dir else None,
        error=attrs.get("error") or notes.get(str(frozen.number)),
        number=frozen.number,
    )


def study_trials(study: optuna.Study, metric_id: str) -> list[Trial]:
    """Every trial of ``study``, by id: ``job.trials``."""
    notes = study.user_attrs.get("notes", {})
    return [trial_from_optuna(t, metric_id, notes) for t in study.get_trials()]


def study_trial(study: optuna.Study, number: int, metric_id: str) -> Trial:
    """Trial ``number`` of ``study``, as it is now."""
    frozen = study.get_trials(deepcopy=False)[number]
    return trial_from_optuna(frozen, metric_id, study.user_attrs.get("notes", {}))


def best_trial(trials: Sequence[Trial], metric_id: str, goal: str) -> Trial | None:
    """The succeeded trial with the best final value (None before any succeeded)."""
    done = [t for t in trials if t.final_measurement.get(metric_id) is not None]
    done = [t for t in done if t.state == "SUCCEEDED"]
    if not done:
        return None
    key = lambda t: t.final_measurement.get(metric_id)  # noqa: E731
    return max(done, key=key) if goal == "maximize" else min(done, key=key)


def trial_summary(trial: Trial) -> dict[str, Any]:
    """A trial's entry in ``study.json``."""
    return {
        "id": trial.id,
        "state": str(trial.state),
        "parameters": dict(trial.parameters),
        "final_measurement": {m.metric_id: m.value for m in trial.final_measurement.metrics},
        "error": trial.error,
        "job_dir": None if trial.job_dir is None else str(trial.job_dir),
    }
