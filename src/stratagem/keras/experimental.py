"""``sg.keras.experimental``: Keras's deprecated experimental names (``SidecarEvaluator``, which
is ``sg.keras.utils.SidecarEvaluator``; this one warns)."""

from stratagem.keras.sidecar_evaluator import SidecarEvaluatorExperimental as SidecarEvaluator

__all__ = ["SidecarEvaluator"]
