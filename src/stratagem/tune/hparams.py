"""Each trial in TensorBoard's HParams plugin, beside the trial's own scalars.

A trial's TensorBoard folder (the one its script writes its scalars to,
``STRATAGEM_TENSORBOARD_LOG_DIR``) is ``<study>/tensorboard/trial-<n>``, so that
``tensorboard --logdir <study>/tensorboard`` names each run ``trial-<n>``, the number the table
and optuna-dashboard show. When a trial ends, its parameters, its state (``trial_state``:
SUCCEEDED, STOPPED by the median rule, FAILED) and its final objective, under the objective's
own name, go there with ``SummaryWriter.add_hparams``, and its reported objective values as the
scalar series ``trial/<metric>``. The study itself is Optuna's SQLite storage, which
``optuna-dashboard`` opens as it is (``dashboard_commands``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stratagem.tune.report import MetricReport

#: The hyperparameter that holds the trial's state, unless a parameter has that name.
STATE_HPARAM = "trial_state"


def trial_run_name(number: int) -> str:
    """The trial's run in TensorBoard (its folder under ``<study>/tensorboard``)."""
    return f"trial-{number}"


def write_trial_hparams(
    log_dir: Path,
    params: Mapping[str, Any],
    reports: Sequence[MetricReport],
    metric_id: str,
    final_value: float | None,
    state: str,
) -> None:
    """Write one trial's hyperparameters, its state, its objective's steps and final value to
    ``log_dir``."""
    from torch.utils.tensorboard import SummaryWriter

    steps = []
    with SummaryWriter(log_dir=str(log_dir)) as writer:
        for i, report in enumerate(r for r in reports if r.tag == metric_id):
            step = report.global_step if report.global_step is not None else i
            writer.add_scalar(f"trial/{metric_id}", report.value, step)
            steps.append(step)
        metrics = {metric_id: final_value} if final_value is not None else {}
        hparams = dict(params)
        hparams.setdefault(STATE_HPARAM, state)  # a stopped trial is told from a finished one
        # run_name ".": in the trial's own folder, so that the plugin shows it with its scalars.
        writer.add_hparams(hparams, metrics, run_name=".", global_step=max(steps) if steps else 0)


def dashboard_commands(storage_url: str, tensorboard_dir: Path) -> list[str]:
    """The commands that show a study live: optuna-dashboard, and TensorBoard's HParams tab."""
    return [f"optuna-dashboard {storage_url}", f"tensorboard --logdir {tensorboard_dir}"]
