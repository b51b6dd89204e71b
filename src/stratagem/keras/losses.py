"""``sg.keras.losses``: Keras loss objects, called as ``loss(y_true, y_pred)`` (Keras order).

With ``reduction=Reduction.NONE`` a loss returns one value per example, which custom loops pass
to ``sg.nn.compute_average_loss``; the other reductions average or sum over the batch.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
import torch.nn.functional as F

from stratagem.shipping.portable import Portable


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


class Loss(Portable):
    """Base class: ``call(y_true, y_pred)`` gives per-example losses; ``__call__`` reduces.
    A coordinator's worker rebuilds a loss from its attributes (``Portable``)."""

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
    """Cross-entropy between integer labels and logits (``from_logits=True``) or probabilities.

    Labels on the CPU are checked on every call (integers, each a class of the predictions).
    On an accelerator only the first batch's are: reading them on the host makes it wait for
    the device in every step, so the GPU idles while Python queues the rest of the step (see
    ``benchmarks/gpu_sync_points.py``); later batches are left to ``cross_entropy``'s own
    device-side check."""

    # The devices whose labels were checked once: this process's own, remade on a worker.
    _sg_local = ("_labels_checked_on",)

    def __init__(
        self,
        from_logits: bool = False,
        reduction: Reduction | str = Reduction.AUTO,
        name: str = "sparse_categorical_crossentropy",
    ) -> None:
        super().__init__(reduction, name)
        self.from_logits = from_logits
        self._labels_checked_on: set[torch.device] = set()

    def _sg_after_rebuild(self) -> None:
        self._labels_checked_on = set()

    def call(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        _check_label_shape(y_true, y_pred)
        if y_true.device.type == "cpu" or y_true.device not in self._labels_checked_on:
            _check_label_values(y_true, y_pred)
            if y_true.device.type != "cpu":
                self._labels_checked_on.add(y_true.device)
        labels = y_true.reshape(y_pred.shape[:-1]).long()
        logits = y_pred if self.from_logits else torch.log(y_pred.clamp_min(1e-7))
        flat = logits.reshape(-1, logits.shape[-1])
        return F.cross_entropy(flat, labels.reshape(-1), reduction="none").reshape(labels.shape)


def example_losses(per_example: torch.Tensor, sample_weight: torch.Tensor | None) -> torch.Tensor:
    """One loss per example from a loss's unreduced values, weighted as Keras weights them:
    ``(N,)`` weights for ``(N, 1)`` values, one weight per example for a loss per token; several
    values per example (a label per token, per pixel) become their mean, as Keras's loss is the
    mean over every element. What ``Model.compute_loss`` and the pipelined steps both reduce."""
    if sample_weight is not None:
        weights = sample_weight.to(per_example.device, per_example.dtype)
        if weights.numel() == per_example.numel():  # (N,) weights for (N, 1) rows
            weights = weights.reshape(per_example.shape)
        elif weights.dim() == 1 and per_example.dim() > 1:  # one weight per example
            weights = weights.reshape(-1, *[1] * (per_example.dim() - 1))
        per_example = per_example * weights
    if per_example.dim() > 1:
        per_example = per_example.flatten(1).mean(1)
    return per_example


def _check_label_shape(y_true: torch.Tensor, y_pred: torch.Tensor) -> None:
    """One label per prediction row (shapes only: no wait for the device)."""
    rows = y_pred.shape[:-1]
    if y_true.numel() != rows.numel():
        hint = " (one-hot labels go with CategoricalCrossentropy)" if y_true.dim() == 2 else ""
        raise ValueError(
            f"SparseCategoricalCrossentropy takes one integer label per example (shape "
            f"{list(rows)}); got labels of shape {list(y_true.shape)}{hint}"
        )


def _check_label_values(y_true: torch.Tensor, y_pred: torch.Tensor) -> None:
    """Integer class labels, each a valid class (reads the labels on the host)."""
    classes = y_pred.shape[-1]
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


_EPSILON = 1e-7  # keras.backend.epsilon()


def match_rank(y_true: torch.Tensor, y_pred: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets and predictions of reconciled ranks, as tf.keras compares them in a compiled loss
    or metric. First ``compile_utils.match_dtype_and_rank``: a rank-1 target against rank-2
    predictions gains a last axis, so ``(N,)`` labels against a ``(N, C)`` output are compared
    with each of the C columns (never broadcast to a batch-by-batch table). Then the loss
    wrapper's rule (Keras 3's ``squeeze_or_expand_to_same_rank``): when the ranks differ by one
    and the longer one ends in a dimension of 1, a rank-1 tensor gains that dimension and any
    other loses it. Values are untouched; dtypes too."""
    if y_true.dim() == 1 and y_pred.dim() == 2:
        y_true = y_true.unsqueeze(-1)
    if y_true.dim() == y_pred.dim() + 1 and y_true.shape[-1] == 1:
        if y_pred.dim() == 1:
            y_pred = y_pred.unsqueeze(-1)
        else:
            y_true = y_true.squeeze(-1)
    elif y_pred.dim() == y_true.dim() + 1 and y_pred.shape[-1] == 1:
        if y_true.dim() == 1:
            y_true = y_true.unsqueeze(-1)
        else:
            y_pred = y_pred.squeeze(-1)
    return y_true, y_pred


def same_rank(y_true: torch.Tensor, y_pred: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``match_rank``, the target then cast to the predictions' dtype (what a loss computes
    with)."""
    y_true, y_pred = match_rank(y_true, y_pred)
    return y_true.to(y_pred.dtype), y_pred


def _mean_last(values: torch.Tensor) -> torch.Tensor:
    # Keras averages over the last axis; a rank-0 or rank-1 tensor is already per example.
    return values.mean(dim=-1) if values.dim() > 1 else values


class CategoricalCrossentropy(Loss):
    """Cross-entropy between one-hot (or soft) labels and logits or probabilities (which Keras
    renormalises to sum to 1); ``label_smoothing`` mixes the labels with the uniform one."""

    def __init__(
        self,
        from_logits: bool = False,
        label_smoothing: float = 0.0,
        axis: int = -1,
        reduction: Reduction | str = Reduction.AUTO,
        name: str = "categorical_crossentropy",
    ) -> None:
        super().__init__(reduction, name)
        self.from_logits, self.label_smoothing, self.axis = from_logits, label_smoothing, axis

    def call(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        if y_true.shape != y_pred.shape:
            raise ValueError(
                f"CategoricalCrossentropy takes labels shaped as the predictions (one-hot); got "
                f"labels {list(y_true.shape)} for predictions {list(y_pred.shape)} (integer "
                "labels go with SparseCategoricalCrossentropy)"
            )
        y_true = y_true.to(y_pred.dtype)
        if self.label_smoothing:
            classes = y_pred.shape[self.axis]
            y_true = y_true * (1.0 - self.label_smoothing) + self.label_smoothing / classes
        if self.from_logits:
            log_probs = F.log_softmax(y_pred, dim=self.axis)
        else:
            probs = y_pred / y_pred.sum(dim=self.axis, keepdim=True)
            log_probs = torch.log(probs.clamp(_EPSILON, 1.0 - _EPSILON))
        return -(y_true * log_probs).sum(dim=self.axis)


class BinaryCrossentropy(Loss):
    """Cross-entropy of 0/1 (or soft) labels against probabilities or logits, averaged over the
    last axis (Keras); ``label_smoothing`` moves the labels towards 0.5."""

    def __init__(
        self,
        from_logits: bool = False,
        label_smoothing: float = 0.0,
        axis: int = -1,
        reduction: Reduction | str = Reduction.AUTO,
        name: str = "binary_crossentropy",
    ) -> None:
        super().__init__(reduction, name)
        self.from_logits, self.label_smoothing, self.axis = from_logits, label_smoothing, axis

    def call(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        y_true, y_pred = same_rank(y_true, y_pred)
        try:  # a (N, 1) target against (N, C) outputs labels every column, as in tf.keras
            y_true = y_true.expand_as(y_pred)
        except RuntimeError:
            raise ValueError(
                f"BinaryCrossentropy takes one label per prediction; got labels "
                f"{list(y_true.shape)} for predictions {list(y_pred.shape)}"
            ) from None
        if self.label_smoothing:
            y_true = y_true * (1.0 - self.label_smoothing) + 0.5 * self.label_smoothing
        if self.from_logits:
            values = F.binary_cross_entropy_with_logits(y_pred, y_true, reduction="none")
        else:
            clipped = y_pred.clamp(_EPSILON, 1.0 - _EPSILON)
            values = F.binary_cross_entropy(clipped, y_true, reduction="none")
        return values.mean(dim=self.axis) if values.dim() > 1 else values


class MeanSquaredError(Loss):
    """Squared error averaged over the last axis."""

    def __init__(
        self, reduction: Reduction | str = Reduction.AUTO, name: str = "mean_squared_error"
    ) -> None:
        super().__init__(reduction, name)

    def call(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        y_true, y_pred = same_rank(y_true, y_pred)
        return _mean_last((y_pred - y_true) ** 2)


class MeanAbsoluteError(Loss):
    """Absolute error averaged over the last axis."""

    def __init__(
        self, reduction: Reduction | str = Reduction.AUTO, name: str = "mean_absolute_error"
    ) -> None:
        super().__init__(reduction, name)

    def call(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        y_true, y_pred = same_rank(y_true, y_pred)
        return _mean_last((y_pred - y_true).abs())


class Huber(Loss):
    """Squared error for errors up to ``delta``, linear beyond, averaged over the last axis."""

    def __init__(
        self,
        delta: float = 1.0,
        reduction: Reduction | str = Reduction.AUTO,
        name: str = "huber_loss",
    ) -> None:
        super().__init__(reduction, name)
        self.delta = float(delta)

    def call(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        y_true, y_pred = same_rank(y_true, y_pred)
        error = (y_pred - y_true).abs()
        quadratic = error.clamp_max(self.delta)
        linear = error - quadratic
        return _mean_last(0.5 * quadratic**2 + self.delta * linear)


class KLDivergence(Loss):
    """Kullback-Leibler divergence ``sum(y_true * log(y_true / y_pred))`` over the last axis,
    both clipped to ``[1e-7, 1]`` as Keras does."""

    def __init__(
        self, reduction: Reduction | str = Reduction.AUTO, name: str = "kl_divergence"
    ) -> None:
        super().__init__(reduction, name)

    def call(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        y_true, y_pred = same_rank(y_true, y_pred)
        y_true, y_pred = y_true.clamp(_EPSILON, 1.0), y_pred.clamp(_EPSILON, 1.0)
        values = y_true * torch.log(y_true / y_pred)
        return values.sum(dim=-1) if values.dim() > 1 else values


_BY_NAME: dict[str, type[Loss]] = {
    "sparse_categorical_crossentropy": SparseCategoricalCrossentropy,
    "categorical_crossentropy": CategoricalCrossentropy,
    "binary_crossentropy": BinaryCrossentropy,
    "mean_squared_error": MeanSquaredError,
    "mse": MeanSquaredError,
    "mean_absolute_error": MeanAbsoluteError,
    "mae": MeanAbsoluteError,
    "huber": Huber,
    "huber_loss": Huber,
    "kl_divergence": KLDivergence,
    "kld": KLDivergence,
    "kullback_leibler_divergence": KLDivergence,
}


def get(identifier: Any) -> Loss:
    """A loss object from a Keras name (``"mse"``, ``"binary_crossentropy"``...), a class, or
    an object (returned as is)."""
    if isinstance(identifier, Loss):
        return identifier
    if isinstance(identifier, type) and issubclass(identifier, Loss):
        return identifier()
    if isinstance(identifier, str) and identifier.lower() in _BY_NAME:
        return _BY_NAME[identifier.lower()]()
    raise ValueError(
        f"unknown loss {identifier!r}; expected one of {sorted(_BY_NAME)} or an "
        "sg.keras.losses.Loss object"
    )


__all__ = [
    "BinaryCrossentropy",
    "CategoricalCrossentropy",
    "Huber",
    "KLDivergence",
    "Loss",
    "MeanAbsoluteError",
    "MeanSquaredError",
    "Reduction",
    "SparseCategoricalCrossentropy",
    "get",
]
