"""``sg.keras``: Keras-style metrics and losses (the custom-loop parts; ``Model`` comes later)."""

from stratagem.keras import losses, metrics

__all__ = ["losses", "metrics"]
