"""``LossScaleOptimizer``: dynamic loss scaling, with one decision for every replica.

Keras's algorithm: the loss is multiplied by the loss scale before backward (``scale_loss``,
which ``Model.fit`` calls, or ``get_scaled_loss``); ``step()`` divides the gradients by it; a
step whose gradients hold an inf or a NaN is skipped and the scale halved (not below 1); after
``dynamic_growth_steps`` finite steps the scale doubles (defaults: 2**15, every 2000 steps).
Under a strategy each replica checks the gradients it holds and the overflow flag is agreed by
one MAX all-reduce (through the replica context inside ``strategy.run``, the strategy's
communicator outside it); the scale is updated once per process. So every replica skips or
applies the same steps, and none enters a gradient all-reduce alone.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch

from stratagem.distribute import ReduceOp, get_replica_context, strategy_for
from stratagem.keras import optimizer_recipes

DEFAULT_INITIAL_SCALE = 2.0**15
DEFAULT_GROWTH_STEPS = 2000


class LossScaleOptimizer(optimizer_recipes.BoundOptimizer):
    """Wraps an optimizer with loss scaling (``tf.keras.mixed_precision.LossScaleOptimizer``).

    ``inner_optimizer``: an ``sg.keras.optimizers`` recipe or name (bound to the parameters at
    ``Model.compile``), a bound optimizer, or a ``torch.optim.Optimizer``. ``dynamic=False``
    keeps ``initial_scale`` fixed and never skips a step (TF2's fixed loss scale).
    """

    def __init__(
        self,
        inner_optimizer: Any,
        dynamic: bool = True,
        initial_scale: float | None = None,
        dynamic_growth_steps: int | None = None,
    ) -> None:
        if isinstance(inner_optimizer, LossScaleOptimizer):
            raise TypeError(
                "LossScaleOptimizer cannot wrap another LossScaleOptimizer; got "
                f"{inner_optimizer!r}"
            )
        if not isinstance(dynamic, bool):
            raise TypeError(f"LossScaleOptimizer's dynamic must be a bool, got {dynamic!r}")
        if not dynamic and initial_scale is None:
            raise ValueError(
                "LossScaleOptimizer(dynamic=False) needs initial_scale (the fixed scale)"
            )
        if not dynamic and dynamic_growth_steps is not None:
            raise ValueError(
                "LossScaleOptimizer: dynamic_growth_steps cannot be given when dynamic is False; "
                f"got {dynamic_growth_steps!r}"
            )
        scale = DEFAULT_INITIAL_SCALE if initial_scale is None else initial_scale
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale >= 1:
            raise ValueError(
                f"LossScaleOptimizer's initial_scale must be a number >= 1, got {scale!r}"
            )
        steps = DEFAULT_GROWTH_STEPS if dynamic_growth_steps is None else dynamic_growth_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(
                f"LossScaleOptimizer's dynamic_growth_steps must be an integer >= 1, got {steps!r}"
            )
        self.torch_optimizer: torch.optim.Optimizer | None = None
        self.inner_optimizer = inner_optimizer
        self.dynamic = dynamic
        self.initial_scale = float(scale)
        self.dynamic_growth_steps = steps if dynamic else None
        # Tracked by checkpoints (restored in place), as Keras tracks its scale variables.
        self._scale = torch.tensor(float(scale), dtype=torch.float32)
        self._counter = torch.tensor(0, dtype=torch.int64)
        if isinstance(inner_optimizer, optimizer_recipes.BoundOptimizer):
            self._take_over(inner_optimizer)
        elif isinstance(inner_optimizer, torch.optim.Optimizer):
            self._take_over(optimizer_recipes.BoundOptimizer(inner_optimizer))
        elif not isinstance(inner_optimizer, optimizer_recipes.Optimizer | str):
            raise TypeError(
                "LossScaleOptimizer wraps an sg.keras.optimizers optimizer (or its name) or a "
                f"torch.optim.Optimizer; got {type(inner_optimizer).__name__}: {inner_optimizer!r}"
            )

    def _take_over(self, bound: optimizer_recipes.BoundOptimizer) -> None:
        # This object becomes the bound optimizer, loss scaling added: it takes over the inner
        # one's state (its torch optimizer, and whatever else a BoundOptimizer keeps, so that
        # the inherited zero_grad/step logic runs on it as on the inner one).
        self.__dict__.update(vars(bound))

    def bind(self, params: Iterable[torch.nn.Parameter]) -> LossScaleOptimizer:
        """Bind an inner recipe to the model's parameters (``Model.compile`` calls it)."""
        if self.torch_optimizer is None:
            self._take_over(optimizer_recipes.get(self.inner_optimizer, params))
        return self

    def _bound(self) -> torch.optim.Optimizer:
        if self.torch_optimizer is None:
            raise RuntimeError(
                f"LossScaleOptimizer({self.inner_optimizer!r}) is not bound to parameters yet: "
                "pass it to model.compile(optimizer=...), or wrap a torch.optim.Optimizer"
            )
        return self.torch_optimizer

    def __getattr__(self, name: str) -> Any:
        if name == "torch_optimizer" or self.__dict__.get("torch_optimizer") is None:
            raise AttributeError(
                f"LossScaleOptimizer has no attribute {name!r} before it is bound to parameters"
            )
        return getattr(self.torch_optimizer, name)

    # ------------------------------------------------------------------ Keras's API

    @property
    def loss_scale(self) -> torch.Tensor:
        """The current loss scale (a float32 scalar tensor, a copy)."""
        return self._scale.clone()

    @property
    def dynamic_counter(self) -> torch.Tensor | None:
        """Finite steps since the scale last changed (None for a fixed scale, as TF2)."""
        return self._counter.clone() if self.dynamic else None

    def get_scaled_loss(self, loss: Any) -> Any:
        """``loss`` times the loss scale (a callable returning a loss, too: TF2's form)."""
        if callable(loss) and not isinstance(loss, torch.Tensor):
            return lambda: self.get_scaled_loss(loss())
        return loss * self._scale.to(device=loss.device, dtype=loss.dtype)

    scale_loss = get_scaled_loss  # Keras 3's name, which Model.fit calls

    def get_unscaled_gradients(self, grads: Iterable[Any]) -> list[Any]:
        """Each gradient divided by the loss scale (None stays None); new tensors."""
        inv = 1.0 / float(self._scale)
        return [None if g is None else g * inv for g in grads]

    def trackables(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint keeps (restored in place): the scale and the counter."""
        return {"loss_scale": self._scale, "dynamic_counter": self._counter}

    # ------------------------------------------------------------------ the step

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """Unscale the gradients in place, and step unless they overflowed on some replica.

        Call it after ``get_scaled_loss(loss).backward()`` (``Model.fit`` does). A skipped step
        still counts in ``iterations``, as Keras's (tf-keras's ``do_not_apply_fn`` increments
        the inner optimizer's iterations itself)."""
        if closure is not None:
            raise ValueError("LossScaleOptimizer.step takes no closure (the loss must be scaled)")
        optimizer = self._bound()
        # A bound optimizer that accumulates gradients over several batches updates on some
        # of them only; the gradients are unscaled and checked when it does.
        if self._updates_now():
            self._step_unscaled(optimizer)
        self.count_step()

    def _step_unscaled(self, optimizer: torch.optim.Optimizer) -> None:
        nonfinite = self._unscale(optimizer)
        if not self.dynamic:
            optimizer.step()
            return
        overflow = self._agree(nonfinite, optimizer)
        if not overflow:
            optimizer.step()
        self._update_once(overflow)

    def _unscale(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Divide this replica's gradients by the scale; 1.0 where one is not finite."""
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        # No DTensor exists until torch.distributed.tensor is loaded: asking sys.modules keeps
        # every job that has no mesh from importing it (about 0.5 s of CPU at its start).
        dtensor = sys.modules.get("torch.distributed.tensor")
        for group in optimizer.param_groups:
            for p in group["params"]:
                # Inside a replica of MirroredStrategy this reads the replica's own copy.
                grad = p.grad
                if grad is None:
                    continue
                if dtensor is not None and isinstance(grad, dtensor.DTensor):
                    grad = grad.to_local()  # this process's shard (FSDP, a mesh)
                groups.setdefault((grad.device, grad.dtype), []).append(grad)
        found = torch.zeros(1)
        inv = 1.0 / float(self._scale)
        with torch.no_grad():
            for (device, _), grads in groups.items():
                here = torch.zeros(1, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(
                    grads, here, torch.full((1,), inv, device=device)
                )
                found += here.cpu()
        return (found > 0).float()

    def _agree(self, nonfinite: torch.Tensor, optimizer: torch.optim.Optimizer) -> bool:
        """Whether any replica of the strategy found a non-finite gradient."""
        ctx = get_replica_context()
        if ctx is not None and ctx.num_replicas_in_sync > 1:  # inside strategy.run
            agreed = ctx.all_reduce(ReduceOp.MAX, nonfinite)
            return bool(agreed.item() > 0)
        # Outside run: the processes of the strategy that owns the parameters (else the current).
        comm = strategy_for([optimizer]).extended.communicator
        if comm.world_size > 1:
            comm.all_reduce(nonfinite, ReduceOp.MAX, what="LossScaleOptimizer's overflow flag")
        return bool(nonfinite.item() > 0)

    def _update_once(self, overflow: bool) -> None:
        """Update the scale once per step, whichever replica threads take it."""
        ctx = get_replica_context()
        if ctx is None:
            self._update(overflow)
            return
        ctx.strategy.extended.merge_call(
            "LossScaleOptimizer's loss scale update", lambda: self._update(overflow)
        )

    def _update(self, overflow: bool) -> None:
        with torch.no_grad():
            if overflow:
                self._scale.copy_(torch.clamp(self._scale / 2, min=1.0))
                self._counter.zero_()
                return
            self._counter += 1
            assert self.dynamic_growth_steps is not None
            if int(self._counter) >= self.dynamic_growth_steps:
                doubled = self._scale * 2
                if torch.isfinite(doubled):
                    self._scale.copy_(doubled)
                self._counter.zero_()

    def __repr__(self) -> str:
        inner = self.torch_optimizer if self.torch_optimizer is not None else self.inner_optimizer
        return f"LossScaleOptimizer({inner!r}, loss_scale={float(self._scale):g})"
