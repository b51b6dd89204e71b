"""A toy strategy written against the public contract only (docs/architecture.md, "Writing a
strategy"): every replica runs on one device, in turn, in the calling thread.

Replicas share the parameters. Each replica's backward adds its gradient to them, so after the
last replica they hold the sum over replicas, which is what every strategy applies (the loss is
each replica's share of the global mean). Only the last replica's ``optimizer.step()`` may
update: the earlier replicas' gradients are set aside before their step (which then finds none
and does nothing) and added back before the last one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from typing_extensions import override

import stratagem as sg
from stratagem.comm import LocalCommunicator
from stratagem.distribute import StrategyExtended


class InTurnStrategy(sg.distribute.Strategy):
    """``num_replicas`` replicas on ``device``, run one after another."""

    def __init__(self, num_replicas: int = 2, device: str = "cpu:0") -> None:
        super().__init__(InTurnExtended(self, num_replicas, device))


class InTurnExtended(StrategyExtended):
    def __init__(self, container: sg.distribute.Strategy, num_replicas: int, device: str) -> None:
        super().__init__(container, [device] * num_replicas, comm=LocalCommunicator())
        self._held: dict[torch.Tensor, torch.Tensor] = {}  # parameter -> gradients set aside

    @override
    def run_replica_calls(self, calls: list[Callable[[], Any]]) -> list[Any]:
        # In turn, in this thread: the replicas cannot meet, and the core refuses their merge
        # calls (a strategy whose replicas meet derives from capabilities.MergesReplicas).
        return [call() for call in calls]

    @override
    def adopt(self, tensors: list[tuple[torch.Tensor, bool]]) -> None:
        pass  # the replicas share the parameters: nothing to copy

    @override
    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        ctx = sg.distribute.get_replica_context()
        last = ctx is None or ctx.local_replica_id == self.num_replicas_in_sync - 1
        for group in optimizer.param_groups:
            for p in group["params"]:
                held = self._held.pop(p, None) if last else None
                if last:
                    if held is not None:
                        p.grad = held if p.grad is None else p.grad + held
                elif p.grad is not None:
                    # Not the last replica: keep its gradient for the one update, skip this step.
                    kept = self._held.get(p)
                    self._held[p] = p.grad if kept is None else kept + p.grad
                    p.grad = None
