"""Keras optimizers (``sg.keras.optimizers``): names and recipes, bound to parameters at compile.

Keras builds an optimizer before it knows the variables; PyTorch optimizers need their
parameters up front. So ``sg.keras.optimizers.Adam(learning_rate=1e-3)`` is a recipe that
``Model.compile`` binds to the model's parameters, giving a real ``torch.optim`` optimizer
wrapped so that ``model.optimizer.learning_rate`` reads and sets every group's ``lr``. Keras's
defaults are kept (they differ from torch's: RMSprop's rho 0.9 and epsilon 1e-7, for example).

``gradient_accumulation_steps=k`` (Keras 3's argument, every optimizer): ``fit`` applies the
mean of k micro-batches' gradients every k-th batch, as Keras does; the k-1 backward passes
before it only accumulate (``strategy.extended.accumulate_gradients()``), so the replicas'
gradients are combined once per step, not once per batch.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from typing import Any

import torch

from stratagem.distribute import capabilities, get_replica_context
from stratagem.errors import UnavailableOptimizerError
from stratagem.shipping.portable import Portable


class Optimizer(Portable):
    """A recipe for a ``torch.optim`` optimizer; ``build(params)`` makes the optimizer."""

    torch_class: type[torch.optim.Optimizer] = torch.optim.SGD

    def __init__(
        self,
        learning_rate: float = 0.001,
        *,
        gradient_accumulation_steps: int | None = None,
        **options: Any,
    ) -> None:
        self.learning_rate = float(learning_rate)
        self.gradient_accumulation_steps = _check_steps(gradient_accumulation_steps)
        self.options = options

    def _torch_options(self) -> dict[str, Any]:
        return dict(self.options)

    def build(self, params: Iterable[torch.nn.Parameter]) -> BoundOptimizer:
        optimizer = self.torch_class(params, lr=self.learning_rate, **self._torch_options())
        return BoundOptimizer(optimizer, self.gradient_accumulation_steps)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(learning_rate={self.learning_rate:g})"


class SGD(Optimizer):
    torch_class = torch.optim.SGD

    def __init__(
        self,
        learning_rate: float = 0.01,
        momentum: float = 0.0,
        nesterov: bool = False,
        gradient_accumulation_steps: int | None = None,
    ) -> None:
        super().__init__(
            learning_rate,
            momentum=momentum,
            nesterov=nesterov,
            gradient_accumulation_steps=gradient_accumulation_steps,
        )


class Adam(Optimizer):
    torch_class = torch.optim.Adam

    def __init__(
        self,
        learning_rate: float = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        gradient_accumulation_steps: int | None = None,
    ) -> None:
        super().__init__(
            learning_rate,
            betas=(beta_1, beta_2),
            eps=epsilon,
            gradient_accumulation_steps=gradient_accumulation_steps,
        )


class RMSprop(Optimizer):
    torch_class = torch.optim.RMSprop

    def __init__(
        self,
        learning_rate: float = 0.001,
        rho: float = 0.9,
        momentum: float = 0.0,
        epsilon: float = 1e-7,
        gradient_accumulation_steps: int | None = None,
    ) -> None:
        super().__init__(
            learning_rate,
            alpha=rho,
            momentum=momentum,
            eps=epsilon,
            gradient_accumulation_steps=gradient_accumulation_steps,
        )


class Adagrad(Optimizer):
    torch_class = torch.optim.Adagrad

    def __init__(
        self,
        learning_rate: float = 0.001,
        epsilon: float = 1e-7,
        gradient_accumulation_steps: int | None = None,
    ) -> None:
        super().__init__(
            learning_rate, eps=epsilon, gradient_accumulation_steps=gradient_accumulation_steps
        )


class AdamW(Optimizer):
    """Adam with decoupled weight decay (Keras's ``AdamW``, torch's ``AdamW``): every step
    multiplies each weight by ``1 - learning_rate * weight_decay``, as both do. Keras's
    defaults, not torch's (``weight_decay`` 0.004, not 0.01; ``epsilon`` 1e-7, not 1e-8)."""

    torch_class = torch.optim.AdamW

    def __init__(
        self,
        learning_rate: float = 0.001,
        weight_decay: float = 0.004,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        amsgrad: bool = False,
        gradient_accumulation_steps: int | None = None,
    ) -> None:
        super().__init__(
            learning_rate,
            weight_decay=weight_decay,
            betas=(beta_1, beta_2),
            eps=epsilon,
            amsgrad=amsgrad,
            gradient_accumulation_steps=gradient_accumulation_steps,
        )


