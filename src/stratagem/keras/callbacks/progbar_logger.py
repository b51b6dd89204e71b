"""``ProgbarLogger``: Keras's progress bar and epoch lines, printed by the chief."""

from __future__ import annotations

import sys
import time
from typing import Any

from stratagem.keras.callbacks.callback import Callback, Logs, format_logs, is_chief


class ProgbarLogger(Callback):
    """Keras's progress output, on the chief only.

    ``verbose=1``: a bar per epoch with step count, ETA and running metrics, redrawn in place
    in a terminal (a line every 10% otherwise); ``verbose=2``: one line per epoch.
    """

    def __init__(self, verbose: int = 1, stream: Any = None) -> None:
        super().__init__()
        self.verbose = verbose
        self.stream = stream
        self._start = 0.0
        self._last_printed = -1

    def _out(self) -> Any:
        return self.stream or sys.stdout

    @property
    def needs_batch_logs(self) -> bool:
        return self.verbose == 1

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        self._start = time.monotonic()
        self._last_printed = -1
        if self.verbose and is_chief(self.model):
            print(f"Epoch {epoch + 1}/{self.params.get('epochs', '?')}", file=self._out())

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        if self.verbose != 1 or not is_chief(self.model):
            return
        steps = self.params.get("steps")
        done = batch + 1
        elapsed = time.monotonic() - self._start
        out = self._out()
        tty = getattr(out, "isatty", lambda: False)()
        if steps:
            decile = done * 10 // steps
            if not tty and decile == self._last_printed and done != steps:
                return
            self._last_printed = decile
            eta = elapsed / done * (steps - done)
            width = 30
            filled = width * done // steps
            tip = ">" if filled < width else "="
            bar = "=" * max(0, filled - 1) + tip + "." * (width - filled)
            head = f"{done}/{steps} [{bar}] - ETA: {eta:.0f}s"
        else:
            head = f"{done}/unknown - {elapsed:.0f}s"
        line = f"{head} - {format_logs(logs or {})}"
        print(("\r" + line) if tty else line, end="" if tty else "\n", file=out, flush=True)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if not self.verbose or not is_chief(self.model):
            return
        out = self._out()
        if self.verbose == 1 and getattr(out, "isatty", lambda: False)():
            print(file=out)
        seconds = time.monotonic() - self._start
        print(f"{seconds:.1f}s - {format_logs(logs or {})}", file=out, flush=True)
