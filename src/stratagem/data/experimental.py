"""``sg.data.experimental``: the names older tutorials reach through ``tf.data.experimental``."""

from __future__ import annotations

from stratagem.data.dataset import AUTOTUNE, Dataset

INFINITE_CARDINALITY = Dataset.INFINITE
UNKNOWN_CARDINALITY = Dataset.UNKNOWN


def cardinality(dataset: Dataset) -> int:
    """``dataset.cardinality()``, as ``tf.data.experimental.cardinality`` returns it."""
    return dataset.cardinality()


__all__ = ["AUTOTUNE", "INFINITE_CARDINALITY", "UNKNOWN_CARDINALITY", "cardinality"]
