"""``sg.keras.optimizers``: Keras's optimizer names, bound to parameters at ``Model.compile``.

The recipes and the bound optimizer are ``optimizer_recipes.py``; this namespace adds Keras 2's
``legacy`` names and Keras 3's ``LossScaleOptimizer`` (``sg.keras.mixed_precision``'s), which
build on them.
"""

from stratagem.keras import legacy_optimizers as legacy
from stratagem.keras.mixed_precision.loss_scale_optimizer import LossScaleOptimizer
from stratagem.keras.optimizer_recipes import (
    SGD,
    Adafactor,
    Adagrad,
    Adam,
    Adamax,
    AdamW,
    BoundOptimizer,
    Lion,
    Nadam,
    Optimizer,
    RMSprop,
    get,
)

__all__ = [
    "SGD",
    "Adafactor",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "BoundOptimizer",
    "Lion",
    "LossScaleOptimizer",
    "Nadam",
    "Optimizer",
    "RMSprop",
    "get",
    "legacy",
]
