"""A picture of a study, because people would rather look than read: ``study.png``.

Left, the objective of every trial by id (succeeded trials as dots, trials the median rule
stopped at their last report as triangles, failed ones as crosses on the axis) and the best so
far as a step line; right, each parameter's importance (Optuna's fANOVA evaluator) once enough
trials succeeded. matplotlib draws offline with its Agg backend.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from stratagem.tune.trials import Trial, TrialState

if TYPE_CHECKING:
    import optuna


def best_so_far(values: list[float | None], goal: str) -> list[float | None]:
    """The running best of ``values`` (None where no value yet)."""
    out: list[float | None] = []
    best: float | None = None
    for v in values:
        better = best is None or (v is not None and (v > best if goal == "maximize" else v < best))
        if v is not None and math.isfinite(v) and better:
            best = v
        out.append(best)
    return out


def importances(study: optuna.Study) -> dict[str, float]:
    """Optuna's parameter importances, or {} while too few trials succeeded to say."""
    import optuna

    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if len(done) < 2:
        return {}
    try:
        return optuna.importance.get_param_importances(study)
    except (RuntimeError, ValueError):  # e.g. every succeeded trial had the same parameters
        return {}


def plot_study(
    trials: list[Trial], study: optuna.Study, metric_id: str, goal: str, path: Path, title: str
) -> Path:
    """Draw the study to ``path`` (PNG); return it."""
    import matplotlib

    matplotlib.use("Agg", force=True)  # no display needed, nothing downloaded
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    ids = [int(t.id) for t in trials]
    values = [
        t.final_measurement.get(metric_id) if t.state is TrialState.SUCCEEDED else None
        for t in trials
    ]
    for state, marker, label in (
        (TrialState.SUCCEEDED, "o", "succeeded"),
        (TrialState.STOPPED, "v", "stopped (median rule)"),
    ):
        points = [
            (int(t.id), t.final_measurement.get(metric_id))
            for t in trials
            if t.state is state and t.final_measurement.get(metric_id) is not None
        ]
        if points:
            left.scatter(*zip(*points), marker=marker, label=label)
    failed = [int(t.id) for t in trials if t.state is TrialState.FAILED]
    if failed:
        finite = [v for v in values if v is not None and math.isfinite(v)]
        bottom = min(finite) if finite else 0.0
        left.scatter(failed, [bottom] * len(failed), marker="x", color="red", label="failed")
    best = best_so_far(values, goal)
    if any(b is not None for b in best):
        left.step(ids, [math.nan if b is None else b for b in best], where="post", label="best")
    left.set_xlabel("trial")
    left.set_ylabel(f"{metric_id} ({goal})")
    left.set_title("objective by trial")
    left.legend(loc="best", fontsize="small")

    scores = importances(study)
    if scores:
        names = list(scores)[::-1]
        right.barh(names, [scores[n] for n in names])
        right.set_xlabel("importance (fANOVA)")
    else:
        right.text(0.5, 0.5, "too few succeeded trials", ha="center", va="center")
        right.set_axis_off()
    right.set_title("parameter importance")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
