"""``ModelCheckpoint``: the model saved every epoch or every N batches as ``sg.train``
checkpoints, written by the chief (Keras 3's ``keras/src/callbacks/model_checkpoint.py``)."""

from __future__ import annotations

import math
import os
import warnings

import torch

from stratagem.keras.callbacks.callback import Logs, is_chief
from stratagem.keras.callbacks.monitor import MonitorCallback
from stratagem.keras.callbacks.save_schedule import BatchSchedule, check_save_freq
from stratagem.train import Checkpoint
from stratagem.train.checkpoint import write_recorded


class ModelCheckpoint(MonitorCallback):
    """Saves the model every epoch (or every ``save_freq`` batches) at ``filepath``.

    ``filepath`` may hold ``{epoch}`` and ``{batch}`` (both from 1, as Keras) and log names,
    with format specs: ``"ckpt/weights-{epoch:02d}-{val_loss:.2f}"``. Each save is an
    ``sg.train`` checkpoint directory (the module, the optimizer's ``iterations``, and unless
    ``save_weights_only`` the optimizer) recorded in its directory's index, so
    ``sg.train.latest_checkpoint(dir)`` and ``model.load_weights(path)`` find it; Keras's
    ``.keras`` / ``.weights.h5`` suffixes are neither required nor special. ``save_best_only``
    keeps to saves where ``monitor`` improved (``mode``) on the best so far, starting from
    ``initial_value_threshold``; when the logs lack ``monitor`` it warns and skips the save, as
    TF's ``tf.keras`` (Keras 3 saves).
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
        initial_value_threshold: float | None = None,
    ) -> None:
        super().__init__(monitor, mode, baseline=initial_value_threshold)
        check_save_freq("ModelCheckpoint", save_freq)
        self.filepath = os.fspath(filepath)
        self.verbose = verbose
        self.save_best_only, self.save_weights_only = save_best_only, save_weights_only
        self.save_freq = save_freq
        self._schedule = BatchSchedule(save_freq) if isinstance(save_freq, int) else None
        self._epoch = 0

    @property
    def needs_batch_logs(self) -> bool:
        return self.save_freq != "epoch"

    def _checkpoint(self) -> Checkpoint:
        assert self.model is not None
        if self.model.optimizer is None:
            return Checkpoint(model=self.model.module)
        # The training step goes with every save, as TF's weights carry the optimizer's
        # iterations: what a SidecarEvaluator writes its summaries at.
        step = torch.tensor(self.model.optimizer.iterations)
        if self.save_weights_only:
            return Checkpoint(model=self.model.module, iterations=step)
        optimizer = self.model.optimizer.torch_optimizer
        return Checkpoint(model=self.model.module, optimizer=optimizer, iterations=step)

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        if self._schedule is not None and self._schedule.due(batch):
            self._save(self._epoch, logs or {}, batch=batch)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self.save_freq == "epoch":
            self._save(epoch, logs or {})

    def _file_path(self, epoch: int, batch: int | None, logs: Logs) -> str:
        try:
            if batch is None or "batch" in logs:
                return self.filepath.format(epoch=epoch + 1, **logs)
            return self.filepath.format(epoch=epoch + 1, batch=batch + 1, **logs)
        except KeyError as e:
            raise KeyError(
                f"ModelCheckpoint filepath {self.filepath!r} names {e}, which the logs lack; "
                f"available: epoch, batch, {', '.join(sorted(logs))}"
            ) from None

    def _should_save(self, epoch: int, logs: Logs, path: str) -> bool:
        chief_says = self.verbose > 0 and is_chief(self.model)
        if not self.save_best_only:
            if chief_says:
                print(f"\nEpoch {epoch + 1}: saving model to {path}")
            return True
        current = logs.get(self.monitor)
        if current is None:
            # TF's tf.keras skips (Keras 3 saves): "save best only" never saves an unknown.
            warnings.warn(
                f"Can save best model only with {self.monitor} available, skipping.", stacklevel=4
            )
            return False
        best = "None" if self.best is None else f"{self.best:.5f}"
        if math.isfinite(current) and self._is_improvement(current, self.best):
            if chief_says:
                print(
                    f"\nEpoch {epoch + 1}: {self.monitor} improved from {best} to "
                    f"{current:.5f}, saving model to {path}"
                )
            self.best = current
            return True
        if chief_says:
            print(f"\nEpoch {epoch + 1}: {self.monitor} did not improve from {best}")
        return False

    def _save(self, epoch: int, logs: Logs, batch: int | None = None) -> None:
        path = self._file_path(epoch, batch, logs)
        if not self._should_save(epoch, logs, path):
            return
        # Collective, as TF's save: every worker returns with the save (and the index naming it)
        # complete, so any of them may load it next.
        write_recorded(self._checkpoint(), path)

    def on_train_end(self, logs: Logs | None = None) -> None:
        # Code after fit (load_weights of the latest save) on any worker must see the chief's
        # last write: each save is collective already; this also covers a fit that saved none.
        assert self.model is not None
        self.model.distribute_strategy.extended.barrier("ModelCheckpoint's last save")
