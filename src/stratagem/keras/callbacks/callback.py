"""``Callback``, the base class of every callback, and the small helpers the callbacks and
``Model`` share: ``Logs``, ``is_chief``, ``format_logs``; ``FitModel``, what the callbacks use
of the model they are set on."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from stratagem.distribute import get_strategy

if TYPE_CHECKING:
    import torch

    from stratagem.distribute import Strategy
    from stratagem.keras.optimizer_recipes import BoundOptimizer

Logs = dict[str, float]


class FitModel(Protocol):
    """What the callbacks here use of the model they are set on: an ``sg.keras.Model`` is one.
    The callbacks sit below the model whose ``fit``, ``evaluate`` and ``predict`` call them, so
    they name only these members."""

    module: torch.nn.Module
    optimizer: BoundOptimizer | None
    distribute_strategy: Strategy
    stop_training: bool

    def fit_progress(self, epoch: int, step: int) -> dict[str, torch.Tensor]: ...

    def resume_fit(self, progress: dict[str, torch.Tensor]) -> None: ...


def is_chief(model: FitModel | None) -> bool:
    """Whether this process prints and writes summaries for ``model``'s fit: the chief of the
    strategy the model was built under (``extended.should_save_summary``); with no model, of
    the current strategy."""
    strategy = model.distribute_strategy if model is not None else get_strategy()
    return strategy.extended.should_save_summary


class Callback:
    """Base class; override the hooks you need. ``self.model`` is set before training."""

    def __init__(self) -> None:
        self.model: FitModel | None = None
        self.params: dict[str, Any] = {}

    def set_model(self, model: FitModel) -> None:
        self.model = model

    def set_params(self, params: dict[str, Any]) -> None:
        self.params = params

    @property
    def needs_batch_logs(self) -> bool:
        """Whether ``on_train_batch_end`` reads its logs. Computing them is a collective per
        step under MultiWorkerMirroredStrategy, so fit does it only for callbacks that do."""
        own = type(self)
        return (
            own.on_train_batch_end is not Callback.on_train_batch_end
            or own.on_batch_end is not Callback.on_batch_end
        )

    @property
    def needs_test_batch_logs(self) -> bool:
        """Whether ``on_test_batch_end`` reads its logs (a collective per batch too)."""
        return type(self).on_test_batch_end is not Callback.on_test_batch_end

    def on_train_begin(self, logs: Logs | None = None) -> None: ...
    def on_train_end(self, logs: Logs | None = None) -> None: ...
    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None: ...
    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None: ...
    def on_batch_begin(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_batch_end(self, batch: int, logs: Logs | None = None) -> None: ...

    # Keras 3: the training batch hooks call the old names, so a callback written against
    # on_batch_begin/on_batch_end (Keras 2) runs on every training batch.
    def on_train_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        self.on_batch_begin(batch, logs)

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        self.on_batch_end(batch, logs)

    def on_test_begin(self, logs: Logs | None = None) -> None: ...
    def on_test_end(self, logs: Logs | None = None) -> None: ...
    def on_test_batch_begin(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_test_batch_end(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_predict_begin(self, logs: Logs | None = None) -> None: ...
    def on_predict_end(self, logs: Logs | None = None) -> None: ...
    def on_predict_batch_begin(self, batch: int, logs: Logs | None = None) -> None: ...
    def on_predict_batch_end(self, batch: int, logs: Logs | None = None) -> None: ...


def format_logs(logs: Logs) -> str:
    # Keras's format: 4 decimals, or scientific notation for small values (a decayed lr).
    return " - ".join(
        f"{k}: {v:.4f}" if v == 0 or abs(v) >= 1e-3 else f"{k}: {v:.4e}" for k, v in logs.items()
    )
