"""``ModelCheckpoint``: the model saved every epoch or every N batches as ``sg.train``
checkpoints, written by the chief."""

from __future__ import annotations

import math
import os

from stratagem.keras.callbacks.callback import Callback, Logs
from stratagem.keras.callbacks.monitor import Monitor
from stratagem.train import Checkpoint
from stratagem.train.checkpoint import is_writer
from stratagem.train.storage import record_in_index


class ModelCheckpoint(Callback):
    """Saves the model every epoch (or every ``save_freq`` batches) at ``filepath``.

    ``filepath`` may hold ``{epoch}`` (from 1, as Keras) and log names, with format specs:
    ``"ckpt/weights-{epoch:02d}-{val_loss:.2f}"``. Each save is an ``sg.train`` checkpoint
    directory (the module, and unless ``save_weights_only`` the optimizer) recorded in its
    directory's index, so ``sg.train.latest_checkpoint(dir)`` and ``model.load_weights(path)``
    find it. ``save_best_only`` keeps to saves where ``monitor`` improved (``mode``).
    """

    def __init__(
        self,
        filepath: str,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_best_only: bool = False,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq: str | int = "epoch",
    ) -> None:
        super().__init__()
        if save_freq != "epoch" and (
            isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1
        ):
            raise ValueError(f"save_freq must be 'epoch' or a positive int; got {save_freq!r}")
        self.filepath = os.fspath(filepath)
        self._monitor = Monitor("ModelCheckpoint(save_best_only=True)", monitor, mode)
        self.monitor, self.mode = monitor, self._monitor.mode
        self.verbose = verbose
        self.save_best_only, self.save_weights_only = save_best_only, save_weights_only
        self.save_freq = save_freq
        self._batches = 0
        self._epoch = 0

    @property
    def best(self) -> float | None:
        """The best ``monitor`` value saved so far (with ``save_best_only``)."""
        return self._monitor.best

    @property
    def needs_batch_logs(self) -> bool:
        return self.save_freq != "epoch"

    def _checkpoint(self) -> Checkpoint:
        assert self.model is not None
        if self.save_weights_only or self.model.optimizer is None:
            return Checkpoint(model=self.model.module)
        return Checkpoint(model=self.model.module, optimizer=self.model.optimizer.torch_optimizer)

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        if self.save_freq == "epoch":
            return
        self._batches += 1
        if self._batches % int(self.save_freq) == 0:
            self._save(self._epoch, logs or {}, batch=batch)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self.save_freq == "epoch":
            self._save(epoch, logs or {})

    def _save(self, epoch: int, logs: Logs, batch: int | None = None) -> None:
        if self.save_best_only:
            value = self._monitor.read(logs)
            if not math.isfinite(value) or not self._monitor.improved(value):
                return
            self._monitor.best = value
        try:
            path = self.filepath.format(epoch=epoch + 1, batch=batch, **logs)
        except KeyError as e:
            raise KeyError(
                f"ModelCheckpoint filepath {self.filepath!r} names {e}, which the logs lack; "
                f"available: epoch, batch, {', '.join(sorted(logs))}"
            ) from None
        checkpoint = self._checkpoint()
        checkpoint.write(path)
        if is_writer(checkpoint):
            record_in_index(os.path.dirname(path) or ".", os.path.basename(path))
            if self.verbose:
                print(f"\nEpoch {epoch + 1}: saving model to {path}")

    def on_train_end(self, logs: Logs | None = None) -> None:
        # The one synchronisation: code after fit (load_weights of the latest save) on any
        # worker must see the chief's last write.
        assert self.model is not None
        self.model.distribute_strategy.extended.barrier("ModelCheckpoint's last save")
