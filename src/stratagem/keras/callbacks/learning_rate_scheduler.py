"""``LearningRateScheduler``: the optimizer's learning rate set per epoch by a schedule."""

from __future__ import annotations

import math
from collections.abc import Callable

from stratagem.keras.callbacks.callback import Callback, Logs, is_chief


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
        if self.verbose and is_chief(self.model):
            print(f"\nEpoch {epoch + 1}: LearningRateScheduler setting learning rate to {lr}.")

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if logs is not None and self.model is not None:
            logs["learning_rate"] = self.model.optimizer.learning_rate
