"""``ProgbarLogger``: Keras 3's progress bar and epoch lines (``keras/src/utils/progbar.py``),
printed by the chief, for ``fit`` and for ``evaluate``:

    Epoch 1/3
    70/70 ━━━━━━━━━━━━━━━━━━━━ 2s 28ms/step - accuracy: 0.9100 - loss: 0.2900
"""

from __future__ import annotations

import math
import re
import sys
import time
from typing import Any

from stratagem.keras.callbacks.callback import Callback, Logs, is_chief
from stratagem.keras.callbacks.straggler_notes import StragglerNotes

_WIDTH = 20  # Keras 3's bar width


class ProgbarLogger(Callback):
    """Keras 3's progress output, on the chief only.

    ``verbose=1``: a bar per epoch, the step count, the ETA (the elapsed time once done), the
    time per step (the first, warm-up step left out, as Keras) and the metrics so far. In a
    terminal it is redrawn in place after every batch, in Keras's colours; written to a file or
    a pipe only the finished line is printed, without colours (Keras 3 writes its in-place
    redraws, backspaces and colour codes into files too). ``verbose=2``: one line per epoch,
    ``70/70 - 2s - 28ms/step - accuracy: 0.9100 - loss: 0.2900``. ``Epoch i/n`` heads each
    epoch when there are several, as in Keras. ``evaluate`` draws the same bar over its
    batches; the validation inside ``fit`` draws none (Keras's ``_called_in_fit``).
    """

    def __init__(self, verbose: int = 1, stream: Any = None) -> None:
        super().__init__()
        self.verbose = verbose
        self.stream = stream
        self._start = 0.0
        self._first: tuple[float, int] | None = None  # when the first batches ended, and how many
        self._seen = 0
        self._width = 0  # of the last line drawn in place
        self._in_fit = False  # fit's validation calls the test hooks too: no bar for it
        self._stragglers = StragglerNotes()

    def _out(self) -> Any:
        return self.stream or sys.stdout

    def _tty(self) -> bool:
        return bool(getattr(self._out(), "isatty", lambda: False)())

    @property
    def needs_batch_logs(self) -> bool:
        # Batch logs are a collective per step under multi-worker strategies: only a bar drawn
        # in place shows them. Only the chief draws, and its output may be a terminal where the
        # others' is a pipe (`stratagem run` in a terminal): the model agrees on every worker's
        # answer once per fit or evaluate (``step_runner.agreed_batch_logs``).
        return self.verbose == 1 and self._tty() and is_chief(self.model)

    @property
    def needs_test_batch_logs(self) -> bool:
        return not self._in_fit and self.needs_batch_logs

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self._in_fit = True

    def on_train_end(self, logs: Logs | None = None) -> None:
        self._in_fit = False

    def on_test_begin(self, logs: Logs | None = None) -> None:
        if not self._in_fit:
            self._start, self._first, self._seen, self._width = time.time(), None, 0, 0

    def on_test_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        if not self._in_fit:
            self.on_train_batch_end(batch, logs)

    def on_test_end(self, logs: Logs | None = None) -> None:
        if not self._in_fit:
            self._finish(logs)

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        self._start, self._first, self._seen, self._width = time.time(), None, 0, 0
        epochs = self.params.get("epochs", 1)
        if self.verbose and is_chief(self.model) and epochs > 1:
            print(f"Epoch {epoch + 1}/{epochs}", file=self._out(), flush=True)

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        self._seen = batch + 1
        if self._first is None:
            self._first = (time.time(), self._seen)
        if self.verbose == 1 and self._tty() and is_chief(self.model):
            self._draw(self._seen, logs or {}, final=False)
        self._name_stragglers()

    def _name_stragglers(self) -> None:
        """A straggler the strategy named (``straggler_notes``): one line, once, under the bar
        (which is then redrawn below it)."""
        fresh = self._stragglers.fresh(self.model)
        if fresh:
            self._under_bar([f"straggler: {line}" for line in fresh])

    def note(self, line: str) -> bool:
        """A line about the job (an elastic job's change of workers), under the bar as a
        straggler's; whether it was printed here (on the chief, when verbose)."""
        return self._under_bar([line])

    def _under_bar(self, lines: list[str]) -> bool:
        if not self.verbose or not is_chief(self.model):
            return False
        out = self._out()
        if self._width:  # a bar drawn in place: end its line first
            _print("", out)
            self._width = 0
        for line in lines:
            _print(line, out)
        return True

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        self._finish(logs)

    def _finish(self, logs: Logs | None) -> None:
        """The epoch's (or the evaluation's) finished line."""
        if not self.verbose or not is_chief(self.model):
            return
        target = self.params.get("steps") or self._seen
        if self.verbose == 1:
            self._draw(target, logs or {}, final=True)
        else:
            count = f"{target:{_digits(target)}d}/{target}"
            line = f"{count} - {time.time() - self._start:.0f}s -{self._per_step(target)}"
            line += "".join(f" - {k}: {_value(v, signed=False)}" for k, v in (logs or {}).items())
            print(line, file=self._out(), flush=True)

    def _per_step(self, current: int) -> str:
        now = time.time()
        if not current:
            per = 0.0
        elif self._first is not None and current > self._first[1]:
            per = (now - self._first[0]) / (current - self._first[1])
        else:
            per = (now - self._start) / current
        return _format_time(per)

    def _draw(self, current: int, logs: Logs, *, final: bool) -> None:
        tty = self._tty()
        target = self.params.get("steps")
        bold, green, grey, reset = (
            ("\x1b[1m", "\33[32m", "\33[37m", "\x1b[0m") if tty else ("",) * 4
        )
        if target:
            count = f"{current:{_digits(target)}d}/{target}"
            filled = int(_WIDTH * current / target)
            bar = f"{bold}{count}{reset} "
            if filled > 0:
                bar += f"{green}{'━' * filled}{reset}"
            bar += f"{grey}{'━' * (_WIDTH - filled)}{reset}"
        else:
            bar = f"{current:7d}/Unknown"
        if target and not final:
            per = time.time() - self._start
            eta = per / max(current, 1) * (target - current)
            info = f" {bold}{_format_eta(eta)}{reset}"
        else:
            info = f" {bold}{time.time() - self._start:.0f}s{reset}"
        info += self._per_step(current)
        info += "".join(f" - {k}: {_value(v, signed=True)}" for k, v in logs.items())
        line = bar + info
        out = self._out()
        if tty:
            visible = len(_strip(line))
            pad = " " * max(0, self._width - visible)
            _print("\r" + line + pad, out, end="\n" if final else "")
            self._width = visible
        elif final:
            _print(line, out)


