"""``EarlyStopping``: ends ``fit`` once a monitored quantity stops improving."""

from __future__ import annotations

from typing import Any

from stratagem.keras.callbacks.callback import Callback, Logs, is_chief
from stratagem.keras.callbacks.monitor import Monitor


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
            if self.verbose and is_chief(self.model):
                print(f"Epoch {epoch + 1}: early stopping")
