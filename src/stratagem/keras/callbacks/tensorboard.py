"""``TensorBoard``: event files of the logs in Keras's layout, written by the chief."""

from __future__ import annotations

import os
from typing import Any

from stratagem.keras.callbacks.callback import Callback, Logs, is_chief


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
        if self.update_freq == "epoch" or not is_chief(self.model) or self._step % self.update_freq:
            return
        for name, value in (logs or {}).items():
            self._writer("train").add_scalar(f"batch_{name}", value, self._step)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if not is_chief(self.model):
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
