"""The default strategy: what code sees outside any scope (one replica, nothing moved).

TF returns it from ``get_strategy()`` when no strategy is active, so library code can always
call ``strategy.run``/``reduce`` and work unchanged on one device.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import override

from stratagem.comm import LocalCommunicator
from stratagem.distribute.extended import StrategyExtended
from stratagem.distribute.machinery import context
from stratagem.distribute.machinery.replica_devices import ReplicaDevice
from stratagem.distribute.strategy import Strategy


class _DefaultExtended(StrategyExtended):
    """One replica on the CPU; its scope captures nothing and places nothing."""

    def __init__(self, container: Strategy) -> None:
        super().__init__(
            container, [ReplicaDevice("cpu:0", torch.device("cpu"))], comm=LocalCommunicator()
        )

    @override
    def capture_parameter(self, module: Any, name: str, param: Any) -> None:
        return None

    @override
    def adopt(self, tensors: list[tuple[torch.Tensor, bool]]) -> None:
        """Nothing: its scope captures nothing."""

    @override
    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing: one replica's gradients are the update's."""

    @override
    def capture_buffer(self, module: Any, name: str, buffer: Any) -> None:
        return None

    @property
    @override
    def should_checkpoint(self) -> bool:
        # Objects no strategy owns, saved outside every scope, in a process of a multi-process
        # job (torch.distributed started by a strategy, a mesh or torchrun): its rank 0 writes,
        # as the chief would, rather than every process racing for the same path.
        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0

    @override
    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "strategy": "default"}


class _DefaultDistributionStrategy(Strategy):
    def __init__(self) -> None:
        super().__init__(_DefaultExtended(self))


_default: _DefaultDistributionStrategy | None = None
_lock = threading.Lock()


def default_strategy() -> _DefaultDistributionStrategy:
    global _default
    with _lock:
        if _default is None:
            _default = _DefaultDistributionStrategy()
        return _default


# What code outside every scope sees (``get_strategy``, ``get_replica_context``).
context.provide_default(default_strategy)
