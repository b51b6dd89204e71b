"""stratagem: TensorFlow's distribution strategies for PyTorch, on PyTorch's own engines.

``import stratagem as sg`` and port TensorFlow code by replacing ``tf.`` with ``sg.``.

Subpackages load on first use (``sg.distribute``...), so that the ``stratagem run`` launcher,
which needs none of them, starts without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_SUBPACKAGES = (
    "cluster",
    "comm",
    "config",
    "data",
    "debugging",
    "distribute",
    "dtensor",
    "errors",
    "jobs",
    "keras",
    "launch",
    "nn",
    "saved_model",
    "shipping",
    "train",
    "tune",
)
# tf.metrics, tf.losses, tf.optimizers are TensorFlow's top-level aliases of the Keras modules.
_KERAS_ALIASES = ("losses", "metrics", "optimizers")
__all__ = [*_SUBPACKAGES, *_KERAS_ALIASES, "Model", "__version__", "device", "recompute_grad"]


def __getattr__(name: str) -> Any:
    if name == "Model":  # sg.Model is sg.keras.Model, as tf.keras.Model is reachable as tf.Model
        from stratagem.keras import Model

        return Model
    if name == "device":  # sg.device, as tf.device: a placement scope
        from stratagem.distribute import device

        return device
    if name == "recompute_grad":  # tf.recompute_grad: activation checkpointing
        from stratagem.recompute import recompute_grad

        return recompute_grad
    if name in _KERAS_ALIASES:
        module = importlib.import_module(f"{__name__}.keras.{name}")
        globals()[name] = module
        return module
    if name in _SUBPACKAGES:
        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'stratagem' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
