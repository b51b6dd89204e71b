"""``sg.keras.Model``'s fit, evaluate and predict steps on a strategy with ``PipelinedSteps``.

On a pipeline, ``Model`` runs its steps through these, so ``fit`` (callbacks, History,
checkpoints) stays the one loop every strategy shares. The model is cut on first use with
``strategy.pipeline`` (every process at the same step) and registered with the strategy, whose
checkpoints then gather the stages. Every process gets the whole global batch; a training step
cuts out this replica's part, pads it to a multiple of the micro-batches with copies of a real
row, gives the schedule each row's *index* as its target (``IndexedLoss`` looks up the target
and sample weight and counts real rows only, so the gradient is the global batch's mean loss's),
and runs the schedule; the last stage's ``compute_loss`` and metrics see the real rows, read by
every process through the metrics' all-reduce, so every process's callbacks see the same logs.
Evaluation and prediction run forward only, one whole part per replica, no micro-batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from stratagem.distribute.capabilities import PipelinedSteps
from stratagem.errors import ModelOutputError
from stratagem.keras.data_adapter import unpack_x_y_sample_weight as unpack
from stratagem.keras.losses import example_losses
from stratagem.pipeline.stages import PipelineModel

_STEP_METHODS = ("train_step", "test_step", "predict_step", "compute_loss")

PerExampleLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (y_true, y_pred)


class IndexedLoss:
    """The pipeline's loss during ``fit``: ``loss(outputs, rows)`` of one micro-batch, where
    ``rows`` are the micro-batch's row indices into the step's (padded) replica batch."""

    def __init__(self, per_example: PerExampleLoss) -> None:
        self._per_example = per_example
        self._y: torch.Tensor | None = None
        self._weights: torch.Tensor | None = None
        self._real = 0
        self._scale = 1.0

    def set_batch(
        self, y: torch.Tensor, weights: torch.Tensor | None, real: int, scale: float
    ) -> None:
        """The step's padded targets (and weights), how many leading rows are real, and the
        factor that turns a micro-batch's sum into its share of the global mean."""
        self._y, self._weights, self._real, self._scale = y, weights, real, scale

    def __call__(self, outputs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        assert self._y is not None, "IndexedLoss.set_batch was not called before the step"
        weights = None if self._weights is None else self._weights[rows]
        # Each example's loss as compute_loss reduces it (a loss per token: their mean).
        per_example = example_losses(self._per_example(self._y[rows], outputs), weights)
        real = (rows < self._real).to(per_example.dtype)
        return (per_example * real).sum() * self._scale


def _pad(t: torch.Tensor | None, rows: int, filler: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` with copies of ``filler`` (one row) appended up to ``rows`` rows."""
    if t is None or filler is None or t.shape[0] == rows:
        return t
    extra = filler.expand(rows - t.shape[0], *filler.shape[1:])
    return torch.cat([t, extra])


class KerasPipeline:
    """One Keras model's pipeline: this process's stage(s) of ``model.module``, and its steps."""

    def __init__(self, model: Any, pipe: PipelineModel, loss: IndexedLoss) -> None:
        self.model = model
        self.pipe = pipe
        self.loss = loss
        self._first_batch: int | None = None  # the first training batch's size (the nominal)

    @classmethod
    def build(cls, model: Any, extended: PipelinedSteps, x: Any) -> KerasPipeline:
        """Cut ``model.module`` into this process's stage(s), the first batch's inputs ``x``
        giving the sample a split by measured time needs."""
        overridden = [
            name
            for name in _STEP_METHODS
            if getattr(getattr(type(model), name), "__module__", None) != "stratagem.keras.model"
        ]
        if overridden:
            raise TypeError(
                f"{type(model).__name__} overrides {overridden}: PipelineStrategy runs fit, "
                "evaluate and predict through its schedule (the model is cut into stages on "
                "several processes), so a custom step cannot run; subclass without overriding "
                "these, or write the loop with strategy.pipeline(module, loss_fn)"
            )
        if model.losses:
            raise ValueError(
                f"{len(model.losses)} loss(es) added with model.add_loss: on a "
                "PipelineStrategy each stage holds some of the weights and the schedule computes "
                "the loss on the last stage only, so a penalty over weights of other stages "
                "cannot be added there; use the optimizer's weight_decay instead"
            )
        if model.dtype_policy.name != "float32":
            # Stages pass activations of the dtypes measured when the model is cut, and the
            # schedule runs backward itself (no loss scaling): not wired for autocast yet.
            raise ValueError(
                f"model {model.name!r} has dtype policy {model.dtype_policy.name!r}, but fit on "
                "a PipelineStrategy computes in float32 only: construct the model under the "
                "'float32' policy (sg.keras.Model(module, dtype='float32'))"
            )
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"a pipeline's inputs must be tensors (the first stage's input); got {type(x)}"
            )
        if model.loss is None:
            raise ModelOutputError(
                f"model {model.name!r} was compiled with no loss (its own loss would be the "
                "loss), but on a PipelineStrategy the last stage computes the loss from its "
                "outputs: compile a loss (model.compile(optimizer, loss=...))"
            )
        loss = IndexedLoss(lambda y, y_pred: model.loss.call(torch.as_tensor(y), y_pred))
        sample = x[: max(1, x.shape[0] // extended.num_microbatches)]
        pipe = extended.pipeline(model.module, loss, sample_input=sample)
        extended.register_whole_model(model.module, pipe)
        return cls(model, pipe, loss)

    def _part(self, n: int) -> tuple[int, int]:
        """This replica's rows ``[lo, hi)`` of a global batch of ``n`` rows."""
        r, replicas = self.pipe.replica, self.pipe.layout.num_replicas
        base, extra = divmod(n, replicas)
        lo = r * base + min(r, extra)
        return lo, lo + base + (1 if r < extra else 0)

    def _check_size(self, n: int) -> None:
        replicas, m = self.pipe.layout.num_replicas, self.pipe.num_microbatches
        if self._first_batch is None:
            self._first_batch = n
        if n % (replicas * m) and n >= self._first_batch:
            raise ValueError(
                f"a global batch of {n} examples does not split into {replicas} replica(s) x "
                f"{m} micro-batches: the batch size must be a multiple of num_replicas * "
                f"num_microbatches = {replicas * m} (only a last, smaller batch may be uneven; "
                "it is padded, and the padding does not count in the loss)"
            )

    def train_batch(self, batch: Any) -> None:
        x, y, weights = unpack(batch)
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            raise TypeError(
                "fit on a pipeline needs batches (x, y) or (x, y, sample_weight) of tensors; "
                f"got x of type {type(x).__name__} and y of type {type(y).__name__}"
            )
        n = x.shape[0]
        self._check_size(n)
        pipe = self.pipe
        replicas, m = pipe.layout.num_replicas, pipe.num_microbatches
        lo, hi = self._part(n)
        padded = math.ceil(math.ceil(n / replicas) / m) * m  # the same on every replica
        w = torch.as_tensor(weights) if weights is not None else None
        x_part = _pad(x[lo:hi], padded, x[:1])
        y_part = _pad(y[lo:hi], padded, y[:1])
        w_part = _pad(w[lo:hi], padded, w[:1]) if w is not None else None
        assert x_part is not None and y_part is not None
        self.loss.set_batch(y_part, w_part, hi - lo, m * replicas / n)
        rows = torch.arange(padded)
        outputs = pipe.train_replica_batch(
            # A middle stage too: its inputs come from the stage before, but its schedule is
            # picked by the batch's size.
            None if pipe.is_last_stage and not pipe.is_first_stage else x_part,
            rows if pipe.is_last_stage else None,
            self.model.optimizer.torch_optimizer,
        )
        if outputs is not None and hi > lo:
            self._track(x[lo:hi], y[lo:hi], outputs[: hi - lo], w[lo:hi] if w is not None else None)

    def test_batch(self, batch: Any) -> None:
        x, y, weights = unpack(batch)
        lo, hi = self._part(x.shape[0])
        if hi == lo:  # a batch smaller than the replicas: this replica has no rows
            return
        outputs = self.pipe.forward(x[lo:hi], to_every_stage=False)
        if outputs is not None:
            w = torch.as_tensor(weights)[lo:hi] if weights is not None else None
            y_part = y[lo:hi] if isinstance(y, torch.Tensor) else y
            self._track(x[lo:hi], y_part, outputs, w)

    def predict_batch(self, batch: Any) -> torch.Tensor:
        x, _, _ = unpack(batch)
        # Every replica predicts the whole batch, so the outputs reach every process without a
        # gather across replicas (with replicas, predictions cost replicas x the compute).
        return self.pipe.predict(x)

    def _track(self, x: Any, y: Any, y_pred: torch.Tensor, weights: Any) -> None:
        """The last stage: the model's loss tracker and metrics, as its own steps update them."""
        with torch.no_grad():
            self.model.compute_loss(x, y, y_pred, weights)
            self.model.update_metrics(y, y_pred, weights)
