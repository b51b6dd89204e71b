"""Each trial in TensorBoard's HParams plugin, beside the trial's own scalars.

When a trial ends, its parameters and final objective go to its TensorBoard folder (the one its
script writes its scalars to, ``STRATAGEM_TENSORBOARD_LOG_DIR``) with
``SummaryWriter.add_hparams``, and its reported objective values as the scalar series
``trial/<metric>``; ``tensorboard --logdir <study>/trials`` then lists every trial in the
HParams tab. The study itself is Optuna's SQLite storage, which ``optuna-dashboard`` opens as it
is (``dashboard_commands``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stratagem.tune.report import Report


def write_trial_hparams(
    log_dir: Path,
    params: Mapping[str, Any],
    reports: Sequence[Report],
    metric_id: str,
    final_value: float | None,
) -> None:
    """Write one trial's hyperparameters, its objective's steps and final value to ``log_dir``."""
    from torch.utils.tensorboard import SummaryWriter

    steps = []
    with SummaryWriter(log_dir=str(log_dir)) as writer:
        for i, report in enumerate(r for r in reports if r.tag == metric_id):
            step = report.global_step if report.global_step is not None else i
            writer.add_scalar(f"trial/{metric_id}", report.value, step)
            steps.append(step)
        metrics = {f"hparam/{metric_id}": final_value} if final_value is not None else {}
        # run_name ".": in the trial's own folder, so that the plugin shows it with its scalars.
        writer.add_hparams(
            dict(params), metrics, run_name=".", global_step=max(steps) if steps else 0
        )


def dashboard_commands(storage_url: str, trials_dir: Path) -> list[str]:
    """The commands that show a study live: optuna-dashboard, and TensorBoard's HParams tab."""
    return [f"optuna-dashboard {storage_url}", f"tensorboard --logdir {trials_dir}"]
