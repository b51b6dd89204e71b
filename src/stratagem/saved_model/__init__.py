"""``sg.saved_model``: TensorFlow's low-level SavedModel entry points, ``save`` and ``load``.

They read and write the one directory format of ``model.save`` (``sg.keras.saving``):
safetensors weights, a JSON config and a ``torch.export`` program. ``save`` takes a Keras model
or any ``torch.nn.Module``, distributed or not; ``load`` gives back a ``LoadedModel`` (not a
Keras model, as in TensorFlow) that is callable and holds its serving function under
``signatures["serving_default"]``; a ``torch.nn.Module``, so ``sg.keras.Model(loaded)`` trains it.
"""

from stratagem.keras.io_options import LoadOptions, SaveOptions
from stratagem.saved_model.loaded import (
    DEFAULT_SERVING_SIGNATURE_DEF_KEY,
    SERVING,
    LoadedModel,
    ServingFunction,
)
from stratagem.saved_model.save_load import load, save

__all__ = [
    "DEFAULT_SERVING_SIGNATURE_DEF_KEY",
    "SERVING",
    "LoadOptions",
    "LoadedModel",
    "SaveOptions",
    "ServingFunction",
    "load",
    "save",
]
