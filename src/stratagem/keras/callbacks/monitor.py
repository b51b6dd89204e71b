"""``MonitorCallback``: the base of the callbacks that watch a logged quantity
(``EarlyStopping``, ``ModelCheckpoint``, ``ReduceLROnPlateau``), as Keras 3's
``keras/src/callbacks/monitor_callback.py``: which way is better, the best value so far, and
whether a new value improves on it by more than ``min_delta``."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from stratagem.keras.callbacks.callback import Callback, Logs


class MonitorCallback(Callback):
    """A callback watching ``monitor`` in the epoch logs.

    ``mode="auto"`` infers the direction as Keras 3 does: a loss (``loss``, ``val_loss``) is
    minimised; a compiled metric is minimised or maximised by its ``direction``; otherwise the
    name decides (accuracies and AUC up), and a name that says nothing is an error asking for
    ``mode``. An unknown ``mode`` warns and falls back to ``"auto"`` (Keras). ``baseline`` is
    the initial best value.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        mode: str = "auto",
        baseline: float | None = None,
        min_delta: float = 0.0,
    ) -> None:
        super().__init__()
        if mode not in ("auto", "min", "max"):
            warnings.warn(
                f"{type(self).__name__} mode '{mode}' is unknown, fallback to auto mode.",
                stacklevel=3,
            )
            mode = "auto"
        self.monitor = monitor
        self.mode = mode
        self.best: float | None = baseline
        self.min_delta = abs(min_delta)
        self._direction: str | None = None  # "min" or "max", settled on first use
        # Keras's name for the settled direction: np.less or np.greater (None until then).
        self.monitor_op: Callable[[Any, Any], Any] | None = None

    def _monitor_direction(self) -> str:
        if self._direction is None:
            if self.monitor_op is not None:  # set by the user, as TF code may do
                self._direction = "min" if self.monitor_op in (np.less, np.less_equal) else "max"
            else:
                self._direction = self.mode if self.mode != "auto" else self._infer_direction()
                self.monitor_op = np.less if self._direction == "min" else np.greater
        return self._direction

    def _infer_direction(self) -> str:
        name = self.monitor.removeprefix("val_")
        if name == "loss":
            return "min"
        for metric in getattr(self.model, "metrics", []):
            direction = getattr(metric, "direction", None)
            if metric.name == name and direction in ("up", "down"):
                return "max" if direction == "up" else "min"
        if "acc" in name or name.endswith("auc"):
            return "max"
        raise ValueError(
            f"{type(self).__name__} callback received monitor={self.monitor}, but stratagem "
            "isn't able to automatically determine whether that metric should be maximized or "
            "minimized. Pass `mode='max'` in order to monitor based on the highest metric "
            "value, or pass `mode='min'` in order to use the lowest value."
        )

    def _is_improvement(self, value: float, reference: float | None) -> bool:
        if reference is None:
            return True
        self._monitor_direction()
        assert self.monitor_op is not None
        # Keras: monitor_op(value - min_delta, reference), min_delta negative when minimising.
        delta = -self.min_delta if self._direction == "min" else self.min_delta
        return bool(self.monitor_op(value - delta, reference))

    def get_monitor_value(self, logs: Logs | None, what: str) -> float | None:
        """The monitored value, or None with a warning when the logs lack it (Keras goes on:
        the default ``val_loss`` without validation data must not abort ``fit``)."""
        logs = logs or {}
        value = logs.get(self.monitor)
        if value is None:
            warnings.warn(
                f"{what} conditioned on metric `{self.monitor}` which is not available. "
                f"Available metrics are: {','.join(logs)}",
                stacklevel=3,
            )
        return value