class Nadam(Optimizer):
    """Adam with Nesterov momentum (Keras's ``Nadam``, torch's ``NAdam``). Keras 3's momentum
    schedule is ``beta_1 * (1 - 0.5 * 0.96**t)``; torch's is ``0.96**(t * momentum_decay)``,
    so ``momentum_decay=1`` makes torch's update Keras's (torch's default, 0.004, is the
    schedule of the original paper and of Keras 2's legacy Nadam)."""

    torch_class = torch.optim.NAdam

    def __init__(
        self,
        learning_rate: float = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        gradient_accumulation_steps: int | None = None,
    ) -> None:
        super().__init__(
            learning_rate,
            betas=(beta_1, beta_2),
            eps=epsilon,
            momentum_decay=1.0,
            gradient_accumulation_steps=gradient_accumulation_steps,
        )


class Adamax(Optimizer):
    """Adam with the infinity norm (Keras's ``Adamax``, torch's ``Adamax``): Keras's defaults.
    torch adds ``epsilon`` inside the running maximum, Keras after it: the same update but for
    gradients near ``epsilon``."""

    torch_class = torch.optim.Adamax

    def __init__(
        self,
        learning_rate: float = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        gradient_accumulation_steps: int | None = None,
    ) -> None:
        super().__init__(
            learning_rate,
            betas=(beta_1, beta_2),
            eps=epsilon,
            gradient_accumulation_steps=gradient_accumulation_steps,
        )


class Adafactor(Optimizer):
    """Adafactor (Keras's ``Adafactor``, torch's ``Adafactor``), Keras's arguments and defaults.

    The step size is ``min(learning_rate, 1/sqrt(t))`` times the weight's RMS (at least
    ``epsilon_2``), the update clipped to an RMS of ``clip_threshold``: both libraries' rule.
    Keras adds ``epsilon_1`` to the squared gradients; torch floors the second-moment estimate
    at the square of its ``eps``, so ``epsilon_1`` goes to torch as its square root (the same
    floor, 1e-30 by default). torch always takes the relative step: ``relative_step=False``
    (Keras's plain ``learning_rate``) is refused."""

    torch_class = torch.optim.Adafactor

    def __init__(
        self,
        learning_rate: float = 0.001,
        beta_2_decay: float = -0.8,
        epsilon_1: float = 1e-30,
        epsilon_2: float = 1e-3,
        clip_threshold: float = 1.0,
        relative_step: bool = True,
        gradient_accumulation_steps: int | None = None,
    ) -> None:
        if not relative_step:
            raise ValueError(
                "Adafactor(relative_step=False) is not available: torch.optim.Adafactor always "
                "uses the relative step min(learning_rate, 1/sqrt(step)); keep "
                "relative_step=True, or pass a torch optimizer object to compile"
            )
        if epsilon_1 < 0:
            raise ValueError(f"Adafactor's epsilon_1 must be >= 0; got {epsilon_1!r}")
        super().__init__(
            learning_rate,
            beta2_decay=beta_2_decay,
            eps=(math.sqrt(epsilon_1), epsilon_2),
            d=clip_threshold,
            gradient_accumulation_steps=gradient_accumulation_steps,
        )


