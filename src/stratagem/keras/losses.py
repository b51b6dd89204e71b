"""``sg.keras.losses``: Keras loss objects, called as ``loss(y_true, y_pred)`` (Keras order).

With ``reduction=Reduction.NONE`` a loss returns one value per example, which custom loops pass
to ``sg.nn.compute_average_loss``; the other reductions average or sum over the batch.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
import torch.nn.functional as F


class Reduction(enum.Enum):
    """How a loss object reduces per-example losses (``sg.keras.losses.Reduction``)."""

    AUTO = "auto"
    NONE = "none"
    SUM = "sum"
    SUM_OVER_BATCH_SIZE = "sum_over_batch_size"

    @classmethod
    def parse(cls, value: Reduction | str) -> Reduction:
        if isinstance(value, Reduction):
            return value
        for member in cls:
            if isinstance(value, str) and value.lower() == member.value:
                return member
        raise ValueError(f"unknown reduction {value!r}; expected one of {[m.value for m in cls]}")


class Loss:
    """Base class: ``call(y_true, y_pred)`` gives per-example losses; ``__call__`` reduces."""

    def __init__(
        self, reduction: Reduction | str = Reduction.AUTO, name: str | None = None
    ) -> None:
        self.reduction = Reduction.parse(reduction)
        self.name = name or type(self).__name__

    def call(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> torch.Tensor:
        y_pred = torch.as_tensor(y_pred)
        y_true = torch.as_tensor(y_true, device=y_pred.device)
        losses = self.call(y_true, y_pred)
        if sample_weight is not None:
            losses = losses * torch.as_tensor(sample_weight, device=losses.device)
        if self.reduction is Reduction.NONE:
            return losses
        if self.reduction is Reduction.SUM:
            return losses.sum()
        return losses.sum() / max(1, losses.numel())


class SparseCategoricalCrossentropy(Loss):
    """Cross-entropy between integer labels and logits (``from_logits=True``) or probabilities."""

    def __init__(
        self,
        from_logits: bool = False,
        reduction: Reduction | str = Reduction.AUTO,
        name: str = "sparse_categorical_crossentropy",
    ) -> None:
        super().__init__(reduction, name)
        self.from_logits = from_logits

    def call(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        _check_labels(y_true, y_pred)
        labels = y_true.reshape(y_pred.shape[:-1]).long()
        logits = y_pred if self.from_logits else torch.log(y_pred.clamp_min(1e-7))
        flat = logits.reshape(-1, logits.shape[-1])
        return F.cross_entropy(flat, labels.reshape(-1), reduction="none").reshape(labels.shape)


def _check_labels(y_true: torch.Tensor, y_pred: torch.Tensor) -> None:
    """Integer class labels, one per prediction row, each a valid class."""
    rows, classes = y_pred.shape[:-1], y_pred.shape[-1]
    if y_true.numel() != rows.numel():
        hint = " (one-hot labels go with CategoricalCrossentropy)" if y_true.dim() == 2 else ""
        raise ValueError(
            f"SparseCategoricalCrossentropy takes one integer label per example (shape "
            f"{list(rows)}); got labels of shape {list(y_true.shape)}{hint}"
        )
    if y_true.is_floating_point() and not torch.equal(y_true, y_true.round()):
        raise ValueError(
            f"SparseCategoricalCrossentropy takes integer class labels; got {y_true.dtype} "
            f"values such as {y_true.flatten()[(y_true != y_true.round()).flatten()][0].item()}"
        )
    if y_true.numel():
        low, high = (int(v) for v in torch.aminmax(y_true))
        if low < 0 or high >= classes:
            raise ValueError(
                f"labels must be classes 0..{classes - 1} (the predictions have {classes}); "
                f"got values from {low} to {high}"
            )


class CategoricalCrossentropy(Loss):
    """Cross-entropy between one-hot (or soft) labels and logits or probabilities."""

    def __init__(
        self,
        from_logits: bool = False,
        reduction: Reduction | str = Reduction.AUTO,
        name: str = "categorical_crossentropy",
    ) -> None:
        super().__init__(reduction, name)
        self.from_logits = from_logits

    def call(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        if self.from_logits:
            log_probs = F.log_softmax(y_pred, dim=-1)
        else:
            log_probs = torch.log(y_pred.clamp_min(1e-7))
        return -(y_true.to(log_probs.dtype) * log_probs).sum(dim=-1)


class MeanSquaredError(Loss):
    """Squared error averaged over the last axis."""

    def __init__(
        self, reduction: Reduction | str = Reduction.AUTO, name: str = "mean_squared_error"
    ) -> None:
        super().__init__(reduction, name)

    def call(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        return ((y_pred - y_true.to(y_pred.dtype)) ** 2).mean(dim=-1)


_BY_NAME: dict[str, type[Loss]] = {
    "sparse_categorical_crossentropy": SparseCategoricalCrossentropy,
    "categorical_crossentropy": CategoricalCrossentropy,
    "mean_squared_error": MeanSquaredError,
    "mse": MeanSquaredError,
}


def get(identifier: Any) -> Loss:
    """A loss object from a Keras name or an object (returned as is)."""
    if isinstance(identifier, Loss):
        return identifier
    if isinstance(identifier, str) and identifier.lower() in _BY_NAME:
        return _BY_NAME[identifier.lower()]()
    raise ValueError(
        f"unknown loss {identifier!r}; expected one of {sorted(_BY_NAME)} or an "
        "sg.keras.losses.Loss object"
    )
