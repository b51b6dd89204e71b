"""``CSVLogger``: the epoch logs as CSV rows, written by the chief."""

from __future__ import annotations

import csv
import os
from typing import IO, Any

from stratagem.keras.callbacks.callback import Callback, Logs, is_chief


class CSVLogger(Callback):
    """One CSV row per epoch (``epoch`` then the logs, sorted), written by the chief."""

    def __init__(self, filename: str, separator: str = ",", append: bool = False) -> None:
        super().__init__()
        self.filename = os.fspath(filename)
        self.separator = separator
        self.append = append
        self._file: IO[str] | None = None
        self._writer: Any = None
        self._keys: list[str] | None = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self._keys = None
        if not is_chief(self.model):
            return
        os.makedirs(os.path.dirname(self.filename) or ".", exist_ok=True)
        continuing = self.append and os.path.isfile(self.filename)
        if continuing:
            with open(self.filename, newline="") as f:
                header = next(csv.reader(f, delimiter=self.separator), None)
            self._keys = header[1:] if header else None
        self._file = open(self.filename, "a" if continuing else "w", newline="")  # noqa: SIM115
        self._writer = csv.writer(self._file, delimiter=self.separator)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self._writer is None:
            return
        logs = logs or {}
        if self._keys is None:
            self._keys = sorted(logs)
            self._writer.writerow(["epoch", *self._keys])
        self._writer.writerow([epoch, *(logs.get(k, "NA") for k in self._keys)])
        assert self._file is not None
        self._file.flush()

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self._file is not None:
            self._file.close()
            self._file, self._writer = None, None
