"""``History``: the per-epoch logs that ``fit`` returns."""

from __future__ import annotations

from stratagem.keras.callbacks.callback import Callback, Logs


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
