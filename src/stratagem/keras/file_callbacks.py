"""The callbacks that write files: ``CSVLogger``, ``ModelCheckpoint``, ``BackupAndRestore``,
``TensorBoard``.

Only the chief writes; every worker runs the hooks and none waits for the writes (checkpoints
go through ``sg.train.Checkpoint``, whose ``write`` is chief-only and atomic), except once at
the end of ``fit``, so that what follows it on any worker sees the last checkpoint. On several
machines the directories must be on a filesystem every worker sees, since all of them read a
backup on restore.
"""

from __future__ import annotations

import csv
import math
import os
import shutil
from typing import IO, Any

import torch

from stratagem.comm import current_communicator
from stratagem.keras.callbacks import Callback, Logs, Monitor, is_chief
from stratagem.train import Checkpoint, CheckpointManager, latest_checkpoint
from stratagem.train.storage import record_in_index


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
        if not is_chief():
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
        self._checkpoint().write(path)
        if is_chief():
            record_in_index(os.path.dirname(path) or ".", os.path.basename(path))
            if self.verbose:
                print(f"\nEpoch {epoch + 1}: saving model to {path}")

    def on_train_end(self, logs: Logs | None = None) -> None:
        # The one synchronisation: code after fit (load_weights of the latest save) on any
        # worker must see the chief's last write.
        current_communicator().barrier(what="ModelCheckpoint's last save")


class _Progress:
    """A checkpoint trackable holding the fit's progress (``Model._fit_progress``'s tensors)."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.state = dict(state)


class BackupAndRestore(Callback):
    """Backs up the training state at the end of every epoch (``save_freq="epoch"``) or every
    ``save_freq`` batches; a restarted ``fit`` resumes where the last backup was taken.

    A backup holds the model, the optimizer and where the fit was: the epoch, the batches done
    in it, the position in the data (fit's shuffle is a function of a saved seed and the pass,
    so the order repeats), and the epoch's metric totals so far. A fit resumed mid-epoch thus
    trains on the same batches as an uninterrupted one and logs the same epoch metrics. The
    backup is deleted when ``fit`` finishes (unless ``delete_checkpoint=False``), so only an
    interrupted run leaves one behind.
    """

    def __init__(
        self, backup_dir: str, save_freq: str | int = "epoch", delete_checkpoint: bool = True
    ) -> None:
        super().__init__()
        if save_freq != "epoch" and (
            isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1
        ):
            raise ValueError(
                f"save_freq must be 'epoch' or a positive number of batches; got {save_freq!r}"
            )
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        self._progress = _Progress()
        self._manager: CheckpointManager | None = None
        self._epoch = 0
        self._batches = 0  # since the last backup

    def on_train_begin(self, logs: Logs | None = None) -> None:
        assert self.model is not None and self.model.optimizer is not None
        checkpoint = Checkpoint(
            model=self.model.module,
            optimizer=self.model.optimizer.torch_optimizer,
            progress=self._progress,
        )
        self._manager = CheckpointManager(checkpoint, self.backup_dir, max_to_keep=1)
        self._batches = 0
        latest = latest_checkpoint(self.backup_dir)
        if latest is not None:
            checkpoint.restore(latest).assert_existing_objects_matched()
            self.model._resume_fit(self._progress.state)

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        if self.save_freq == "epoch":
            return
        self._batches += 1
        if self._batches >= self.save_freq:
            self._backup(self._epoch, batch + 1)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        # With a batch frequency, a backup taken at the epoch's last batch is moved on past its
        # end, so that a resumed fit does not end that epoch (validation, callbacks) again.
        if self.save_freq == "epoch" or self._batches == 0:
            self._backup(epoch + 1, 0)

    def _backup(self, epoch: int, step: int) -> None:
        assert self._manager is not None and self.model is not None
        # Every worker takes part: the metric totals are summed over all of them.
        self._progress.state = self.model._fit_progress(epoch, step)
        self._manager.save()
        self._batches = 0

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self.delete_checkpoint and is_chief():
            shutil.rmtree(self.backup_dir, ignore_errors=True)


class TensorBoard(Callback):
    """TensorBoard event files, as Keras lays them out: ``<log_dir>/train`` and
    ``<log_dir>/validation`` with ``epoch_loss``, ``epoch_accuracy``... per epoch, the learning
    rate as ``epoch_learning_rate``, and with ``update_freq="batch"`` (or every N batches)
    ``batch_*`` scalars by global step. Written by the chief through ``SummaryWriter``.
    """

    def __init__(self, log_dir: str = "logs", update_freq: str | int = "epoch") -> None:
        super().__init__()
        if update_freq not in ("epoch", "batch") and (
            isinstance(update_freq, bool) or not isinstance(update_freq, int) or update_freq < 1
        ):
            raise ValueError(
                f"update_freq must be 'epoch', 'batch' or a positive int; got {update_freq!r}"
            )
        self.log_dir = os.fspath(log_dir)
        self.update_freq = 1 if update_freq == "batch" else update_freq
        self._writers: dict[str, Any] = {}
        self._step = 0

    @property
    def needs_batch_logs(self) -> bool:
        return self.update_freq != "epoch"

    def _writer(self, split: str) -> Any:
        if split not in self._writers:
            from torch.utils.tensorboard import SummaryWriter

            self._writers[split] = SummaryWriter(os.path.join(self.log_dir, split))
        return self._writers[split]

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        self._step += 1
        if self.update_freq == "epoch" or not is_chief() or self._step % self.update_freq:
            return
        for name, value in (logs or {}).items():
            self._writer("train").add_scalar(f"batch_{name}", value, self._step)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if not is_chief():
            return
        logs = dict(logs or {})
        if "learning_rate" not in logs and self.model is not None and self.model.optimizer:
            logs["learning_rate"] = self.model.optimizer.learning_rate
        for name, value in logs.items():
            split, tag = ("validation", name[4:]) if name.startswith("val_") else ("train", name)
            self._writer(split).add_scalar(f"epoch_{tag}", value, epoch)
        for writer in self._writers.values():
            writer.flush()

    def on_train_end(self, logs: Logs | None = None) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers = {}


__all__ = ["BackupAndRestore", "CSVLogger", "ModelCheckpoint", "TensorBoard"]
