"""The trial script's side: ``report_hyperparameter_tuning_metric`` (Vertex AI's ``hypertune``).

The tuner names a file in ``STRATAGEM_TUNE_METRIC_FILE``; each report appends one JSON line to
it (one ``write`` of a short line in append mode, so the tuner reading it as it grows never sees
half a report). In a multi-worker trial only the chief reports: every worker computes the same
metric, and one study must not count it N times. Standard library only, so that reporting
costs a trial script nothing at start-up.

The tuner's side reads the reports back: ``ReportReader`` as the file grows, and
``final_measurement`` picks a trial's value from them when it ends.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stratagem.errors import StratagemError

#: The file the tuner reads; set in every task of a trial.
METRIC_FILE_VARIABLE = "STRATAGEM_TUNE_METRIC_FILE"
#: How a trial's final value is picked from its reports (``final_measurement``).
MEASUREMENT_SELECTIONS = ("best", "last")


class ReportError(StratagemError, ValueError):
    """A report's arguments are invalid."""


@dataclass(frozen=True)
class MetricReport:
    """One reported value: ``global_step`` None when the script gave none."""

    tag: str
    value: float
    global_step: int | None
    time: float


def _is_chief() -> bool:
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return True  # not in a cluster: a single process is its own chief
    from stratagem.cluster.roles import is_chief

    config = json.loads(raw)
    task = config.get("task") or {}
    return is_chief(task.get("type"), task.get("index"), config.get("cluster") or {})


def report_hyperparameter_tuning_metric(
    hyperparameter_metric_tag: str,
    metric_value: float,
    global_step: int | None = None,
) -> None:
    """Report the trial's metric (``metric_value`` of ``hyperparameter_metric_tag``).

    Call it once at the end, or after every epoch: intermediate reports let the tuner stop a
    trial that does worse than the median of the others at the same ``global_step``. Outside a
    tuning trial it prints the report instead.
    """
    if not isinstance(hyperparameter_metric_tag, str) or not hyperparameter_metric_tag:
        raise ReportError(
            f"hyperparameter_metric_tag must be a non-empty string, "
            f"got {hyperparameter_metric_tag!r}"
        )
    try:
        value = float(metric_value)  # also a 0-d tensor or numpy value
    except (TypeError, ValueError):
        raise ReportError(
            f"metric_value must be a number, got {metric_value!r} for {hyperparameter_metric_tag!r}"
        ) from None
    step = None
    if global_step is not None:
        try:
            step = int(global_step)  # model.optimizer.iterations.numpy() in the seed
        except (TypeError, ValueError):
            raise ReportError(f"global_step must be an int, got {global_step!r}") from None
        if step < 0:
            raise ReportError(f"global_step must be >= 0, got {step}")
    if not _is_chief():
        return
    path = os.environ.get(METRIC_FILE_VARIABLE)
    if not path:
        print(
            f"[stratagem] not in a tuning trial ({METRIC_FILE_VARIABLE} is unset): "
            f"{hyperparameter_metric_tag}={value!r} at step {step} is not recorded",
            file=sys.stderr,
        )
        return
    line = json.dumps(
        {
            "tag": hyperparameter_metric_tag,
            "value": value if math.isfinite(value) else repr(value),
            "global_step": step,
            "time": time.time(),
        }
    )
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


class HyperTune:
    """``hypertune.HyperTune()`` of the seed: the same report, as a method."""

    def report_hyperparameter_tuning_metric(
        self,
        hyperparameter_metric_tag: str,
        metric_value: float,
        global_step: int | None = None,
    ) -> None:
        report_hyperparameter_tuning_metric(hyperparameter_metric_tag, metric_value, global_step)


class ReportReader:
    """Reads the reports appended to a metric file since the last call (complete lines only)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def read_new(self) -> list[MetricReport]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        self._offset += end
        reports = []
        for raw in data[:end].splitlines():
            item = json.loads(raw)
            reports.append(
                MetricReport(item["tag"], float(item["value"]), item["global_step"], item["time"])
            )
        return reports


def final_measurement(
    reports: Sequence[MetricReport], metric_id: str, goal: str, measurement_selection: str
) -> dict[str, Any] | None:
    """A trial's ``{"step_count", "metrics"}`` from its reports; None if it never reported
    ``metric_id``. The objective's value is the ``"best"`` for ``goal`` or the ``"last"``."""
    objective = [x for x in reports if x.tag == metric_id]
    if not objective:
        return None
    if measurement_selection == "last":
        chosen = objective[-1]
    else:
        pick = max if goal == "maximize" else min
        # A NaN never wins; all NaN, and the trial fails on its non-finite value.
        finite = [x for x in objective if math.isfinite(x.value)] or objective
        chosen = pick(finite, key=lambda x: x.value)
    metrics = {x.tag: x.value for x in reports}  # the last value of every other tag
    metrics[metric_id] = chosen.value
    return {"step_count": chosen.global_step, "metrics": metrics}