def _print(line: str, out: Any, end: str = "\n") -> None:
    try:
        print(line, end=end, file=out, flush=True)
    except UnicodeEncodeError:  # a stream that cannot write the bar's character (Keras too)
        print(line.replace("━", "="), end=end, file=out, flush=True)


def _digits(target: int) -> int:
    return int(math.log10(target)) + 1 if target > 0 else 1


def _value(v: Any, *, signed: bool) -> str:
    """Keras's number format: 4 decimals above 1e-3, else scientific (verbose=1 compares the
    absolute value, verbose=2 the value itself, as Keras's two branches do)."""
    if not isinstance(v, int | float):
        return f"{v}"
    big = abs(v) > 1e-3 if signed else v > 1e-3
    return f"{v:.4f}" if big else f"{v:.4e}"


def _format_time(per_step: float) -> str:
    if per_step >= 1 or per_step == 0:
        return f" {per_step:.0f}s/step"
    if per_step >= 1e-3:
        return f" {per_step * 1e3:.0f}ms/step"
    return f" {per_step * 1e6:.0f}us/step"


def _format_eta(eta: float) -> str:
    seconds = int(eta)
    if eta > 3600:
        return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
    if eta > 60:
        return f"{seconds // 60}:{seconds % 60:02d}"
    return f"{seconds}s"


def _strip(line: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", line)
