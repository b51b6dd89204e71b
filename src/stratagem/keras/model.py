"""``sg.keras.Model``: Keras's compile / fit / evaluate / predict around an ``nn.Module``.

The loops are written once, over the Strategy interface: global batches go through
``strategy.experimental_distribute_dataset``, each step is ``strategy.run(self.train_step, ...)``
(on a strategy with ``PipelinedSteps``, ``pipeline_steps.py`` runs the schedule instead), and
metrics are read in the cross-replica context. The default strategy makes the same code
single-device training; ``train_step`` and ``test_step`` are the override points. Each
replica's loss is divided by the *global* batch (``sg.nn.compute_average_loss``) and the
strategy sums gradients, so the update equals one device training on the whole batch. Any model
trains, not only Keras-shaped ones (``module_calls.py``: Hugging Face's, with its own loss).
The pieces that stand alone live beside it (``data_adapter``, ``pipeline_steps``,
``coordinated``, ``saving``, ``callbacks/``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from stratagem import nn as sg_nn
from stratagem.distribute import (
    PerReplica,
    ReduceOp,
    Strategy,
    capabilities,
    get_strategy,
    has_strategy,
    owner_of,
)
from stratagem.errors import InputError, MembershipChanged
from stratagem.keras import callbacks as callbacks_module
from stratagem.keras import (
    coordinated,
    epoch_iterator,
    losses,
    metrics,
    module_calls,
    optimizers,
    saving,
)
from stratagem.keras.coordinated import WorkerBatches
from stratagem.keras.data_adapter import DataPosition, FitData
from stratagem.keras.data_adapter import unpack_x_y_sample_weight as unpack
from stratagem.keras.mixed_precision import LossScaleOptimizer
from stratagem.keras.mixed_precision import policy as dtype_policies
from stratagem.keras.saving import example_for
from stratagem.keras.step_runner import BatchSteps, LocalSteps, StepRunner
from stratagem.keras.token_loss import GlobalTokens
from stratagem.recompute import recompute_grad
from stratagem.shipping.portable import Portable
from stratagem.train import Checkpoint, latest_checkpoint
from stratagem.train.storage import is_checkpoint

if TYPE_CHECKING:
    from stratagem.distribute.coordinator import ClusterCoordinator
    from stratagem.keras.pipeline_steps import KerasPipeline

Logs = dict[str, float]


@dataclasses.dataclass(frozen=True)
class InPlaceStart:
    """Where an execution of ``fit``'s steps started: what going on in place after a lost
    peer goes back to (the data's position and iterator state, the optimizer's steps, the
    epoch's step)."""

    position: DataPosition
    iterator_state: dict[str, Any] | None
    iterations: int
    step: int


class Model(Portable):
    """A module with Keras's training API. Build the module inside ``strategy.scope()`` to
    distribute it; ``Model(module)`` remembers that strategy (as a Keras model does), and
    the dtype policy: ``dtype`` (a ``mixed_precision.Policy`` or its name), else the global
    policy of now (as a Keras layer reads it when constructed).

    ``remat=True`` checkpoints each direct child of ``module`` (``sg.recompute_grad``): its
    activations are recomputed during backward instead of kept, as under Keras 3's
    ``RematScope(mode="full")``.

    On the chief of a cluster with a chief (``ParameterServerStrategy`` with a
    ``ClusterCoordinator``), ``fit`` and ``evaluate`` schedule their steps on the workers
    (``keras.coordinated``), which rebuild the model from its state for each function."""

    # What a coordinator's worker does not get (``Portable``): this process's fit and its
    # compiled forward (the worker runs the module eagerly).
    _sg_local = (
        "history",
        "_fit_data",
        "_pipeline",
        "_forward",
        "_example_input",
        "_global_tokens",
    )

    def __init__(
        self,
        module: torch.nn.Module,
        name: str | None = None,
        dtype: Any = None,
        *,
        remat: bool = False,
    ) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"sg.keras.Model wraps a torch.nn.Module, got {type(module).__name__}")
        if remat:
            # Keras 3's RematScope(mode="full") for a whole model: each block (direct child)
            # keeps only its input for backward and recomputes the rest there.
            for block in list(module.children()) or [module]:
                recompute_grad(block)
        self.module = module
        self.name = name or type(module).__name__
        self.dtype_policy = dtype_policies.policy_of(dtype)
        dtype_policies.check_module(self.dtype_policy, module, f"sg.keras.Model({self.name})")
        self.distribute_strategy: Strategy = _strategy_of(module, self.name)
        self.distribute_strategy.extended.adopt_model(module)
        self.optimizer: optimizers.BoundOptimizer | None = None
        self.loss: losses.Loss | None = None
        # compile(output=...): the output the compiled loss, metrics and predict read.
        self.output_name: module_calls.OutputName | None = None
        self.compiled_metrics: list[metrics.Metric] = []
        self.stop_training = False
        self.history: callbacks_module.History | None = None
        self._loss_tracker: metrics.Mean | None = None
        self._initial_epoch = 0
        self._initial_step = 0  # batches of the initial epoch already done (a resumed fit)
        self._fit_data: FitData | None = None  # while fit runs
        self._example_input: torch.Tensor | None = None  # for torch.export in save()
        self._pipeline: KerasPipeline | None = None  # this process's stages, on a pipeline
        self._added_losses: list[Callable[[], torch.Tensor]] = []
        self.steps_per_execution = 1
        self.jit_compile = False
        self._forward: Callable[..., Any] | None = None  # the compiled module, jit_compile=True
        self._global_tokens = GlobalTokens()  # fit's counts of real tokens (token_loss)
        self._token_counted = False  # whether the latest step's module got the count

    def __call__(self, *args: Any, training: bool | None = None, **kwargs: Any) -> Any:
        """The module on the inputs, as Keras's ``model(x, training=...)``: ``training=True``
        (False) runs this call in torch's train (eval) mode, the modes restored after, and
        reaches ``forward`` only where it takes a ``training`` argument; None keeps the
        module's mode. A dict ``x`` of ``forward``'s parameters reaches it as keywords."""
        if args and isinstance(args[0], torch.Tensor):
            self._remember_example(args[0])  # calling the model builds it, as in Keras
        signature = module_calls.forward_signature(self.module)
        if len(args) == 1 and isinstance(args[0], Mapping):
            args, kwargs = module_calls.call_arguments(signature, args[0], kwargs)
        if training is not None and signature.takes("training"):
            kwargs["training"] = training
        with module_calls.training_mode(self.module, training):
            return self._call_module(*args, **kwargs)

    def _call_module(self, *args: Any, **kwargs: Any) -> Any:
        """The module (compiled, with ``jit_compile``) under the dtype policy (autocast for a
        mixed policy)."""
        policy, forward = self.dtype_policy, self._forward or self.module
        if policy.name == "float32":
            return forward(*args, **kwargs)
        args, kwargs = dtype_policies.cast_inputs(policy, (args, kwargs))
        with dtype_policies.compute_scope(policy, _device_type(args, self.module)):
            return forward(*args, **kwargs)

    @property
    def compute_dtype(self) -> str:
        return self.dtype_policy.compute_dtype

    @property
    def variable_dtype(self) -> str:
        return self.dtype_policy.variable_dtype

    @property
    def built(self) -> bool:
        """Whether the model has seen an input (called, fit, predicted, or ``build``): what
        ``save`` needs to export the module's program."""
        return self._example_input is not None

    @property
    def example_input(self) -> torch.Tensor | None:
        """The input ``save`` traces the module's program on: two rows of the first input the
        model saw, or zeros of ``build``'s shape; None before either."""
        return self._example_input

    def build(self, input_shape: Sequence[int | None]) -> None:
        """Keras's ``build(input_shape)``: give the model the shape of its input (the batch
        dimension may be None) without calling it on data, as a Keras layer's ``input_shape=``
        does; ``save`` traces the module's program on zeros of it."""
        self._example_input = example_for(self.module, input_shape)

    # ------------------------------------------------------------------ added losses

    def add_loss(self, loss: Callable[[], torch.Tensor]) -> None:
        """Add a loss term to training, as Keras's ``add_loss`` with a zero-argument callable
        (TF 2's form for weight penalties): ``model.add_loss(lambda: L2(1e-4)(fc.weight))``, or
        ``sg.keras.regularizers.penalty(...)``. It is computed afresh at every step and added
        to the loss ``fit`` minimises, once per global batch (divided among the replicas, as
        TF's ``scale_regularization_loss``); the logged ``loss`` is the total, as Keras 3
        logs it."""
        if not callable(loss):
            raise TypeError(
                "add_loss takes a zero-argument callable returning a scalar tensor (a tensor "
                f"would be computed once, from the weights of now); got {type(loss).__name__}"
            )
        self._added_losses.append(loss)

    @property
    def losses(self) -> list[torch.Tensor]:
        """The added losses' current values (Keras's ``model.losses``)."""
        return [torch.as_tensor(fn()) for fn in self._added_losses]

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return self.module.parameters()

    # ------------------------------------------------------------------ compile

    def _check_variables_in_scope(self) -> None:
        """tf.keras's rule at ``compile``: every variable was created in the strategy's scope.
        Applied where it matters here: a strategy whose replicas share this process (Mirrored,
        CentralStorage on several devices) makes each replica's copy in its scope; a module
        built outside it would be one copy that the replicas' threads all train at once (a
        race, silently wrong). One replica per process adopts a module built outside."""
        extended = self.distribute_strategy.extended
        if len(extended.worker_devices) < 2:
            return
        for name, p in self.module.named_parameters():
            if not extended.variable_created_in_scope(p):
                raise _outside_scope_error(name, self.distribute_strategy)

    def compile(
        self,
        optimizer: Any = "rmsprop",
        loss: Any = None,
        metrics: Iterable[Any] | None = None,
        steps_per_execution: int = 1,
        jit_compile: bool | str | dict[str, Any] = "auto",
        output: module_calls.OutputName | None = None,
    ) -> None:
        """Optimizer, loss and metrics by Keras name or as objects (a torch optimizer too).

        Without a ``loss``, the model's own is the loss, as Hugging Face's Keras models do: the
        module's output must have a ``.loss`` (``y`` reaches ``forward`` as ``labels=``). The
        loss, the metrics and ``predict`` read the output itself when it is a tensor, else
        ``output`` (a key or attribute: ``"start_logits"``; a position in a tuple), else its
        ``.logits``.

        ``jit_compile=True`` runs the module's forward through ``torch.compile`` in ``fit``,
        ``evaluate`` and ``predict`` (the loss, backward and optimizer step stay eager; the
        backward of the compiled forward is compiled with it). ``"auto"`` (Keras's default)
        is False, as Keras 3 resolves it on PyTorch; a dict is ``torch.compile``'s keyword
        arguments (``{"backend": "aot_eager"}``, ``{"mode": "max-autotune"}``).

        ``steps_per_execution=N`` means what Keras says of it: batches run in groups of N, and
        ``on_train_batch_begin`` / ``on_train_batch_end`` are called once per group (with the
        group's first and last batch index). There is no compiled multi-step function to gain
        here, so each batch is still its own step; what changes is how often the callbacks run
        (and, under multi-worker strategies, the per-step collective of batch logs)."""
        _check_count("steps_per_execution", steps_per_execution, minimum=1)
        self._check_variables_in_scope()
        self.steps_per_execution = steps_per_execution
        options = _compiled_forward_options(jit_compile)
        pipelined = isinstance(self.distribute_strategy.extended, capabilities.PipelinedSteps)
        if options is not None and pipelined:
            warnings.warn(
                "model.compile(jit_compile=...) is ignored on a PipelineStrategy: its stages run "
                "their own steps; torch.compile the stages' modules instead",
                stacklevel=2,
            )
            options = None
        self.jit_compile = options is not None
        # The module is compiled lazily, at its first call, as torch.compile always is.
        self._forward = torch.compile(self.module, **options) if options is not None else None
        self.optimizer = optimizers.get(optimizer, self.module.parameters())
        if self.dtype_policy.name == "mixed_float16" and not isinstance(
            self.optimizer, LossScaleOptimizer
        ):
            self.optimizer = LossScaleOptimizer(self.optimizer)  # as Keras's compile does
        self.loss = losses.get(loss) if loss is not None else None
        self.output_name = _check_output_name(output)
        with self.distribute_strategy.scope():
            self._loss_tracker = _metrics_module.Mean(name="loss")
            self.compiled_metrics = [_metrics_module.get(m) for m in metrics or []]
        names = [m.name for m in self.compiled_metrics]
        if len(set(names)) != len(names) or "loss" in names:
            raise ValueError(f"metric names must be distinct and not 'loss'; got {names}")

    def _sg_after_rebuild(self) -> None:
        self.history = self._fit_data = self._pipeline = self._forward = None
        self._example_input = None
        self._global_tokens = GlobalTokens()

    def _require_compiled(self, what: str) -> None:
        # No loss is a choice: the model's own (``compute_loss``).
        if self.optimizer is None or self._loss_tracker is None:
            raise RuntimeError(f"call model.compile(optimizer, loss, metrics) before {what}")

    @property
    def metrics(self) -> list[metrics.Metric]:
        tracker = [self._loss_tracker] if self._loss_tracker is not None else []
        return tracker + self.compiled_metrics

    @property
    def metrics_names(self) -> list[str]:
        return [m.name for m in self.metrics]

    # ------------------------------------------------------------------ steps

    def compute_loss(self, x: Any, y: Any, y_pred: Any, sample_weight: Any = None) -> torch.Tensor:
        """This replica's share of the global mean loss; tracks the per-example losses.
        ``y_pred`` is the module's output: the compiled loss reads its prediction (``.logits``,
        ``compile(output=...)``); without a compiled loss, its ``.loss`` is the loss."""
        if self.loss is None:
            return self._own_loss(x, y_pred, sample_weight)
        y_pred = module_calls.prediction(y_pred, self.output_name)
        y = y if y is not None else module_calls.labels_in(x)
        if y is None:
            raise ValueError(
                "the loss needs targets: give fit/evaluate y, or batches of (x, y) or (x, y, w)"
            )
        per_example = self.loss.call(torch.as_tensor(y, device=y_pred.device), y_pred)
        weights = None if sample_weight is None else torch.as_tensor(sample_weight)
        return self._replica_loss(losses.example_losses(per_example, weights))

    def _own_loss(self, x: Any, output: Any, sample_weight: Any) -> torch.Tensor:
        """The module's own loss (``output.loss``) as this replica's share of the global mean.

        A module given the global count of real tokens (``token_loss``: HF's
        ``num_items_in_batch``) returns its share of the global token mean already. Otherwise
        the module gives the mean over this replica's part of the batch, and each example of
        the part is taken to carry that mean, so the part weighs as many examples as it holds,
        as every loss here does (``compute_average_loss``): exact when every example has as
        many counted tokens (equal lengths, no padding). (HF's Keras models average the
        replicas' means, weighing the replicas equally.)"""
        assert self._loss_tracker is not None
        signature = module_calls.forward_signature(self.module)
        if sample_weight is not None:
            raise ValueError(
                f"sample weights need a compiled loss: {signature.name}'s own loss is already "
                "one number for its whole batch, which per-example weights cannot reach. "
                "Compile a loss (model.compile(optimizer, loss=...)), or drop sample_weight"
            )
        loss = module_calls.own_loss(output, signature)
        examples = module_calls.examples_in(x)
        if not self._token_counted:
            return self._replica_loss(loss.expand(examples))
        # Spread the share over the part's examples so that compute_average_loss gives the
        # share back: ``part`` is the part's weight in it (its examples / the global batch).
        part = sg_nn.compute_average_loss(torch.ones_like(loss.detach()).expand(examples))
        per_example = (loss / part).expand(examples)
        # Accumulating: N_i / N_1, the rest at the update (token_loss).
        return self._replica_loss(per_example) * self._global_tokens.loss_scale()

    def _replica_loss(self, per_example: torch.Tensor) -> torch.Tensor:
        """What this replica's backward starts from, given its per-example losses, as the
        strategy combines gradients; the logged loss tracks them."""
        assert self._loss_tracker is not None
        penalty = self._added_loss()
        # The logged loss is the data loss plus the added ones, as Keras 3 logs it (each
        # example's loss carries the penalty, so their mean is the total).
        self._loss_tracker.update_state((per_example + penalty).detach())
        extended = self.distribute_strategy.extended
        if extended.gradient_aggregation is ReduceOp.MEAN:
            # The strategy averages gradients over replicas (DDP's convention): a replica mean.
            return per_example.mean() + penalty
        # The strategy sums the replicas' gradients, so each carries 1/replicas of the added
        # losses (TF's scale_regularization_loss).
        replicas = self.distribute_strategy.num_replicas_in_sync
        return sg_nn.compute_average_loss(per_example) + penalty / replicas

    def _added_loss(self) -> torch.Tensor | float:
        """The added losses' sum (``model.losses``), computed afresh."""
        if not self._added_losses:
            return 0.0
        return sum(torch.as_tensor(fn()) for fn in self._added_losses)

    def train_step(self, data: Any) -> None:
        """One step on one replica's part of the batch: forward, loss, backward, update."""
        assert self.optimizer is not None
        x, y, sample_weight = unpack(data)
        y_pred = self._step_forward(x, y, training=True)
        loss = self.compute_loss(x, y, y_pred, sample_weight)
        self.optimizer.zero_grad()
        # Scaled under a LossScaleOptimizer; see gradient_accumulation_steps.
        self.optimizer.backward(self.optimizer.scale_loss(loss), self.distribute_strategy)
        if self._token_counted:
            self._global_tokens.rescale(self.module.parameters(), self.optimizer)
        self.optimizer.step()
        self.update_metrics(self._targets(x, y), y_pred, sample_weight)
        self._token_counted = False  # a compute_loss outside a step counts nothing

    def test_step(self, data: Any) -> None:
        """One evaluation step on one replica's part of the batch."""
        x, y, sample_weight = unpack(data)
        with torch.no_grad():
            y_pred = self._step_forward(x, y, training=False)
            self.compute_loss(x, y, y_pred, sample_weight)
            self.update_metrics(self._targets(x, y), y_pred, sample_weight)
        self._token_counted = False

    def predict_step(self, data: Any) -> torch.Tensor:
        x, _, _ = unpack(data)
        with torch.no_grad():
            output = self._step_forward(x, None, training=False)
        self._token_counted = False
        return module_calls.prediction(output, self.output_name)

    def _step_forward(self, x: Any, y: Any, *, training: bool) -> Any:
        """The module's output on one replica's inputs in a step, in float32 whatever the
        compute dtype (the loss and the metrics see float32, as in Keras). A dict ``x`` goes
        as keyword arguments; without a compiled loss, ``y`` goes as ``labels=`` (HF's
        ``train_step``: the model's own loss needs them); ``training`` where forward takes it."""
        signature = module_calls.forward_signature(self.module)
        extra: dict[str, Any] = {}
        if self.loss is None and y is not None:
            extra.update(module_calls.labels_arguments(signature, y))
        labels = extra.get("labels", module_calls.labels_in(x)) if self.loss is None else None
        self._token_counted = isinstance(labels, torch.Tensor) and GlobalTokens.applies(
            self.module, signature
        )
        if self._token_counted:
            extra["num_items_in_batch"] = self._global_tokens.count(
                self.module, labels, self.optimizer, training=training
            )
        if signature.takes("training"):
            extra["training"] = training
        args, kwargs = module_calls.call_arguments(signature, x, extra)
        return dtype_policies.as_float32(self._call_module(*args, **kwargs))

    @staticmethod
    def _targets(x: Any, y: Any) -> Any:
        """What the metrics compare with: ``y``, else the labels of an input dict."""
        return y if y is not None else module_calls.labels_in(x)

    def update_metrics(self, y: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Update the compiled metrics with one replica's batch (``train_step`` and
        ``test_step`` call it; the loss tracker is ``compute_loss``'s). ``y_pred`` is the
        module's output, of which the metrics read the prediction (as the compiled loss)."""
        if not self.compiled_metrics:
            return
        if y is None:
            raise ValueError(
                f"the metrics {[m.name for m in self.compiled_metrics]} need targets: give "
                "fit/evaluate y, batches of (x, y), or an input dict holding 'labels'"
            )
        prediction = module_calls.prediction(y_pred, self.output_name).detach()
        for metric in self.compiled_metrics:
            metric.update_state(y, prediction, sample_weight)

    def _logs(self) -> Logs:
        # Cross-replica: every worker takes part (each result() is a small all-reduce).
        return {m.name: float(m.result()) for m in self.metrics}

    def _reset_metrics(self) -> None:
        for m in self.metrics:
            m.reset_state()

    # ------------------------------------------------------------------ one step, any strategy

    def _remember_input(self, batch: Any) -> None:
        """Two rows of the first input seen (this process's first replica's part of a
        distributed batch): the example ``save`` exports the module with."""
        if self._example_input is not None:
            return
        x, _, _ = unpack(self.distribute_strategy.experimental_local_results(batch)[0])
        self._remember_example(x)

    def _remember_example(self, x: Any) -> None:
        if self._example_input is None and isinstance(x, torch.Tensor) and x.dim() and len(x):
            # Two rows: torch.export specialises a dimension of size 1.
            self._example_input = x[:1].detach().cpu().repeat(2, *([1] * (x.dim() - 1)))

    def _pipelined(self, batch: Any) -> KerasPipeline | None:
        """On a pipeline, this model's stages and their steps (cut on first use); else None:
        the strategy runs the steps."""
        extended = self.distribute_strategy.extended
        if not isinstance(extended, capabilities.PipelinedSteps):
            return None
        if self._pipeline is None:
            if self.optimizer is not None and self.optimizer.gradient_accumulation_steps:
                raise ValueError(
                    "PipelineStrategy: gradient_accumulation_steps="
                    f"{self.optimizer.gradient_accumulation_steps} is not supported; a pipeline "
                    "accumulates its num_microbatches micro-batches within each step already"
                )
            # Imported on a pipeline only: it pulls in torch.distributed.pipelining and
            # torch._dynamo (about 1 s of CPU), which no other strategy's job needs.
            from stratagem.keras.pipeline_steps import KerasPipeline

            self._pipeline = KerasPipeline.build(self, extended, unpack(batch)[0])
        return self._pipeline

    def _train_batch(self, batch: Any) -> None:
        self._remember_input(batch)
        pipeline = self._pipelined(batch)
        if pipeline is not None:
            pipeline.train_batch(batch)
            assert self.optimizer is not None
            self.optimizer.count_step()  # the stages stepped their own torch optimizers
        else:
            # The step counts itself (optimizer.step: iterations), as a custom loop's does.
            self.distribute_strategy.run(self.train_step, args=(batch,))

    def _test_batch(self, batch: Any) -> None:
        pipeline = self._pipelined(batch)
        if pipeline is not None:
            pipeline.test_batch(batch)
        else:
            self.distribute_strategy.run(self.test_step, args=(batch,))

    def _predict_batch(self, batch: Any) -> torch.Tensor:
        self._remember_input(batch)
        pipeline = self._pipelined(batch)
        if pipeline is not None:
            return pipeline.predict_batch(batch)
        strategy = self.distribute_strategy
        result = strategy.run(self.predict_step, args=(batch,))
        if not isinstance(result, PerReplica | torch.Tensor):
            raise TypeError(f"predict_step must return a tensor, got {type(result).__name__}")
        return strategy.gather(result, axis=0)  # every replica's outputs, in order

    # ------------------------------------------------------------------ fit

    def fit(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        epochs: int = 1,
        verbose: int | str = "auto",
        callbacks: Iterable[callbacks_module.Callback] | None = None,
        validation_data: Any = None,
        shuffle: bool = True,
        initial_epoch: int = 0,
        steps_per_epoch: int | None = None,
    ) -> callbacks_module.History:
        """Train for ``epochs`` epochs (from ``initial_epoch``); returns the ``History``.

        The one loop, whichever runner runs its steps (``step_runner``): here over the
        strategy, or on the workers of a ``ClusterCoordinator`` (``coordinated``)."""
        self._require_compiled("fit")
        assert self.optimizer is not None
        _check_count("epochs", epochs, minimum=0)
        _check_count("initial_epoch", initial_epoch, minimum=0)
        if steps_per_epoch is not None:
            _check_count("steps_per_epoch", steps_per_epoch, minimum=1)
        strategy = self.distribute_strategy
        coordinator = coordinated.coordinator_for(strategy)
        data = epoch_iterator.training_data(
            x, y, batch_size, shuffle=shuffle, steps_per_epoch=steps_per_epoch,
            validation_data=validation_data, strategy=strategy, coordinator=coordinator,
            accumulation_steps=self.optimizer.gradient_accumulation_steps,
        )  # fmt: skip
        runner = self._step_runner(coordinator, data)
        self.history = callbacks_module.History()
        cbs = self._callbacks(
            callbacks, verbose, epochs=epochs, steps=steps_per_epoch or runner.steps
        )
        self.stop_training = False
        _set_training(self.module, True)
        batch_logs = runner.batch_logs(any(cb.needs_batch_logs for cb in cbs.callbacks))
        self._fit_data, self._initial_epoch, self._initial_step = runner.fit_data, initial_epoch, 0
        cbs.on_train_begin()  # BackupAndRestore may move the start on (see resume_fit)
        in_place = self._offers_in_place(runner.fit_data)
        logs: Logs = {}
        for epoch in range(self._initial_epoch, epochs):
            step = self._initial_step if epoch == self._initial_epoch else 0
            if step == 0:  # a resumed epoch goes on with the metric totals restored with it
                self._reset_metrics()
            cbs.on_epoch_begin(epoch)
            while (steps_per_epoch is None or step < steps_per_epoch) and not self.stop_training:
                # One execution: up to steps_per_execution batches between the batch hooks.
                limit = self.steps_per_execution
                if steps_per_epoch is not None:
                    limit = min(limit, steps_per_epoch - step)
                before = self._before_step(in_place, step)
                try:
                    done, ended = runner.train(step, limit, steps_per_epoch is None, cbs)
                except MembershipChanged:
                    if before is None:
                        raise
                    step = self._go_on_in_place(before, cbs)
                    continue
                if done:
                    step += done
                    cbs.on_train_batch_end(step - 1, self._logs() if batch_logs else {})
                if ended:
                    break
            runner.end_epoch()  # the metrics are complete once the epoch's steps are
            if step == 0 and not self.stop_training:
                raise ValueError(
                    f"fit found no batch to train on in epoch {epoch + 1}: the data is empty"
                )
            logs = self._end_epoch(cbs, epoch, validation_data, batch_size, runner)
            if self.stop_training:
                break
        self._fit_data = None
        cbs.on_train_end(logs)
        return self.history

    def _offers_in_place(self, data: object) -> bool:
        """Whether this fit goes on in its own process when a peer of an elastic job is lost:
        where the strategy can (every worker holding the whole state) and the fit's position
        restores on any number of workers (arrays, or a dataset read as one global stream: a
        redone step is the same global batch, cut for the workers left), one optimizer step a
        batch."""
        if not isinstance(data, FitData) or not data.restores_anywhere:
            return False
        if self.optimizer is None:
            return False
        if self.optimizer.gradient_accumulation_steps not in (None, 1):
            return False
        return self.distribute_strategy.extended.offer_in_place()

    def _before_step(self, in_place: bool, step: int) -> InPlaceStart | None:
        """Where an execution of steps starts, if this fit goes on in place after a loss:
        kept until the next (plain numbers, and a dataset iterator's state, references to
        its buffers: no copy of the model)."""
        if not in_place:
            return None
        assert self._fit_data is not None and self.optimizer is not None
        data = self._fit_data
        try:
            state = data.iterator_state()
        except InputError:  # a stage made as the pass runs cannot say where it is: not here
            return None
        return InPlaceStart(data.position, state, self.optimizer.iterations, step)

    def _go_on_in_place(self, start: InPlaceStart, cbs: callbacks_module.CallbackList) -> int:
        """After a lost peer, within an execution of steps: the group rebuilt without it, the
        newest state everywhere (from the survivor that committed the most steps), and the
        data at the execution's start again, then past the steps that survivor committed: the
        workers were in step at the start, so each skips as many. The step to go on from."""
        assert self.optimizer is not None and self._fit_data is not None
        newest = torch.tensor([self.optimizer.iterations], dtype=torch.int64)
        state = [newest, *self.module.parameters(), *self.module.buffers()]
        state += optimizer_state_tensors(self.optimizer.torch_optimizer)
        why = self.distribute_strategy.extended.rejoin(state, self.optimizer.iterations)
        done = int(newest) - start.iterations  # steps of the execution the newest committed
        self.optimizer.iterations = int(newest)
        self._fit_data.regroup()
        self._fit_data.seek(start.position, start.iterator_state)
        for _ in range(done):
            self._fit_data.next_batch()
        step = start.step + done
        said = f"{why}: went on in place at step {step}"
        # Under the progress bar where one is drawn, else on the console (the chief's).
        if not cbs.note(said) and self.distribute_strategy.extended.should_save_summary:
            print(said, flush=True)
        return step

    def _step_runner(
        self, coordinator: ClusterCoordinator | None, data: FitData | WorkerBatches | None = None
    ) -> StepRunner:
        """Where the steps run: on the workers of ``coordinator`` (the chief of a coordinated
        cluster), else here; on ``data``, fit's training data (None for evaluate)."""
        if coordinator is not None:
            assert data is None or isinstance(data, WorkerBatches)
            return coordinated.CoordinatedSteps(self, coordinator, data)
        assert data is None or isinstance(data, FitData)
        steps = BatchSteps(train=self._train_batch, test=self._test_batch, logs=self._logs)
        return LocalSteps(self.distribute_strategy, steps, data)

    def _end_epoch(
        self,
        cbs: callbacks_module.CallbackList,
        epoch: int,
        validation_data: Any,
        batch_size: int | None,
        runner: StepRunner,
    ) -> Logs:
        """The epoch's logs (the validation's too), after ``on_epoch_end`` has seen them."""
        logs = self._logs()
        if validation_data is not None:
            val_data = epoch_iterator.validation_data(validation_data, batch_size)
            # With fit's callbacks, as Keras's fit evaluates: their on_test_* hooks run too.
            val = self._evaluate_logs(val_data, runner, cbs=cbs)
            logs.update({f"val_{k}": v for k, v in val.items()})
            _set_training(self.module, True)
        cbs.on_epoch_end(epoch, logs)
        return logs

    def fit_progress(self, epoch: int, step: int) -> dict[str, torch.Tensor]:
        """Where the fit under way is, as tensors a checkpoint holds: ``epoch`` with ``step``
        of its batches done, the data position, and the epoch's metric totals so far (their
        sum over all workers: a collective, called by every worker). For callbacks that back
        a fit up (``BackupAndRestore``); ``resume_fit`` reads it.
        """
        if self._fit_data is None:
            raise RuntimeError("fit_progress is for callbacks of a fit under way; none is")
        data = self._fit_data.position
        progress = {
            "position": torch.tensor(
                [epoch, step, data.seed, data.pass_index, data.batch], dtype=torch.int64
            )
        }
        if self.optimizer is not None:
            # Keras's optimizer.iterations is a variable its checkpoint holds: a resumed fit's
            # learning-rate schedule and TensorBoard steps go on from it.
            # (A backup waits for the end of an accumulated step: whole steps only.)
            progress["optimizer_iterations"] = torch.tensor([self.optimizer.iterations])
        for i, metric in enumerate(self.metrics):
            progress[f"metric_{i}"] = metric.global_state()
        iterator = self._fit_data.iterator_state()
        if iterator is not None:
            progress["data_iterator"] = iterator  # type: ignore[assignment]
        return progress

    def resume_fit(self, progress: dict[str, torch.Tensor]) -> None:
        """Make the fit about to start go on from ``progress`` (``fit_progress``'s, restored):
        at its epoch and step, on the same data position, with the metric totals it had. For
        ``on_train_begin`` of callbacks that restore a backup (``BackupAndRestore``)."""
        if self._fit_data is None:
            raise RuntimeError("resume_fit is for on_train_begin of a fit; none is under way")
        epoch, step, seed, pass_index, batch = (int(v) for v in progress["position"])
        self._initial_epoch, self._initial_step = epoch, step
        self._fit_data.seek(DataPosition(seed, pass_index, batch), progress.get("data_iterator"))
        iterations = progress.get("optimizer_iterations")  # absent from older backups
        if iterations is not None and self.optimizer is not None:
            self.optimizer.iterations = int(iterations[0])
        # One process in all holds the totals: rank 0 among the replicas' processes.
        holder = self.distribute_strategy.extended.communicator.rank == 0
        for i, metric in enumerate(self.metrics):
            metric.load_global_state(progress[f"metric_{i}"], holder=holder)

    def _callbacks(
        self, given: Iterable[Any] | None, verbose: int | str, *, epochs: int, steps: int | None
    ) -> callbacks_module.CallbackList:
        verbose = _verbosity(verbose)
        chosen = list(given or [])
        if verbose and not any(isinstance(c, callbacks_module.ProgbarLogger) for c in chosen):
            chosen.append(callbacks_module.ProgbarLogger(verbose))
        if self.history is not None:
            chosen.append(self.history)
        params = {"epochs": epochs, "steps": steps, "verbose": verbose}
        return callbacks_module.CallbackList(chosen, self, params)

    # ------------------------------------------------------------------ evaluate / predict

    def evaluate(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        verbose: int | str = "auto",
        return_dict: bool = False,
        steps: int | None = None,
        callbacks: Iterable[callbacks_module.Callback] | None = None,
    ) -> Any:
        """``[loss, *metrics]`` over the data (the loss alone without metrics), as Keras; at
        most ``steps`` batches (None: until the data ends); ``callbacks`` get Keras's
        ``on_test_*`` hooks."""
        self._require_compiled("evaluate")
        if steps is not None:
            _check_count("steps", steps, minimum=1)
        verbosity = _verbosity(verbose)
        chosen = list(callbacks or [])
        if verbosity and not any(isinstance(c, callbacks_module.ProgbarLogger) for c in chosen):
            chosen.append(callbacks_module.ProgbarLogger(verbosity))  # Keras's evaluate bar
        params = {"epochs": 1, "steps": steps, "verbose": verbosity}
        cbs = callbacks_module.CallbackList(chosen, self, params)
        data = epoch_iterator.evaluation_data(x, y, batch_size, steps)
        runner = self._step_runner(coordinated.coordinator_for(self.distribute_strategy))
        logs = self._evaluate_logs(data, runner, cbs=cbs, params=params)
        if return_dict:
            return logs
        values = [logs[name] for name in self.metrics_names]
        return values[0] if len(values) == 1 else values

    def _evaluate_logs(
        self, data: epoch_iterator.EvaluationData, runner: StepRunner, *,
        cbs: callbacks_module.CallbackList | None = None, params: dict[str, Any] | None = None,
    ) -> Logs:  # fmt: skip
        """``params``: evaluate's own callbacks' parameters, which learn the number of batches
        here (the progress bar's target); fit's validation passes none."""
        if params is not None and data.count is not None:
            params["steps"] = data.count
        _set_training(self.module, False)
        self._reset_metrics()
        # Running metrics for on_test_batch_end only where a callback reads them (each is a
        # collective under MultiWorkerMirroredStrategy).
        batch_logs = cbs is not None and runner.batch_logs(
            any(cb.needs_test_batch_logs for cb in cbs.callbacks)
        )
        if cbs is not None:
            cbs.on_test_begin()
        count = runner.test(data.batches, cbs, batch_logs)
        if count == 0:
            raise ValueError("evaluate found no batch: the data is empty")
        logs = self._logs()
        if cbs is not None:
            cbs.on_test_end(logs)  # the progress bar's last line, on the chief
        return logs

    def predict(self, x: Any, batch_size: int | None = None, verbose: int | str = 0) -> np.ndarray:
        """The module's outputs for every example, in order, as a numpy array."""
        batches = epoch_iterator.prediction_data(x, batch_size)
        strategy = self.distribute_strategy
        _set_training(self.module, False)
        outputs = []
        # A coordinator (the chief) predicts itself: its model reads the ps's values, and a
        # distributed dataset is built on the workers only (TF's).
        coordinated_here = coordinated.coordinator_for(strategy) is not None
        distributed = (
            batches if coordinated_here else strategy.experimental_distribute_dataset(batches)
        )
        for batch in distributed:
            outputs.append(self._predict_batch(batch).cpu())
        if not outputs:
            raise ValueError("predict found no batch: the data is empty")
        return torch.cat(outputs).numpy()

    # ------------------------------------------------------------------ weights

    def load_weights(self, filepath: str) -> None:
        """Load the module's weights from a checkpoint (``ModelCheckpoint``'s, a
        ``sg.train.Checkpoint`` with ``model=``), or the newest one in a directory."""
        if filepath is None:
            raise ValueError("load_weights got None (did latest_checkpoint find no checkpoint?)")
        path = os.fspath(filepath)
        if os.path.isdir(path) and not is_checkpoint(path):
            newest = latest_checkpoint(path)
            if newest is None:
                raise FileNotFoundError(f"no checkpoint in directory {path!r}")
            path = newest
        # Other saved state (an optimizer) is left alone, as Keras's load_weights does.
        Checkpoint(model=self.module).restore(
            path
        ).expect_partial().assert_existing_objects_matched()

    def save(self, filepath: str, options: Any = None) -> str:
        """Write the model as a self-describing directory (see ``sg.keras.saving``);
        ``options``: an ``sg.saved_model.SaveOptions``.

        A model that never saw an input (never called, fit or predicted on, nor ``build``-t)
        is refused with Keras's error: the directory holds the module's exported program,
        which needs an input to trace (Keras 3 likewise refuses to export or save the weights
        of an unbuilt model)."""
        if not self.built:
            raise ValueError(
                "You are saving a model that has not yet been built. Try building the model "
                "first by calling it on some data or by using `build()`. "
                f"(model {self.name!r}: it never saw an input, so its program cannot be traced)"
            )
        return saving.save(self, filepath, options=options)

    # ------------------------------------------------------------------ summary

    def summary(self, print_fn: Any = None) -> None:
        """The module, and its parameter counts."""
        out = print_fn or (lambda line: print(line, file=sys.stdout))
        total = sum(p.numel() for p in self.module.parameters())
        trainable = sum(p.numel() for p in self.module.parameters() if p.requires_grad)
        out(f'Model: "{self.name}"')
        out(repr(self.module))
        out(f"Total params: {total:,}")
        out(f"Trainable params: {trainable:,}")
        out(f"Non-trainable params: {total - trainable:,}")


_metrics_module = metrics  # ``Model.metrics`` (a property) shadows the module name in the class


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's state tensors in one fixed order: its parameters', slots by name."""
    found: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            slots = optimizer.state.get(p, {})
            found += [slots[k] for k in sorted(slots) if isinstance(slots[k], torch.Tensor)]
    return found


def _outside_scope_error(variable: str, strategy: Strategy) -> ValueError:
    """tf.keras's ``Model.compile`` error, word for word but the variable's name."""
    return ValueError(
        f"Variable ({variable}) was not created in the distribution strategy scope of "
        f"({strategy}). It is most likely due to not all layers or the model or optimizer being "
        "created outside the distribution strategy scope. Try to make sure your code looks "
        "similar to the following.\nwith strategy.scope():\n  model=_create_model()\n  "
        "model.compile(...)"
    )


def _strategy_of(module: torch.nn.Module, name: str) -> Strategy:
    """The strategy a model trains under: the one its parameters were created under (as a
    Keras model's variables tie it to the strategy of their scope), else the one in scope. A
    module built in a strategy's scope and wrapped outside it would otherwise train under the
    default strategy with its gradients still combined by the other: each worker on all of the
    data, each step N times too large, and not a word."""
    current = get_strategy()
    owners = {id(s): s for p in module.parameters() if (s := owner_of(p)) is not None}
    if not owners:
        return current
    if len(owners) > 1:
        kinds = sorted(type(s).__name__ for s in owners.values())
        raise ValueError(
            f"sg.keras.Model({name}): the module's parameters were created under different "
            f"strategies ({', '.join(kinds)}); build the whole module in one strategy's scope"
        )
    (owner,) = owners.values()
    if has_strategy() and current is not owner:
        raise ValueError(
            f"sg.keras.Model({name}) is made in the scope of {type(current).__name__}, but its "
            f"module's parameters were created under {type(owner).__name__}: make the model in "
            "the scope its module was built in"
        )
    return owner


def _device_type(args: Any, module: torch.nn.Module) -> str:
    """The device type autocast applies to: the first input tensor's, else the module's."""
    for value in (*args, *module.parameters()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    return "cpu"


def _set_training(module: torch.nn.Module, training: bool) -> None:
    try:
        module.train(training)
    except NotImplementedError:
        pass  # a module rebuilt from a torch.export program keeps the mode it was exported in


def _check_output_name(output: Any) -> module_calls.OutputName | None:
    if (
        output is None
        or isinstance(output, str)
        or (isinstance(output, int) and not isinstance(output, bool))
    ):
        return output
    raise ValueError(
        "model.compile(output=...) names the output the loss, metrics and predict read: a key "
        f"or attribute (str, such as 'start_logits') or a position (int); got {output!r}"
    )


def _verbosity(verbose: int | str) -> int:
    if verbose == "auto":  # Keras 3: the progress bar, whatever the output is
        return 1
    if verbose not in (0, 1, 2):
        raise ValueError(f"verbose must be 'auto', 0, 1 or 2; got {verbose!r}")
    return int(verbose)


def _check_count(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}")


__all__ = ["Model"]


def _compiled_forward_options(jit_compile: Any) -> dict[str, Any] | None:
    """``torch.compile``'s keyword arguments for ``compile(jit_compile=...)``, or None (eager)."""
    if jit_compile == "auto" or jit_compile is False or jit_compile is None:
        return None  # Keras 3 resolves "auto" to eager on PyTorch
    if jit_compile is True:
        return {}
    if isinstance(jit_compile, dict):
        return dict(jit_compile)
    raise ValueError(
        "model.compile(jit_compile=...) takes True, False, 'auto' or a dict of torch.compile "
        f"keyword arguments; got {jit_compile!r}"
    )
