"""``sg.config``: process-wide settings (``sg.config.threading``)."""

from stratagem.config import threading

__all__ = ["threading"]
