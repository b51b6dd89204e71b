"""The live table ``stratagem tune`` prints: a row as each trial starts and ends, and the best.

Rows are appended, never redrawn, so the table reads the same in a terminal, a pipe or a CI
log; each ended row is followed by the best trial so far.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any, TextIO

from stratagem.tune.trials import Trial, TrialState


def format_cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


class TrialTable:
    """Prints trials of a study whose objective is ``metric_id`` (``goal``: maximize/minimize)."""

    def __init__(
        self, metric_id: str, goal: str, parameters: Iterable[str], out: TextIO | None = None
    ) -> None:
        self.metric_id = metric_id
        self.goal = goal
        self.parameters = list(parameters)
        self.out = out or sys.stdout
        self.columns = ["trial", "state", metric_id, *self.parameters]
        self.widths = [5, 9, *(max(9, len(c)) for c in self.columns[2:])]
        self.best: Trial | None = None
        self._header_done = False

    def _line(self, cells: list[str], note: str = "") -> None:
        text = "  ".join(c.ljust(w) for c, w in zip(cells, self.widths)).rstrip()
        print(f"{text}  {note}".rstrip(), file=self.out, flush=True)

    def header(self) -> None:
        if not self._header_done:
            self._header_done = True
            self._line(self.columns)

    def row(self, trial: Trial) -> None:
        self.header()
        value = trial.final_measurement.get(self.metric_id)
        params: Mapping[str, Any] = trial.parameters
        cells = [trial.id, str(trial.state), format_cell(value)]
        cells += [format_cell(params.get(name)) for name in self.parameters]
        note = trial.error or "" if trial.state is not TrialState.SUCCEEDED else ""
        self._line(cells, note)

    def __call__(self, event: str, trial: Trial) -> None:
        """The tuner's ``progress`` callback."""
        self.row(trial)
        if event == "ended":
            self._update_best(trial)
            if self.best is not None:
                best = self.best.final_measurement.get(self.metric_id)
                print(
                    f"  best so far: trial {self.best.id}, {self.metric_id}={format_cell(best)}",
                    file=self.out,
                    flush=True,
                )

    def _update_best(self, trial: Trial) -> None:
        value = trial.final_measurement.get(self.metric_id)
        if trial.state is not TrialState.SUCCEEDED or value is None:
            return
        if self.best is None:
            self.best = trial
            return
        best = self.best.final_measurement.get(self.metric_id)
        assert best is not None
        if (value > best) if self.goal == "maximize" else (value < best):
            self.best = trial
