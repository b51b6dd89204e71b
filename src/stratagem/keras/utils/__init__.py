"""``sg.keras.utils``: Keras's utilities that distributed training uses."""

from stratagem.keras.utils import experimental

__all__ = ["experimental"]
