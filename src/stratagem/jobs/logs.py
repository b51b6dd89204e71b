"""Per-task log files: the launcher's console, also writing every task's lines to its own file.

The launcher prints a task's line with a prefix such as ``[worker 1] ``; this console also
appends it, without the prefix, to ``worker-1.log``, and its own messages to ``launcher.log``,
so that a failed task's output can be read after the job, whatever was on the screen.
"""

from __future__ import annotations

import io
import threading
from pathlib import Path
from typing import TextIO

from stratagem.cluster.launcher import Console


def task_log_name(prefix: str) -> str:
    """``[worker 1] `` -> ``worker-1.log``; ``[chief] `` -> ``chief.log``."""
    return prefix.strip().strip("[]").replace(" ", "-") + ".log"


class FileConsole(Console):
    """A launcher console that writes each task's output to ``log_dir/<task>.log``.

    ``stream``: also print to ``out``/``err`` as the plain launcher does; otherwise files only.
    """

    LAUNCHER_LOG = "launcher.log"

    def __init__(
        self,
        log_dir: Path,
        *,
        stream: bool = True,
        out: TextIO | None = None,
        err: TextIO | None = None,
    ) -> None:
        import sys

        super().__init__(out or sys.stdout, err or sys.stderr)
        self.log_dir = log_dir
        self.stream = stream
        self._files: dict[str, io.TextIOWrapper] = {}
        self._files_lock = threading.Lock()

    def task_line(self, prefix: str, text: str) -> None:
        self._append(task_log_name(prefix), text)
        if self.stream:
            super().task_line(prefix, text)

    @property
    def is_terminal(self) -> bool:
        return self.stream and super().is_terminal

    def task_draw(self, prefix: str, text: str) -> None:
        # A progress bar's redraws go to the screen only: the file gets the finished line.
        if self.stream:
            super().task_draw(prefix, text)

    def log(self, message: str) -> None:
        self._append(self.LAUNCHER_LOG, message + "\n")
        if self.stream:
            super().log(message)

    def _append(self, name: str, text: str) -> None:
        with self._files_lock:
            f = self._files.get(name)
            if f is None:
                f = self._files[name] = open(self.log_dir / name, "a", encoding="utf-8")  # noqa: SIM115
            f.write(text)
            f.flush()  # a reader (the tuner, a test) sees each line as it comes

    def close(self) -> None:
        with self._files_lock:
            for f in self._files.values():
                f.close()
            self._files.clear()
