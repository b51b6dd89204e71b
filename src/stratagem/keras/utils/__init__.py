"""``sg.keras.utils``: Keras's utilities that distributed training uses."""

from stratagem.keras.sidecar_evaluator import SidecarEvaluator
from stratagem.keras.utils import experimental

__all__ = ["SidecarEvaluator", "experimental"]
