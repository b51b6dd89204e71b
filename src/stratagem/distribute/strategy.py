"""``sg.distribute.Strategy``: the API a training script calls (TF's ``tf.distribute.Strategy``).

Every method forwards to ``strategy.extended`` (``extended.py``), which implements it; this
class only adds the scope's bookkeeping (which strategy is current in this thread). A concrete
strategy is a ``StrategyExtended`` subclass wrapped by a ``Strategy`` subclass whose constructor
takes TF's arguments, as in TensorFlow (``MirroredStrategy`` / ``MirroredExtended``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from stratagem.comm import ReduceOp
from stratagem.distribute.extended import StrategyExtended
from stratagem.distribute.machinery import context, device_scope
from stratagem.distribute.machinery.input import InputContext, InputOptions
from stratagem.distribute.machinery.start_line import announce_start


class Strategy:
    """Distribute computation over replicas (``sg.distribute.Strategy``)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Strategy:
        # Before the subclass builds its ``extended`` (the rendezvous included): the start line
        # says how long the whole start took.
        self = super().__new__(cls)
        self._construction_started = time.monotonic()
        return self

    def __init__(self, extended: StrategyExtended) -> None:
        if not isinstance(extended, StrategyExtended):
            raise TypeError(f"Strategy needs a StrategyExtended, got {type(extended).__name__}")
        if extended.strategy is not self:
            raise ValueError(
                "the StrategyExtended given to Strategy.__init__ was made for another strategy, "
                f"{extended.strategy!r}; make it for this one: "
                "super().__init__(MyExtended(self, ...))"
            )
        self._extended = extended
        # Every strategy's start-up ends here, its ``extended`` complete: say so once.
        started = getattr(self, "_construction_started", time.monotonic())
        announce_start(extended, time.monotonic() - started)

    # ------------------------------------------------------------------ properties

    @property
    def extended(self) -> StrategyExtended:
        """The implementer contract: placement, steps, process facts, checkpoint state."""
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        return self._extended.num_replicas_in_sync

    @property
    def cluster_resolver(self) -> Any:
        return self._extended.cluster_resolver

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(devices=[{', '.join(self._extended.worker_devices)}], "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )

    # ------------------------------------------------------------------ scope

    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Modules, parameters and optimizers created inside are distributed by this strategy."""
        device_scope.check_strategy(self)  # inside an sg.device naming another device: an error
        context.push_scope(self)
        try:
            with self._extended.in_scope():
                yield self
        finally:
            outermost = context.pop_scope(self)
        if outermost:
            self._extended.adopt_captured()

    def distribute_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """The explicit form of ``scope()``: distribute a module built elsewhere; returns it."""
        return self._extended.distribute_module(module)

    # ------------------------------------------------------------------ run, reduce, gather

    def run(
        self, fn: Callable[..., Any], args: Iterable[Any] = (), kwargs: dict | None = None
    ) -> Any:
        """Run ``fn`` once per replica; PerReplica arguments give each replica its own value.

        Returns fn's result: with one local replica, as is; with several, the same structure
        with PerReplica leaves.
        """
        context.check_not_mixed(self)
        return self._extended.call_for_each_replica(fn, args, kwargs)

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Combine a per-replica value across all replicas (and along ``axis`` first)."""
        context.check_not_mixed(self)
        return self._extended.reduce(reduce_op, value, axis)

    def gather(self, value: Any, axis: int = 0) -> Any:
        """Concatenate every replica's value along ``axis`` (sizes along it may differ)."""
        context.check_not_mixed(self)
        return self._extended.gather(value, axis)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The values of the replicas in this process, as a tuple."""
        return self._extended.local_results(value)

    # ------------------------------------------------------------------ input

    def experimental_distribute_dataset(
        self, dataset: Iterable[Any], options: InputOptions | None = None
    ) -> Iterable[Any]:
        """Split each global batch of ``dataset`` across all replicas."""
        context.check_not_mixed(self)
        return self._extended.distribute_dataset(dataset, options)

    def distribute_datasets_from_function(
        self,
        dataset_fn: Callable[[InputContext], Iterable[Any]],
        options: InputOptions | None = None,
    ) -> Iterable[Any]:
        """Build one input pipeline per worker from ``dataset_fn(input_context)``."""
        context.check_not_mixed(self)
        return self._extended.distribute_datasets_from_function(dataset_fn, options)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[Any], Any]) -> Any:
        """A PerReplica of ``value_fn(ctx)`` for each local replica (ctx has the replica id)."""
        return self._extended.distribute_values_from_function(value_fn)
