"""``Monitor``: the watched quantity ``EarlyStopping`` and ``ModelCheckpoint`` share (its
direction, best value and test of improvement); a helper, not a callback."""

from __future__ import annotations

from stratagem.keras.callbacks.callback import Logs


class Monitor:
    """A logged quantity a callback watches: which way is better (``mode``; ``"auto"`` is max
    for accuracies and AUC, else min), the best value seen, and whether a new one improves on
    it by more than ``min_delta``."""

    def __init__(self, who: str, name: str, mode: str = "auto", min_delta: float = 0.0) -> None:
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"{who} mode {mode!r} is unknown; expected 'auto', 'min' or 'max'")
        if mode == "auto":
            mode = "max" if "acc" in name or name.endswith("auc") else "min"
        self.who, self.name, self.mode, self.min_delta = who, name, mode, abs(min_delta)
        self.best: float | None = None

    def read(self, logs: Logs) -> float:
        if self.name not in logs:
            raise KeyError(
                f"{self.who} monitors {self.name!r}, which the logs lack; they have {sorted(logs)}"
            )
        return logs[self.name]

    def improved(self, value: float) -> bool:
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta
