"""``sg.keras.metrics``: streaming metrics whose state is summed over all replicas on read.

TF keeps metric variables "sync on read": each replica accumulates its own counts, and
``result()`` adds them up across replicas and workers. Here each local replica has its own state
tensors (replica threads never share one), and ``result()`` sums them and all-reduces across
workers, so the accuracy printed on every worker is the global one. ``result()`` in a
cross-replica context is a collective: every worker must call it, as in the seeds.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from stratagem.distribute import ReduceOp, Strategy, current_replica, get_strategy
from stratagem.keras.losses import match_rank, same_rank
from stratagem.shipping.portable import Portable


class Metric(Portable):
    """Base class: subclasses define the state (``_initial``), ``_accumulate`` and ``_compute``.
    ``direction`` is Keras 3's ``_direction``: whether higher (``"up"``) or lower (``"down"``)
    is better, which ``mode="auto"`` callbacks read; None when the metric does not say.

    A scheduled function of a ``ClusterCoordinator`` that updates a metric updates the worker's
    copy, which starts empty each call; its totals come back with the function's value and are
    added here, so the chief's ``result()`` is over every worker (TF's one value)."""

    direction: str | None = None
    _sg_local = ("_strategy", "_states", "_lock")
    _sg_accumulates = True

    _state_names: tuple[str, ...] = ()
    _state_shape: tuple[int, ...] = ()  # every state tensor's shape (scalars by default)

    def __init__(self, name: str | None = None, dtype: torch.dtype = torch.float32) -> None:
        self.name = name or _snake(type(self).__name__)
        self.dtype = dtype
        self._strategy: Strategy = get_strategy()
        self._states: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def _state(self, device: torch.device) -> list[torch.Tensor]:
        ctx = current_replica()
        replica = 0
        if ctx is not None:
            self._strategy = ctx.strategy
            replica = ctx.local_replica_id
        state = self._states.get(replica)
        if state is None:
            with self._lock:
                state = self._states.setdefault(
                    replica,
                    [
                        torch.zeros(self._state_shape, dtype=self.dtype, device=device)
                        for _ in self._state_names
                    ],
                )
        return state

    def update_state(self, *args: Any, **kwargs: Any) -> None:
        ctx = current_replica()
        if ctx is not None:  # on a mesh, the replica's own part of global values
            args, kwargs = ctx.strategy.extended.replica_values((args, kwargs))
        with torch.no_grad():
            self._accumulate(*args, **kwargs)

    def _accumulate(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def _compute(self, totals: list[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def _totals(self, *, across_workers: bool) -> list[torch.Tensor]:
        totals = torch.zeros((len(self._state_names), *self._state_shape), dtype=torch.float64)
        for state in list(self._states.values()):
            totals += torch.stack([s.detach().to("cpu", torch.float64) for s in state])
        if across_workers:
            self._strategy.extended.communicator.all_reduce(
                totals, ReduceOp.SUM, what=f"metric {self.name}"
            )
        return list(totals)

    def result(self) -> torch.Tensor:
        """The metric over every replica; inside ``run``, over this process's replicas only."""
        across = current_replica() is None
        return self._compute(self._totals(across_workers=across)).to(self.dtype)

    def reset_state(self) -> None:
        with self._lock:
            for state in self._states.values():
                for s in state:
                    s.zero_()

    reset_states = reset_state  # TF 2.x name, used by the seeds

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.update_state(*args, **kwargs)
        return self.result()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This process's accumulated state (checkpointing a metric is per process)."""
        totals = self._totals(across_workers=False)
        return {n: t.clone() for n, t in zip(self._state_names, totals)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = set(self._state_names) - set(state)
        if missing:
            raise KeyError(f"metric {self.name} state lacks {sorted(missing)}; got {sorted(state)}")
        self.reset_state()
        target = self._state(torch.device("cpu"))
        for s, n in zip(target, self._state_names):
            s.copy_(torch.as_tensor(state[n]))

    def global_state(self) -> torch.Tensor:
        """The state summed over every replica of every worker, stacked: a collective, which
        every worker calls. What a mid-epoch backup saves of an epoch's metric so far."""
        return torch.stack(self._totals(across_workers=True))

    def load_global_state(self, totals: torch.Tensor, *, holder: bool) -> None:
        """Make ``totals`` (from ``global_state``) the state over all replicas: this process's
        first replica holds them when ``holder`` (one process in all), the others hold zeros, so
        ``result()``'s sum across replicas is ``totals``."""
        expected = (len(self._state_names), *self._state_shape)
        if tuple(totals.shape) != expected:
            raise ValueError(
                f"metric {self.name}: saved state of shape {tuple(totals.shape)} does not fit "
                f"this metric's {expected}"
            )
        self.reset_state()
        if holder:
            device = self._strategy.extended.replica_devices[0]
            for s, t in zip(self._state(device), totals):
                s.copy_(t)

    def _sg_after_rebuild(self) -> None:
        self._strategy = get_strategy()
        self._states = {}
        self._lock = threading.Lock()

    def _sg_totals(self) -> torch.Tensor:
        return torch.stack(self._totals(across_workers=False))

    def _sg_add_totals(self, totals: torch.Tensor) -> None:
        expected = (len(self._state_names), *self._state_shape)
        if tuple(totals.shape) != expected:
            raise ValueError(
                f"metric {self.name}: a worker's totals of shape {tuple(totals.shape)} do not "
                f"fit this metric's {expected}"
            )
        with torch.no_grad():
            for s, t in zip(self._state(torch.device("cpu")), totals):
                s.add_(t.to(s.device, s.dtype))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _snake(name: str) -> str:
    out = "".join("_" + c.lower() if c.isupper() else c for c in name)
    return out.lstrip("_")


def _weights(sample_weight: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if sample_weight is None:
        return torch.ones_like(like, dtype=torch.float32)
    return torch.as_tensor(sample_weight, device=like.device).to(torch.float32).expand_as(like)


class Mean(Metric):
    """The (weighted) mean of the values seen."""

    _state_names = ("total", "count")

    def _accumulate(self, values: Any, sample_weight: Any = None) -> None:
        values = torch.as_tensor(values).to(torch.float32)
        total, count = self._state(values.device)
        if sample_weight is None:  # the common case, called every step: no weight tensor
            total += values.sum()
            count += values.numel()
            return
        w = _weights(sample_weight, values)
        total += (values * w).sum()
        count += w.sum()

    def _compute(self, totals: list[torch.Tensor]) -> torch.Tensor:
        total, count = totals
        return total / count if count > 0 else torch.zeros((), dtype=torch.float64)


class Sum(Metric):
    """The sum of the values seen."""

    _state_names = ("total",)

    def _accumulate(self, values: Any, sample_weight: Any = None) -> None:
        values = torch.as_tensor(values).to(torch.float32)
        (total,) = self._state(values.device)
        total += (values * _weights(sample_weight, values)).sum()

    def _compute(self, totals: list[torch.Tensor]) -> torch.Tensor:
        return totals[0]


class MeanMetricWrapper(Mean):
    """The mean over examples of ``fn(y_true, y_pred)`` (one value per example, as a Keras loss
    function gives), weighted by ``sample_weight``; Keras's wrapper for metrics such as
    ``MeanSquaredError``. Its totals are summed over replicas and workers like any ``Mean``."""

    def __init__(
        self, fn: Any, name: str | None = None, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__(name, dtype)
        self._fn = fn

    def _accumulate(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        y_pred = torch.as_tensor(y_pred)
        # tf.keras's wrapper reconciles the ranks before the function sees them.
        y_true, y_pred = match_rank(torch.as_tensor(y_true, device=y_pred.device), y_pred)
        values = self._fn(y_true, y_pred)
        if sample_weight is not None:
            sample_weight = torch.as_tensor(sample_weight, device=values.device)
            sample_weight = (
                sample_weight.reshape(values.shape)
                if (sample_weight.numel() == values.numel())
                else sample_weight
            )
        super()._accumulate(values, sample_weight)


class _LossMetric(MeanMetricWrapper):
    """A metric that is the mean of a Keras loss's per-example values."""

    loss_class: Any = None
    direction = "down"

    def __init__(self, name: str | None = None, dtype: torch.dtype = torch.float32, **options: Any):
        from stratagem.keras import losses

        loss = getattr(losses, self.loss_class)(**options)
        super().__init__(loss.call, name or _snake(type(self).__name__), dtype)


class MeanSquaredError(_LossMetric):
    """The mean of ``(y_pred - y_true)**2`` (over the last axis, then the examples)."""

    loss_class = "MeanSquaredError"


class MeanAbsoluteError(_LossMetric):
    """The mean of ``|y_pred - y_true|`` (over the last axis, then the examples)."""

    loss_class = "MeanAbsoluteError"


class KLDivergence(_LossMetric):
    """The mean Kullback-Leibler divergence between labels and predictions."""

    loss_class = "KLDivergence"


class BinaryCrossentropy(_LossMetric):
    """The mean binary cross-entropy (``from_logits``, ``label_smoothing`` as the loss)."""

    loss_class = "BinaryCrossentropy"

    def __init__(
        self,
        name: str = "binary_crossentropy",
        dtype: torch.dtype = torch.float32,
        from_logits: bool = False,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__(name, dtype, from_logits=from_logits, label_smoothing=label_smoothing)


class CategoricalCrossentropy(_LossMetric):
    """The mean categorical cross-entropy (``from_logits``, ``label_smoothing`` as the loss)."""

    loss_class = "CategoricalCrossentropy"

    def __init__(
        self,
        name: str = "categorical_crossentropy",
        dtype: torch.dtype = torch.float32,
        from_logits: bool = False,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__(name, dtype, from_logits=from_logits, label_smoothing=label_smoothing)


class SparseCategoricalCrossentropy(_LossMetric):
    """The mean sparse categorical cross-entropy of integer labels."""

    loss_class = "SparseCategoricalCrossentropy"

    def __init__(
        self,
        name: str = "sparse_categorical_crossentropy",
        dtype: torch.dtype = torch.float32,
        from_logits: bool = False,
    ) -> None:
        super().__init__(name, dtype, from_logits=from_logits)


class _MatchRate(Mean):
    """A mean of per-example 0/1 matches; subclasses say what a match is."""

    direction = "up"

    def _matches(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _accumulate(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        y_true, y_pred = torch.as_tensor(y_true), torch.as_tensor(y_pred)
        super()._accumulate(self._matches(y_true, y_pred).to(torch.float32), sample_weight)


class BinaryAccuracy(_MatchRate):
    """How often a prediction above ``threshold`` matches a 1 label (and not above it, 0)."""

    def __init__(
        self, name: str = "binary_accuracy", dtype: torch.dtype = torch.float32,
        threshold: float = 0.5,
    ) -> None:  # fmt: skip
        super().__init__(name, dtype)
        self.threshold = threshold

    def _matches(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        y_true, y_pred = same_rank(y_true.to(y_pred.device), y_pred)
        matches = (y_pred > self.threshold).to(y_true.dtype) == y_true
        return matches.float().mean(dim=-1) if matches.dim() > 1 else matches


class SparseCategoricalAccuracy(_MatchRate):
    """How often the arg-max of the predictions equals the integer label."""

    def _matches(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        labels = y_true.reshape(y_pred.shape[:-1]) if y_true.dim() == y_pred.dim() else y_true
        return y_pred.argmax(dim=-1) == labels.to(y_pred.device).long()


class CategoricalAccuracy(_MatchRate):
    """How often the arg-max of the predictions equals the arg-max of one-hot labels."""

    def _matches(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        return y_pred.argmax(dim=-1) == y_true.to(y_pred.device).argmax(dim=-1)


class Accuracy(_MatchRate):
    """How often predictions equal labels exactly."""

    def _matches(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        y_true, y_pred = match_rank(y_true.to(y_pred.device), y_pred)
        return y_pred == y_true


class _CompiledAccuracy(_MatchRate):
    """What ``compile(metrics=["accuracy"])`` gives, chosen from the shapes as Keras does
    (tf.keras's ``compile_utils.MetricsContainer``, Keras 3's ``CompileMetrics``): binary when
    the prediction's last dimension is 1, sparse categorical when the labels have a lower rank
    (or a last dimension of 1 against several classes), categorical otherwise. Predictions of
    rank 1 (a torch binary head's ``(N,)``) are binary: Keras would take their batch dimension
    for classes."""

    direction = "up"

    def __init__(self, name: str = "accuracy", dtype: torch.dtype = torch.float32) -> None:
        super().__init__(name, dtype)
        self.threshold = 0.5  # BinaryAccuracy's, when the shapes say binary

    def _matches(self, y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
        # The chosen class's rule, applied to this metric's own state.
        return self._kind(y_true, y_pred)._matches(self, y_true, y_pred)  # type: ignore[arg-type]

    @staticmethod
    def _kind(y_true: torch.Tensor, y_pred: torch.Tensor) -> type[_MatchRate]:
        if y_pred.dim() <= 1 or y_pred.shape[-1] == 1:
            return BinaryAccuracy
        y_true_last = y_true.shape[-1] if y_true.dim() else None
        if y_true.dim() < y_pred.dim() or y_true_last == 1:
            return SparseCategoricalAccuracy
        return CategoricalAccuracy


class AUC(Metric):
    """Area under the ROC curve, from confusion counts at ``num_thresholds`` thresholds (as
    Keras: predictions are probabilities, or logits with ``from_logits=True``; labels 0/1;
    everything is flattened). The counts are summed over replicas and workers on read."""

    _state_names = ("true_positives", "false_positives", "true_negatives", "false_negatives")
    direction = "up"

    def __init__(
        self, num_thresholds: int = 200, from_logits: bool = False, name: str | None = None
    ) -> None:
        if isinstance(num_thresholds, bool) or not isinstance(num_thresholds, int):
            raise ValueError(f"num_thresholds must be an integer > 1; got {num_thresholds!r}")
        if num_thresholds < 2:
            raise ValueError(f"num_thresholds must be an integer > 1; got {num_thresholds!r}")
        super().__init__(name or "auc")
        self.from_logits = from_logits
        self._state_shape = (num_thresholds,)
        inner = [(i + 1) / (num_thresholds - 1) for i in range(num_thresholds - 2)]
        self.thresholds = torch.tensor([-1e-7, *inner, 1 + 1e-7], dtype=torch.float64)

    def _accumulate(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        y_pred = torch.as_tensor(y_pred).to(torch.float64).flatten()
        if self.from_logits:
            y_pred = torch.sigmoid(y_pred)
        labels = torch.as_tensor(y_true, device=y_pred.device).to(torch.float64).flatten()
        if labels.shape != y_pred.shape:
            raise ValueError(
                f"AUC takes one 0/1 label per prediction; got {labels.numel()} labels for "
                f"{y_pred.numel()} predictions"
            )
        w = _weights(sample_weight, labels).to(torch.float64).flatten()
        above = y_pred[None, :] > self.thresholds.to(y_pred.device)[:, None]
        positive, negative = labels * w, (1 - labels) * w
        tp, fp, tn, fn = self._state(y_pred.device)
        tp += (above * positive).sum(1).to(tp.dtype)
        fp += (above * negative).sum(1).to(fp.dtype)
        tn += (~above * negative).sum(1).to(tn.dtype)
        fn += (~above * positive).sum(1).to(fn.dtype)

    def _compute(self, totals: list[torch.Tensor]) -> torch.Tensor:
        tp, fp, tn, fn = totals
        tpr = tp / (tp + fn).clamp_min(1e-12)
        fpr = fp / (fp + tn).clamp_min(1e-12)
        # Thresholds ascend, so both rates descend: trapezoids between neighbours.
        return ((fpr[:-1] - fpr[1:]) * (tpr[:-1] + tpr[1:]) / 2).sum()


def get(identifier: Any) -> Metric:
    """A metric from a Keras name (``"accuracy"`` follows the shapes, as in Keras) or an
    object."""
    if isinstance(identifier, Metric):
        return identifier
    name = identifier.lower() if isinstance(identifier, str) else None
    if name in ("accuracy", "acc"):
        return _CompiledAccuracy(name=identifier)  # chosen from the shapes, as in Keras
    if isinstance(identifier, type) and issubclass(identifier, Metric):
        return identifier()
    by_name: dict[str, Any] = {
        "sparse_categorical_accuracy": SparseCategoricalAccuracy,
        "categorical_accuracy": CategoricalAccuracy,
        "binary_accuracy": BinaryAccuracy,
        "auc": AUC,
        "mean_squared_error": MeanSquaredError,
        "mse": MeanSquaredError,
        "mean_absolute_error": MeanAbsoluteError,
        "mae": MeanAbsoluteError,
        "kl_divergence": KLDivergence,
        "kld": KLDivergence,
        "binary_crossentropy": BinaryCrossentropy,
        "categorical_crossentropy": CategoricalCrossentropy,
        "sparse_categorical_crossentropy": SparseCategoricalCrossentropy,
    }
    if name in by_name:
        return by_name[name](name=identifier)  # Keras names the metric as it was asked for
    if callable(identifier) and not isinstance(identifier, str):
        return MeanMetricWrapper(identifier, name=getattr(identifier, "__name__", None))
    raise ValueError(
        f"unknown metric {identifier!r}; expected 'accuracy', one of {sorted(by_name)}, or an "
        "sg.keras.metrics.Metric object"
    )


__all__ = [
    "AUC",
    "Accuracy",
    "BinaryAccuracy",
    "BinaryCrossentropy",
    "CategoricalAccuracy",
    "CategoricalCrossentropy",
    "KLDivergence",
    "Mean",
    "MeanAbsoluteError",
    "MeanMetricWrapper",
    "MeanSquaredError",
    "Metric",
    "SparseCategoricalAccuracy",
    "SparseCategoricalCrossentropy",
    "Sum",
    "get",
]