class Lion(Optimizer):
    """Keras's ``Lion`` (learning_rate 0.001, beta_1 0.9, beta_2 0.99), which
    ``torch.optim`` does not have: constructing it (or ``compile(optimizer="lion")``) raises
    ``UnavailableOptimizerError`` saying what to pass instead. It is named here so that a
    Keras script fails with that reason, not with a missing attribute."""

    def __init__(
        self,
        learning_rate: float = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.99,
        gradient_accumulation_steps: int | None = None,
    ) -> None:
        raise UnavailableOptimizerError(
            f"Lion(learning_rate={learning_rate!r}, beta_1={beta_1!r}, beta_2={beta_2!r}) is "
            f"not available: torch {torch.__version__} has no Lion in torch.optim. Pass a torch "
            "optimizer object to compile instead (one of a package's, such as lion-pytorch's "
            "Lion(module.parameters(), lr=..., betas=(0.9, 0.99))), or use 'adamw'"
        )


class BoundOptimizer(Portable):
    """A torch optimizer with Keras's ``learning_rate`` attribute; everything else delegates.

    With ``gradient_accumulation_steps=k``, ``Model.train_step``'s ``zero_grad``, ``backward``
    and ``step`` make one optimizer step of k batches, as Keras 3's optimizer: the gradients are
    cleared at the first, each backward adds loss/k's (so the step sees their mean), and the
    update runs at the k-th. ``iterations`` counts optimizer steps (Keras: batches // k).
    """

    _sg_volatile = ("_batches",)  # the chief's count, read again at each call
    # TF's ``iterations`` is a ps variable: the steps a scheduled function takes on its worker
    # come back and are added to the chief's count (``_sg_totals``), a custom loop's or fit's.
    _sg_accumulates = True
    _sg_local = ("_start",)  # the count a worker's call started from

    def __init__(
        self, optimizer: torch.optim.Optimizer, gradient_accumulation_steps: int | None = None
    ) -> None:
        self.torch_optimizer = optimizer
        self.gradient_accumulation_steps = _check_steps(gradient_accumulation_steps)
        # Keras's ``_iterations``: calls of ``step`` (its ``apply``), micro-batches included,
        # whoever calls it: ``fit``, or a custom loop.
        self._batches = 0
        self._start = 0

    def _sg_after_rebuild(self) -> None:
        self._start = self._batches

    def _sg_totals(self) -> torch.Tensor:
        return torch.tensor(self._batches - self._start, dtype=torch.int64)

    def _sg_add_totals(self, totals: torch.Tensor) -> None:
        self._batches += int(totals)

    @property
    def iterations(self) -> int:
        """Optimizer steps taken (Keras's: every ``apply_gradients``, ``fit``'s or a custom
        loop's, once per step whatever the replicas; divided by k when accumulating)."""
        k = self.gradient_accumulation_steps
        return self._batches // k if k else self._batches

    @iterations.setter
    def iterations(self, value: int) -> None:
        # Keras's ``optimizer.iterations.assign(n)``: a sidecar evaluator sets the step of the
        # checkpoint it evaluates, for its callbacks.
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"optimizer.iterations must be an integer >= 0; got {value!r}")
        k = self.gradient_accumulation_steps
        self._batches = value * k if k else value

    @property
    def mid_accumulation(self) -> bool:
        """Whether the batches of ``fit`` so far end inside an accumulated step (gradients of
        some micro-batches held, not applied yet): a backup now could not resume exactly."""
        k = self.gradient_accumulation_steps
        return bool(k) and self._batches % k != 0

    def _updates_now(self) -> bool:
        k = self.gradient_accumulation_steps
        return not k or (self._batches + 1) % k == 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients, except between the micro-batches of one accumulated step."""
        k = self.gradient_accumulation_steps
        if not k or self._batches % k == 0:
            self.torch_optimizer.zero_grad(set_to_none=set_to_none)

    def backward(self, loss: torch.Tensor, strategy: Any) -> None:
        """``loss.backward()`` for one batch of ``fit``; when accumulating, ``loss/k``'s, and
        before the step's last micro-batch without reducing across replicas."""
        k = self.gradient_accumulation_steps
        if not k:
            loss.backward()
            return
        last = self._updates_now()
        with contextlib.nullcontext() if last else strategy.extended.accumulate_gradients():
            (loss / k).backward()

    def step(self) -> None:
        """The update, on every batch, or on the last micro-batch of each accumulated step;
        counted in ``iterations`` (Keras's ``apply_gradients``)."""
        if self._updates_now():
            self.torch_optimizer.step()
        self.count_step()

    def count_step(self) -> None:
        """Count one step (Keras's ``iterations.assign_add(1)``): ``step`` calls it, and ``fit``
        for a step taken where ``step`` is not called (a pipeline's stages, a coordinator's
        workers). Once per step on each process, as Keras's iterations, a variable updated by
        one replica only, and after every local replica has read the count for the step
        (``_updates_now``): replicas that run at once (threads) meet in a merge call and one
        counts; replicas that run in turn leave it to the last."""
        ctx = get_replica_context()
        if ctx is None or ctx.num_replicas_in_sync == 1:
            self._batches += 1
            return
        extended = ctx.strategy.extended
        local = len(extended.worker_devices)
        if local > 1 and isinstance(extended, capabilities.MergesReplicas):
            extended.merge_call("optimizer.iterations", self._add_one)
        elif ctx.local_replica_id == local - 1:
            self._add_one()

    def _add_one(self) -> None:
        self._batches += 1

    @property
    def learning_rate(self) -> float:
        return float(self.torch_optimizer.param_groups[0]["lr"])

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        for group in self.torch_optimizer.param_groups:
            group["lr"] = float(value)

    lr = learning_rate  # Keras 2's name

    def bind(self, params: Iterable[torch.nn.Parameter]) -> BoundOptimizer:
        """This optimizer over ``params`` (already bound: itself; a wrapper binds its inner)."""
        return self

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss backward starts from (Keras 3's name): the loss itself, except under a
        ``LossScaleOptimizer``."""
        return loss

    def __getattr__(self, name: str) -> Any:
        return getattr(self.torch_optimizer, name)

    def __repr__(self) -> str:
        return f"BoundOptimizer({self.torch_optimizer!r})"


def _check_steps(steps: int | None) -> int | None:
    # Keras's own check and message: None, or an integer >= 2.
    if steps is None:
        return None
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(
            "`gradient_accumulation_steps` must be an integer >= 2. Received: "
            f"gradient_accumulation_steps={steps!r}"
        )
    return steps


_BY_NAME: dict[str, type[Optimizer]] = {
    "sgd": SGD,
    "adam": Adam,
    "adamw": AdamW,
    "nadam": Nadam,
    "adamax": Adamax,
    "adafactor": Adafactor,
    "lion": Lion,  # refused with the reason: torch has none
    "rmsprop": RMSprop,
    "adagrad": Adagrad,
}


def get(identifier: Any, params: Iterable[torch.nn.Parameter]) -> BoundOptimizer:
    """An optimizer over ``params`` from a name, a recipe, or a torch optimizer."""
    if isinstance(identifier, BoundOptimizer):
        return identifier.bind(params)
    if isinstance(identifier, torch.optim.Optimizer):
        return BoundOptimizer(identifier)
    if isinstance(identifier, Optimizer):
        return identifier.build(params)
    if isinstance(identifier, str) and identifier.lower() in _BY_NAME:
        return _BY_NAME[identifier.lower()]().build(params)
    raise ValueError(
        f"unknown optimizer {identifier!r}; expected one of {sorted(_BY_NAME)}, an "
        "sg.keras.optimizers object, or a torch.optim.Optimizer"
    )
