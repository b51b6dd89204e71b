"""``sg.keras.models``: ``load_model``, where Keras keeps it."""

from stratagem.keras.saving import load_model

__all__ = ["load_model"]
