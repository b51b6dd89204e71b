"""``BackupAndRestore``: the training state backed up during ``fit``, so that a restarted
``fit`` resumes where the last backup was taken."""

from __future__ import annotations

import os
import shutil
import warnings

import torch

from stratagem.keras.callbacks.callback import Callback, Logs, is_chief
from stratagem.keras.callbacks.save_schedule import BatchSchedule, check_save_freq
from stratagem.train import Checkpoint, CheckpointManager, FellBackWarning, latest_checkpoint
from stratagem.train.checkpoint import say_resumed


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
    trains on the same batches as an uninterrupted one and logs the same epoch metrics (Keras 3
    resumes at the start of the epoch). The backup is deleted when ``fit`` finishes (unless
    ``delete_checkpoint=False``), so only an interrupted run leaves one behind. With
    ``double_checkpoint=True`` the previous backup is kept too, and restored when the latest
    cannot be read (Keras).

    As Keras: an empty ``backup_dir`` (``None``, ``""``) is a ValueError. Keras's
    ``save_freq=False`` (backups only on preemption, with TF's preemption checkpointing) has no
    stratagem counterpart and is refused rather than silently never backing up.
    """

    def __init__(
        self,
        backup_dir: str,
        save_freq: str | int = "epoch",
        double_checkpoint: bool = False,
        delete_checkpoint: bool = True,
    ) -> None:
        super().__init__()
        if not backup_dir:
            raise ValueError(f"Empty `backup_dir` argument passed: got {backup_dir!r}")
        if save_freq is False:
            raise ValueError(
                "BackupAndRestore(save_freq=False) backs up only on preemption in Keras (TF's "
                "preemption checkpointing), which stratagem does not have; give 'epoch' or a "
                "number of batches"
            )
        check_save_freq("BackupAndRestore", save_freq)
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.double_checkpoint = double_checkpoint
        self.delete_checkpoint = delete_checkpoint
        self._progress = _Progress()
        self._manager: CheckpointManager | None = None
        self._epoch = 0
        self._schedule = BatchSchedule(save_freq) if isinstance(save_freq, int) else None
        self._deferred = False  # a backup due inside an accumulated step, taken at its end

    def on_train_begin(self, logs: Logs | None = None) -> None:
        assert self.model is not None and self.model.optimizer is not None
        checkpoint = Checkpoint(
            model=self.model.module,
            optimizer=self.model.optimizer.torch_optimizer,
            progress=self._progress,
        )
        keep = 2 if self.double_checkpoint else 1
        self._manager = CheckpointManager(checkpoint, self.backup_dir, max_to_keep=keep)
        if self._schedule is not None:
            self._schedule = BatchSchedule(self._schedule.every)
        found = self._manager.checkpoints[::-1] or [latest_checkpoint(self.backup_dir)]
        backups = [p for p in found if p is not None]
        failures: list[str] = []
        for i, path in enumerate(backups):
            try:
                checkpoint.restore(path).assert_existing_objects_matched()
            except Exception as e:  # a damaged file raises what its reader raises
                # The latest backup cannot be read: the previous one, if kept (Keras).
                if i + 1 < len(backups):
                    failures.append(f"{path!r}: {type(e).__name__}: {e}")
                    continue
                raise
            if failures:
                warnings.warn(
                    f"BackupAndRestore: the latest backup cannot be restored "
                    f"({'; '.join(failures)}); resuming from the previous one, {path!r}",
                    FellBackWarning,
                    stacklevel=2,
                )
            self._drop_unreadable(backups[:i])
            self.model.resume_fit(self._progress.state)
            step = int(self._progress.state["position"][1])
            self._say_membership_change(step)
            if self._schedule is not None and step > 0:
                self._schedule.resume_after(step - 1)
            break

    def _say_membership_change(self, step: int) -> None:
        """The chief says where an elastic job resumed after its workers changed."""
        assert self.model is not None
        epoch = int(self._progress.state["position"][0])
        say_resumed(self.model.distribute_strategy.extended, f"epoch {epoch + 1}, step {step}")

    def _drop_unreadable(self, failed: list[str]) -> None:
        """Remove backups that could not be read (those tried and failed, and damaged ones the
        manager does not list), so that the next backup can take their number."""
        assert self._manager is not None and self.model is not None
        if not (self.double_checkpoint or failed):
            return
        extended = self.model.distribute_strategy.extended
        kept = {os.path.abspath(p) for p in self._manager.checkpoints}
        names = os.listdir(self.backup_dir) if os.path.isdir(self.backup_dir) else []
        damaged = [os.path.join(self.backup_dir, n) for n in names if n.startswith("ckpt-")]
        damaged = [p for p in damaged if os.path.abspath(p) not in kept] + failed
        # Every worker has looked before the chief deletes, and waits until it has.
        extended.barrier("BackupAndRestore looked for unreadable backups")
        if is_chief(self.model):
            for path in damaged:
                shutil.rmtree(path, ignore_errors=True)
        extended.barrier("BackupAndRestore removed unreadable backups")
        keep = 2 if self.double_checkpoint else 1
        checkpoint = self._manager.checkpoint
        self._manager = CheckpointManager(checkpoint, self.backup_dir, max_to_keep=keep)

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        due = self._schedule is not None and self._schedule.due(batch)
        if (due or self._deferred) and not self._mid_accumulation():
            self._deferred = False
            self._backup(self._epoch, batch + 1)
        elif due:
            self._deferred = True

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        # With a batch frequency, a backup taken at the epoch's last batch is moved on past its
        # end, so that a resumed fit does not end that epoch (validation, callbacks) again.
        if self._schedule is None or self._schedule.seen == 0:
            if self._mid_accumulation():
                self._deferred = True
            elif not self._deferred:
                self._backup(epoch + 1, 0)
        if self._schedule is not None:
            self._schedule.epoch_ended()

    def _mid_accumulation(self) -> bool:
        """Whether the fit is inside an accumulated step (``gradient_accumulation_steps``). The
        micro-batches' gradients held so far are the parameters' ``.grad`` here (Keras 3 keeps
        them among the optimizer's variables, which its backup saves), which no checkpoint
        holds: the backup waits for the step's last micro-batch, so a resumed fit is exact."""
        optimizer = getattr(self.model, "optimizer", None)
        return bool(getattr(optimizer, "mid_accumulation", False))

    def _backup(self, epoch: int, step: int) -> None:
        assert self._manager is not None and self.model is not None
        # Every worker takes part: the metric totals are summed over all of them.
        self._progress.state = self.model.fit_progress(epoch, step)
        self._manager.save()

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self.delete_checkpoint and is_chief(self.model):
            shutil.rmtree(self.backup_dir, ignore_errors=True)
