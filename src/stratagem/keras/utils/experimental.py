"""``sg.keras.utils.experimental``: ``DatasetCreator`` (what ``fit`` takes under a
``ClusterCoordinator``)."""

from stratagem.keras.coordinated import DatasetCreator

__all__ = ["DatasetCreator"]
