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
    "distribution",
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


def __getattr__(name: str) -> object:
    # Keras 3's distribution API loads on first use: it brings DTensor, which a job that does
    # not use a mesh should not pay for.
    if name == "distribution":
        import importlib

        return importlib.import_module("stratagem.keras.distribution")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
