"""How ``sg.train.Checkpoint`` tracks Keras objects, as TensorFlow's checkpoints do.

``tf.train.Checkpoint(model=keras_model)`` saves the model's weights and, once it is compiled,
its optimizer's state (the model tracks its optimizer). Here a Keras ``Model`` is tracked as a
nested checkpoint of ``module`` and, when compiled, ``optimizer``; its primary child is the
module, so ``model.load_weights`` reads such a checkpoint, and ``Checkpoint(model=keras_model)``
restores from a checkpoint of the module alone. ``model.optimizer`` (a ``BoundOptimizer``) is
tracked as the ``torch.optim`` optimizer it wraps and ``iterations`` (TF's optimizer ``iter``),
so a restored optimizer goes on counting its steps; the model tracks both.
"""

from __future__ import annotations

import torch

from stratagem.keras.mixed_precision import LossScaleOptimizer
from stratagem.keras.model import Model
from stratagem.keras.optimizers import BoundOptimizer
from stratagem.train.checkpoint import register_composite


class OptimizerIterations:
    """``optimizer.iterations`` as a checkpoint's state: saved as a 0-d int64 tensor, restored
    into the optimizer's count."""

    def __init__(self, optimizer: BoundOptimizer) -> None:
        self._optimizer = optimizer

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"iterations": torch.tensor(self._optimizer.iterations, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._optimizer.iterations = int(state["iterations"])


def _optimizer_parts(optimizer: BoundOptimizer) -> dict[str, object]:
    parts: dict[str, object] = {
        "optimizer": optimizer.torch_optimizer,
        "iterations": OptimizerIterations(optimizer),
    }
    if isinstance(optimizer, LossScaleOptimizer):
        parts.update(optimizer.trackables())  # Keras tracks the loss scale too
    return parts


def _parts(model: Model) -> dict[str, object]:
    parts: dict[str, object] = {"module": model.module}
    if model.optimizer is not None:
        parts.update(_optimizer_parts(model.optimizer))
    return parts


register_composite(Model, _parts, primary="module")
# A LossScaleOptimizer is a BoundOptimizer: tracked as its optimizer, iterations, the scale and
# the counter.
register_composite(BoundOptimizer, _optimizer_parts, primary="optimizer")
