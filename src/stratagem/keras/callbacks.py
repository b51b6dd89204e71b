"""``sg.keras.callbacks``: Keras's callback hooks, and the callbacks that need no files.

Every worker runs every callback's hooks (so a callback may take part in a collective, as
``EarlyStopping`` reading the global ``val_loss`` does); what a callback *prints* or *writes*
happens on the chief only, and never makes the others wait.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from stratagem.comm import current_communicator

if TYPE_CHECKING:
    from stratagem.keras.model import Model

Logs = dict[str, float]


def is_chief() -> bool:
    return current_communicator().rank == 0


class Callback:
    """Base class; override the hooks you need. ``self.model`` is set before training."""

    def __init__(self) -> None:
        self.model: Model | None = None
        self.params: dict[str, Any] = {}

    def set_model(self, model: Model) -> None:
        self.model = model

    def set_params(self, params: dict[str, Any]) -> None:
        self.params = params

    @property
    def needs_batch_logs(self) -> bool:
        """Whether ``on_train_batch_end`` reads its logs. Computing them is a collective per
        step under MultiWorkerMirroredStrategy, so fit does it only for callbacks that do."""
        return type(self).on_train_batch_end is not Callback.on_train_batch_end

    def on_train_begin(self, logs: Logs | None = None) -> None: ...
    def on_train_end(self, logs: Logs | None = None) -> None: ...
    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None: ...
    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None: ...
    def on_train_batch_begin(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_test_begin(self, logs: Logs | None = None) -> None: ...
    def on_test_end(self, logs: Logs | None = None) -> None: ...
    def on_test_batch_begin(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_test_batch_end(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_predict_begin(self, logs: Logs | None = None) -> None: ...
    def on_predict_end(self, logs: Logs | None = None) -> None: ...
    def on_predict_batch_begin(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_predict_batch_end(self, batch: int, logs: Logs | None = None) -> None: ...


class CallbackList:
    """Calls one hook on every callback in order."""

    def __init__(self, callbacks: Iterable[Callback], model: Model, params: dict[str, Any]):
        self.callbacks = list(callbacks)
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise TypeError(
                    f"callbacks must be sg.keras.callbacks.Callback objects, got "
                    f"{type(cb).__name__}"
                )
            cb.set_model(model)
            cb.set_params(params)

    def __getattr__(self, hook: str) -> Callable[..., None]:
        if not hook.startswith("on_"):
            raise AttributeError(hook)

        def call(*args: Any) -> None:
            for cb in self.callbacks:
                getattr(cb, hook)(*args)

        return call


class History(Callback):
    """Records the epoch logs: ``history.history["loss"]`` is one value per epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch: list[int] = []
        self.history: dict[str, list[float]] = {}

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        self.epoch.append(epoch)
        for name, value in (logs or {}).items():
            self.history.setdefault(name, []).append(value)


def format_logs(logs: Logs) -> str:
    # Keras's format: 4 decimals, or scientific notation for small values (a decayed lr).
    return " - ".join(
        f"{k}: {v:.4f}" if v == 0 or abs(v) >= 1e-3 else f"{k}: {v:.4e}" for k, v in logs.items()
    )


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
        if self.verbose and is_chief():
            print(f"Epoch {epoch + 1}/{self.params.get('epochs', '?')}", file=self._out())

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        if self.verbose != 1 or not is_chief():
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
        if not self.verbose or not is_chief():
            return
        out = self._out()
        if self.verbose == 1 and getattr(out, "isatty", lambda: False)():
            print(file=out)
        seconds = time.monotonic() - self._start
        print(f"{seconds:.1f}s - {format_logs(logs or {})}", file=out, flush=True)


class LearningRateScheduler(Callback):
    """Sets the learning rate at the start of each epoch: ``schedule(epoch, lr) -> new lr``."""

    def __init__(self, schedule: Callable[..., float], verbose: int = 0) -> None:
        super().__init__()
        self.schedule = schedule
        self.verbose = verbose

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        assert self.model is not None
        optimizer = self.model.optimizer
        try:
            lr = self.schedule(epoch, optimizer.learning_rate)
        except TypeError:  # Keras also accepts schedule(epoch)
            lr = self.schedule(epoch)
        lr = float(lr)
        if not math.isfinite(lr):
            raise ValueError(f"the schedule returned learning rate {lr!r} for epoch {epoch}")
        optimizer.learning_rate = lr
        if self.verbose and is_chief():
            print(f"\nEpoch {epoch + 1}: LearningRateScheduler setting learning rate to {lr}.")

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if logs is not None and self.model is not None:
            logs["learning_rate"] = self.model.optimizer.learning_rate


class Monitor:
    """A logged quantity a callback watches: which way is better (``mode``; ``"auto"`` is max
    for accuracies and AUC, else min), the best value seen, and whether a new one improves on
    it by more than ``min_delta``."""

    def __init__(self, who: str, name: str, mode: str = "auto", min_delta: float = 0.0) -> None:
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"{who} mode {mode!r} is unknown; expected 'auto', 'min' or 'max'")
        if mode == "auto":
            mode = "max" if "acc" in name or name.endswith("auc") else "min"
        self.who, self.name, self.mode, self.min_delta = who, name, mode, abs(min_delta)
        self.best: float | None = None

    def read(self, logs: Logs) -> float:
        if self.name not in logs:
            raise KeyError(
                f"{self.who} monitors {self.name!r}, which the logs lack; they have {sorted(logs)}"
            )
        return logs[self.name]

    def improved(self, value: float) -> bool:
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta


class EarlyStopping(Callback):
    """Stops training when ``monitor`` has not improved by ``min_delta`` for ``patience`` epochs.

    Every worker sees the same (global) epoch logs, so every worker stops at the same epoch.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        min_delta: float = 0.0,
        patience: int = 0,
        mode: str = "auto",
        restore_best_weights: bool = False,
        verbose: int = 0,
    ) -> None:
        super().__init__()
        self._monitor = Monitor("EarlyStopping", monitor, mode, min_delta)
        self.monitor, self.mode = monitor, self._monitor.mode
        self.min_delta, self.patience = abs(min_delta), patience
        self.restore_best_weights, self.verbose = restore_best_weights, verbose
        self.stopped_epoch = 0
        self._best_state: dict[str, Any] | None = None
        self._wait = 0

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self._monitor.best, self._best_state, self._wait, self.stopped_epoch = None, None, 0, 0

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        assert self.model is not None
        value = self._monitor.read(logs or {})
        if self._monitor.improved(value):
            self._monitor.best, self._wait = value, 0
            if self.restore_best_weights:
                self._best_state = {
                    k: v.detach().clone() for k, v in self.model.module.state_dict().items()
                }
            return
        self._wait += 1
        # "patience: epochs with no improvement after which training stops" (Keras); 0 acts as 1.
        if self._wait >= max(1, self.patience):
            self.stopped_epoch = epoch
            self.model.stop_training = True
            if self._best_state is not None:
                self.model.module.load_state_dict(self._best_state)
            if self.verbose and is_chief():
                print(f"Epoch {epoch + 1}: early stopping")


# The callbacks that write files live in their own module; they are part of this namespace,
# imported last because they build on Callback above.
from stratagem.keras.file_callbacks import (  # noqa: E402
    BackupAndRestore,
    CSVLogger,
    ModelCheckpoint,
    TensorBoard,
)

__all__ = [
    "BackupAndRestore",
    "CSVLogger",
    "Callback",
    "CallbackList",
    "EarlyStopping",
    "History",
    "LearningRateScheduler",
    "ModelCheckpoint",
    "ProgbarLogger",
    "TensorBoard",
]
