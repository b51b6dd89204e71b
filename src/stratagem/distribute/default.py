"""The default strategy: what code sees outside any scope (one replica, nothing moved).

TF returns it from ``get_strategy()`` when no strategy is active, so library code can always
call ``strategy.run``/``reduce`` and work unchanged on one device.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from stratagem.comm import LocalCommunicator
from stratagem.distribute.devices import LogicalDevice
from stratagem.distribute.strategy import Strategy


class _DefaultDistributionStrategy(Strategy):
    """One replica on the CPU; its scope captures nothing and places nothing."""

    def __init__(self) -> None:
        super().__init__([LogicalDevice("cpu:0", torch.device("cpu"))], comm=LocalCommunicator())

    def _capture_parameter(self, module: Any, name: str, param: Any) -> None:
        return None

    def _capture_buffer(self, module: Any, name: str, buffer: Any) -> None:
        return None


_default: _DefaultDistributionStrategy | None = None
_lock = threading.Lock()


def default_strategy() -> _DefaultDistributionStrategy:
    global _default
    with _lock:
        if _default is None:
            _default = _DefaultDistributionStrategy()
        return _default
