"""``BackupAndRestore``: the training state backed up during ``fit``, so that a restarted
``fit`` resumes where the last backup was taken."""

from __future__ import annotations

import os
import shutil

import torch

from stratagem.keras.callbacks.callback import Callback, Logs, is_chief
from stratagem.train import Checkpoint, CheckpointManager, latest_checkpoint


class _Progress:
    """A checkpoint trackable holding the fit's progress (``Model.fit_progress``'s tensors)."""

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
            self.model.resume_fit(self._progress.state)

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
        self._progress.state = self.model.fit_progress(epoch, step)
        self._manager.save()
        self._batches = 0

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self.delete_checkpoint and is_chief(self.model):
            shutil.rmtree(self.backup_dir, ignore_errors=True)
