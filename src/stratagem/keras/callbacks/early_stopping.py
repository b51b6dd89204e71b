"""``EarlyStopping``: ends ``fit`` once a monitored quantity stops improving (Keras 3's
``keras/src/callbacks/early_stopping.py``)."""

from __future__ import annotations

from typing import Any

from stratagem.keras.callbacks.callback import Logs, is_chief
from stratagem.keras.callbacks.monitor import MonitorCallback


class EarlyStopping(MonitorCallback):
    """Stops training when ``monitor`` has not improved by ``min_delta`` for ``patience``
    epochs, as Keras 3:

    - ``baseline``: the wait restarts only on a value that beats both the best so far and the
      baseline, so a model that never beats it stops after ``patience`` epochs;
    - ``start_from_epoch``: epochs before it are a warm-up, not monitored;
    - ``restore_best_weights``: at the end of training (``on_train_end``, whoever stopped it:
      this callback, another one, or the last epoch) the weights of the best epoch come back;
    - a monitored quantity missing from the logs warns, and training goes on.

    Every worker sees the same (global) epoch logs, so every worker stops at the same epoch.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        min_delta: float = 0.0,
        patience: int = 0,
        verbose: int = 0,
        mode: str = "auto",
        baseline: float | None = None,
        restore_best_weights: bool = False,
        start_from_epoch: int = 0,
    ) -> None:
        super().__init__(monitor, mode, min_delta=min_delta)
        self.patience = patience
        self.verbose = verbose
        self.baseline = baseline
        self.restore_best_weights = restore_best_weights
        self.start_from_epoch = start_from_epoch
        self.wait = 0
        self.stopped_epoch = 0
        self.best_epoch = 0
        self.best_weights: dict[str, Any] | None = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        # Allow instances to be re-used across fit calls (Keras).
        self.wait, self.stopped_epoch, self.best_epoch = 0, 0, 0
        self.best, self.best_weights = None, None

    def _weights(self) -> dict[str, Any]:
        assert self.model is not None
        return {k: v.detach().clone() for k, v in self.model.module.state_dict().items()}

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        assert self.model is not None
        # First, as Keras: a monitor whose direction cannot be told raises in mode "auto",
        # whether or not the logs have it (the model's metrics are built by now).
        self._monitor_direction()
        current = self.get_monitor_value(logs, "Early stopping")
        if current is None or epoch < self.start_from_epoch:
            return
        if self.restore_best_weights and self.best_weights is None:
            # Never set: the current weights are the best so far.
            self.best_weights, self.best_epoch = self._weights(), epoch
        self.wait += 1
        if self._is_improvement(current, self.best):
            self.best, self.best_epoch = current, epoch
            if self.restore_best_weights:
                self.best_weights = self._weights()
            # The wait restarts only on beating both the baseline and the previous best.
            if self.baseline is None or self._is_improvement(current, self.baseline):
                self.wait = 0
            return
        if self.wait >= self.patience and epoch > 0:
            self.stopped_epoch = epoch
            self.model.stop_training = True

    def on_train_end(self, logs: Logs | None = None) -> None:
        assert self.model is not None
        chief = is_chief(self.model)
        if self.stopped_epoch > 0 and self.verbose > 0 and chief:
            print(f"Epoch {self.stopped_epoch + 1}: early stopping")
        if self.restore_best_weights and self.best_weights is not None:
            if self.verbose > 0 and chief:
                print(
                    "Restoring model weights from the end of the best epoch: "
                    f"{self.best_epoch + 1}."
                )
            self.model.module.load_state_dict(self.best_weights)
            # Weights held elsewhere (a parameter server's) take the restored values too, as
            # after a checkpoint restore: the model must not go back to the last ones on its
            # next pull or save.
            self.model.distribute_strategy.extended.after_checkpoint_restore([self.model.module])
