"""Metrics over a mesh: the seed's ``SparseCategoricalAccuracy(mesh=mesh)``.

Values arrive as DTensors split along ``batch`` (and perhaps holding partial sums along
``model``). Each update adds their sum to a running DTensor total without communicating;
DTensor keeps the total partial where the values were split, and ``result()`` reduces it over
the mesh once (one all-reduce), so every process reads the same global value. Plain tensors
work too (one process, no mesh); one metric takes either DTensors or plain tensors, not both.
"""

from __future__ import annotations

from typing import Any

import torch

from stratagem.dtensor.mesh import Mesh
from stratagem.dtensor.translate import DTensor


class Mean:
    """The mean of every value seen on every process of the mesh."""

    def __init__(self, name: str | None = None, mesh: Mesh | None = None) -> None:
        self.name = name or "mean"
        self.mesh = mesh
        self.reset_state()

    def reset_state(self) -> None:
        self._total: torch.Tensor | None = None
        self._count = 0  # global element counts are known without communication

    reset_states = reset_state

    def update_state(self, values: Any) -> None:
        with torch.no_grad():
            values = torch.as_tensor(values) if not isinstance(values, DTensor) else values
            total = values.to(torch.float64).sum()
            self._total = total if self._total is None else self._total + total
            self._count += values.numel()  # a DTensor's numel is the global one

    def result(self) -> torch.Tensor:
        if self._total is None or self._count == 0:
            return torch.zeros((), dtype=torch.float32)
        total = self._total
        if isinstance(total, DTensor):
            total = total.full_tensor()  # the one reduction over the mesh
        return (total / self._count).to(torch.float32)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, mesh={self.mesh})"


class SparseCategoricalAccuracy(Mean):
    """How often the arg-max of ``y_pred`` equals the integer label ``y_true``."""

    def __init__(self, name: str | None = None, mesh: Mesh | None = None) -> None:
        super().__init__(name or "sparse_categorical_accuracy", mesh)

    def update_state(self, y_true: Any, y_pred: Any) -> None:  # type: ignore[override]
        with torch.no_grad():
            super().update_state((y_pred.argmax(dim=-1) == y_true).to(torch.float32))
