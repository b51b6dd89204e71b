"""The live table ``stratagem tune`` prints: a row as each trial starts and ends, and the best.

In a terminal the table refreshes in place: each ended trial's row is printed once, in the order
trials end, and below them the rows of the trials running now and the best trial so far are
redrawn (ANSI cursor-up and clear) as trials start and end; that live part is a few lines
(``parallel_trial_count`` + 1), so it always fits the screen. To a file or a pipe (a CI log)
nothing is redrawn: a row is appended as each trial starts and ends, each ended row followed by
the best trial so far.
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
        self._running: dict[str, Trial] = {}  # by id, in the order they started
        self._live_lines = 0  # lines of the part redrawn in place, on a terminal

    @property
    def in_place(self) -> bool:
        """Whether the table refreshes in place (its output is a terminal)."""
        try:
            return bool(self.out.isatty())
        except (AttributeError, OSError, ValueError):
            return False

    def _format(self, cells: list[str], note: str = "") -> str:
        text = "  ".join(c.ljust(w) for c, w in zip(cells, self.widths)).rstrip()
        return f"{text}  {note}".rstrip()

    def _line(self, cells: list[str], note: str = "") -> None:
        print(self._format(cells, note), file=self.out, flush=True)

    def header(self) -> None:
        if not self._header_done:
            self._header_done = True
            self._line(self.columns)

    def _row_text(self, trial: Trial) -> str:
        value = trial.final_measurement.get(self.metric_id)
        params: Mapping[str, Any] = trial.parameters
        cells = [trial.id, str(trial.state), format_cell(value)]
        cells += [format_cell(params.get(name)) for name in self.parameters]
        note = trial.error or "" if trial.state is not TrialState.SUCCEEDED else ""
        return self._format(cells, note)

    def row(self, trial: Trial) -> None:
        self.header()
        print(self._row_text(trial), file=self.out, flush=True)

    def _best_text(self) -> str | None:
        if self.best is None:
            return None
        best = self.best.final_measurement.get(self.metric_id)
        return f"  best so far: trial {self.best.id}, {self.metric_id}={format_cell(best)}"

    def __call__(self, event: str, trial: Trial) -> None:
        """The tuner's ``progress`` callback."""
        if self.in_place:
            self._refresh(event, trial)
            return
        self.row(trial)
        if event == "ended":
            self._update_best(trial)
            best = self._best_text()
            if best is not None:
                print(best, file=self.out, flush=True)

    def _refresh(self, event: str, trial: Trial) -> None:
        """On a terminal: erase the live part, print the ended trial's row for good, then draw
        the running trials and the best so far again."""
        text = f"\x1b[{self._live_lines}A\x1b[J" if self._live_lines else ""
        if not self._header_done:
            self._header_done = True
            text += self._format(self.columns) + "\n"
        if event == "ended":
            self._running.pop(trial.id, None)
            self._update_best(trial)
            text += self._row_text(trial) + "\n"
        else:
            self._running[trial.id] = trial
        live = [self._row_text(t) for t in self._running.values()]
        best = self._best_text()
        live += [best] if best is not None else []
        text += "".join(line + "\n" for line in live)
        self._live_lines = len(live)
        self.out.write(text)
        self.out.flush()

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
