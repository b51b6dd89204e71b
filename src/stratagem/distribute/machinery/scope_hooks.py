"""What ``with strategy.scope():`` captures, through PyTorch's public global hooks.

- Module parameter and buffer registration hooks: what a module registers while a scope is
  active belongs to that strategy (which may place and mirror it).
- ``torch.nn.Parameter`` itself (``Parameter.__new__`` wrapped; torch has no public hook): a
  parameter created in a scope on its own, as TF creates a ``tf.Variable``, is offered to the
  strategy (``capture_variable``).
- Optimizer step pre- and post-hooks: an optimizer whose parameters belong to a strategy lets it
  finish the gradient reduction before the update and refresh replica copies after it; the
  owner is found from the parameters, so an optimizer made outside the scope works too.
- ``GradScaler``'s methods inside ``run`` of threaded replicas become merge calls
  (``grad_scaler_merge``).

Installed once per process, on first use; outside a scope the hooks do nothing.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.utils.weak import WeakIdKeyDictionary

from stratagem.distribute.machinery import context, grad_scaler_merge
from stratagem.distribute.machinery.context import StrategyLike

# torch.optim's package namespace hides the submodule that defines the global hooks.
_optimizer_module = sys.modules["torch.optim.optimizer"]

_install_lock = threading.Lock()
_installed = False
_owners: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor → Strategy
# optimizer → (weak strategy or None, number of parameters when it was checked)
_optimizer_owner: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def owner_of(tensor: torch.Tensor) -> StrategyLike | None:
    """The strategy a parameter or buffer was created under, if any."""
    return _owners.get(tensor)


def claim(tensor: torch.Tensor, strategy: StrategyLike) -> None:
    previous = _owners.get(tensor)
    if previous is not None and previous is not strategy:
        raise RuntimeError(
            f"a tensor of shape {tuple(tensor.shape)} already belongs to "
            f"{type(previous).__name__}; one tensor cannot be distributed by two strategies"
        )
    _owners[tensor] = strategy


def _on_parameter(module: torch.nn.Module, name: str, param: Any) -> Any:
    strategy = context.scope_strategy()
    if strategy is None or param is None or context.current_replica() is not None:
        return None
    return strategy.extended.capture_parameter(module, name, param)


def _on_buffer(module: torch.nn.Module, name: str, buffer: Any) -> Any:
    strategy = context.scope_strategy()
    if strategy is None or buffer is None or context.current_replica() is not None:
        return None
    return strategy.extended.capture_buffer(module, name, buffer)


def _on_parameter_created(param: torch.Tensor) -> None:
    strategy = context.scope_strategy()
    if strategy is None or context.current_replica() is not None:
        return
    # Real parameters only: tracing makes fake ones (FakeTensor, not a Parameter subclass
    # whatever ``isinstance`` says) and meta ones, which hold no value to distribute.
    if not issubclass(type(param), torch.nn.Parameter) or param.is_meta:
        return
    strategy.extended.capture_variable(param)


def _creating_parameters(original: Any) -> Any:
    @functools.wraps(original)
    def new(cls: type, *args: Any, **kwargs: Any) -> Any:
        param = original(cls, *args, **kwargs)
        _on_parameter_created(param)
        return param

    return staticmethod(new)


def optimizer_owner(optimizer: torch.optim.Optimizer) -> StrategyLike | None:
    """The strategy owning an optimizer's parameters; mixed ownership is an error."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    cached = _optimizer_owner.get(optimizer)
    if cached is not None and cached[1] == len(params):
        return cached[0]() if cached[0] is not None else None
    owners = {id(s): s for p in params if (s := _owners.get(p)) is not None}
    if len(owners) > 1:
        names = sorted(type(s).__name__ for s in owners.values())
        raise RuntimeError(f"one optimizer updates parameters of several strategies: {names}")
    strategy = next(iter(owners.values()), None)
    if strategy is not None:
        outside = sum(1 for p in params if _owners.get(p) is None)
        strategy.extended.check_optimizer(optimizer, len(params), outside)
    _optimizer_owner[optimizer] = (
        weakref.ref(strategy) if strategy is not None else None,
        len(params),
    )
    return strategy


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    strategy = optimizer_owner(optimizer)
    if strategy is not None:
        if context.current_replica() is None:
            # A step outside strategy.run, perhaps still inside the scope: the variables it
            # updates must be distributed first (run adopts them itself).
            strategy.extended.adopt_pending()
        strategy.extended.before_optimizer_step(optimizer)


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    strategy = optimizer_owner(optimizer)
    if strategy is not None:
        strategy.extended.after_optimizer_step(optimizer)


def install_hooks() -> None:
    """Install the global hooks (idempotent)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        register_module_parameter_registration_hook(_on_parameter)
        register_module_buffer_registration_hook(_on_buffer)
        torch.nn.Parameter.__new__ = _creating_parameters(torch.nn.Parameter.__new__)
        grad_scaler_merge.install()
        _optimizer_module.register_optimizer_step_pre_hook(_before_step)
        _optimizer_module.register_optimizer_step_post_hook(_after_step)
        _installed = True


def tensors_of(obj: object) -> list[torch.Tensor]:
    """The tensors a trackable holds: a module's parameters and buffers, an optimizer's
    parameters, a tensor itself; none for anything else."""
    if isinstance(obj, torch.nn.Module):
        return [*obj.parameters(), *obj.buffers()]
    if isinstance(obj, torch.optim.Optimizer):
        return [p for group in obj.param_groups for p in group["params"]]
    if isinstance(obj, torch.Tensor):
        return [obj]
    return []


def strategy_for(objects: Iterable[object]) -> StrategyLike:
    """The strategy that distributes ``objects`` (modules, optimizers, tensors): the one that
    owns their parameters and buffers; where none does, the current one (``get_strategy()``).

    Checkpoints ask it which process writes and what state to bring home first. Objects of two
    strategies in one checkpoint are an error: no one process could write both.
    """
    owners: dict[int, StrategyLike] = {}
    for obj in objects:
        for t in tensors_of(obj):
            owner = _owners.get(t)
            if owner is not None:
                owners[id(owner)] = owner
    if len(owners) > 1:
        names = sorted(type(s).__name__ for s in owners.values())
        raise RuntimeError(
            f"these objects belong to several strategies ({names}); checkpoint each "
            "strategy's objects separately"
        )
    return next(iter(owners.values()), None) or context.get_strategy()
