"""``sg.keras``: ``Model`` with compile/fit/evaluate/predict, callbacks, metrics, losses and
optimizers by Keras name."""

from stratagem.keras import (
    callbacks,
    experimental,
    losses,
    metrics,
    mixed_precision,
    models,
    optimizers,
    regularizers,
    utils,
)
from stratagem.keras import tracking as _tracking  # noqa: F401  (sg.train.Checkpoint tracks Model)
from stratagem.keras.model import Model
from stratagem.recompute import recompute_grad as remat

__all__ = [
    "Model",
    "callbacks",
    "experimental",
    "losses",
    "metrics",
    "mixed_precision",
    "models",
    "optimizers",
    "regularizers",
    "remat",
    "utils",
]
