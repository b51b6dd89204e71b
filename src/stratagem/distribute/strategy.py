"""The Strategy interface and the mechanics every strategy shares.

A strategy is a list of local devices (one replica each) and a communicator to the other
processes (``LocalCommunicator`` when alone). From those two this base class provides the whole
public API once — ``scope``, ``run``, ``reduce``, ``gather``, distributed datasets — so each
concrete strategy file only says what differs: where parameters live, how they are mirrored,
and how gradients are combined before the optimizer steps (the ``_`` hooks at the end).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from stratagem.comm import Communicator, ReduceOp, set_distribution_context
from stratagem.comm.cross_device_ops import CrossDeviceOps, ReductionToOneDevice
from stratagem.distribute import context
from stratagem.distribute import scope as scope_hooks
from stratagem.distribute.context import ReplicaContext
from stratagem.distribute.devices import LogicalDevice
from stratagem.distribute.input import (
    DistributedDataset,
    DistributedDatasetFromFunction,
    InputContext,
    InputOptions,
    recorded_global_batch_size,
    split_sizes,
)
from stratagem.distribute.replicas import ReplicaGroup, ReplicaView
from stratagem.distribute.values import PerReplica, local_results, regroup, select_replica


@dataclass(frozen=True)
class StrategyExtended:
    """``strategy.extended``: the parts of TF's extended API that scripts commonly read."""

    worker_devices: tuple[str, ...]
    parameter_devices: tuple[str, ...]
    should_checkpoint: bool
    should_save_summary: bool
    should_init: bool = True


class Strategy:
    """Distribute computation over replicas (``sg.distribute.Strategy``)."""

    def __init__(
        self,
        devices: list[LogicalDevice],
        *,
        comm: Communicator,
        cluster_resolver: Any = None,
        cross_device_ops: CrossDeviceOps | None = None,
        gradient_aggregation: ReduceOp | str = ReduceOp.SUM,
        sync_timeout: float = 60.0,
    ) -> None:
        aggregation = ReduceOp.parse(gradient_aggregation)
        if aggregation not in (ReduceOp.SUM, ReduceOp.MEAN):
            raise ValueError(
                f"gradient_aggregation must be ReduceOp.SUM (the seeds' convention, with the loss "
                f"divided by the global batch) or ReduceOp.MEAN (PyTorch's), got {aggregation}"
            )
        scope_hooks.install_hooks()
        self._devices = devices
        self._comm = comm
        self._cluster_resolver = cluster_resolver
        self._cross_device_ops = cross_device_ops or ReductionToOneDevice()
        self._average_gradients = aggregation is ReduceOp.MEAN
        self._captured: list[tuple[torch.Tensor, bool]] = []
        self._replicas = ReplicaGroup(len(devices), sync_timeout) if len(devices) > 1 else None
        # Intra-op threads per replica thread when replicas share the CPU (MirroredStrategy);
        # between sync points one replica works alone and gets the process's threads back.
        self._intra_op_threads: int | None = None
        self._process_threads = torch.get_num_threads()
        self._merge_values: list[Any] = [None] * len(devices)
        self._merge_result: Any = None
        if type(self).__name__ != "_DefaultDistributionStrategy":
            set_distribution_context(
                strategy=type(self).__name__,
                num_replicas_in_sync=self.num_replicas_in_sync,
                devices=[d.name for d in devices],
            )

    # ------------------------------------------------------------------ properties

    @property
    def num_replicas_in_sync(self) -> int:
        return len(self._devices) * self._comm.world_size

    @property
    def cluster_resolver(self) -> Any:
        return self._cluster_resolver

    @property
    def extended(self) -> StrategyExtended:
        names = tuple(d.name for d in self._devices)
        chief = self._comm.is_chief
        return StrategyExtended(names, names[:1], chief, chief)

    def __repr__(self) -> str:
        devices = ", ".join(d.name for d in self._devices)
        return (
            f"{type(self).__name__}(devices=[{devices}], "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )

    # ------------------------------------------------------------------ scope

    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Modules, parameters and optimizers created inside are distributed by this strategy."""
        context.push_scope(self)
        try:
            yield self
        finally:
            outermost = context.pop_scope(self)
        if outermost:
            self._adopt_captured()

    def distribute_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """The explicit form of ``scope()``: distribute a module built elsewhere; returns it."""
        with torch.no_grad():
            for submodule in module.modules():
                for name, p in list(submodule._parameters.items()):
                    if p is not None and scope_hooks.owner_of(p) is None:
                        new = self._capture_parameter(submodule, name, p)
                        if new is not None:
                            submodule._parameters[name] = new
                for name, b in list(submodule._buffers.items()):
                    if b is not None and scope_hooks.owner_of(b) is None:
                        new = self._capture_buffer(submodule, name, b)
                        if new is not None:
                            submodule._buffers[name] = new
        self._adopt_captured()
        return module

    def _capture_parameter(
        self, module: torch.nn.Module, name: str, param: torch.nn.Parameter
    ) -> torch.nn.Parameter | None:
        placed = self._place(param)
        if placed is not param:
            placed = torch.nn.Parameter(placed, requires_grad=param.requires_grad)
        scope_hooks.claim(placed, self)
        self._captured.append((placed, True))
        return placed if placed is not param else None

    def _capture_buffer(
        self, module: torch.nn.Module, name: str, buffer: torch.Tensor
    ) -> torch.Tensor | None:
        placed = self._place(buffer)
        scope_hooks.claim(placed, self)
        self._captured.append((placed, False))
        return placed if placed is not buffer else None

    def _adopt_captured(self) -> None:
        captured, self._captured = self._captured, []
        # A tensor re-registered under another name is captured twice; adopt it once.
        unique = list({id(t): (t, is_param) for t, is_param in captured}.values())
        if unique:
            self._adopt(unique)

    # ------------------------------------------------------------------ run

    def run(
        self, fn: Callable[..., Any], args: Iterable[Any] = (), kwargs: dict | None = None
    ) -> Any:
        """Run ``fn`` once per replica; PerReplica arguments give each replica its own value.

        Returns fn's result: with one local replica, as is; with several, the same structure
        with PerReplica leaves.
        """
        if context.current_replica() is not None:
            raise RuntimeError("strategy.run cannot be called inside strategy.run")
        args, kwargs = tuple(args), dict(kwargs or {})
        n = len(self._devices)
        first_id = self._comm.rank * n
        global_batch = recorded_global_batch_size((args, kwargs))
        self._before_run()
        try:
            if self._replicas is None:
                ctx = ReplicaContext(self, first_id, 0, global_batch)
                previous = context.set_replica(ctx)
                view = self._replica_view(0)  # empty unless it computes on copies
                try:
                    with ReplicaView(view) if view else contextlib.nullcontext():
                        result = fn(*select_replica(args, 0, 1), **select_replica(kwargs, 0, 1))
                finally:
                    context.set_replica(previous)
            else:
                result = regroup(
                    self._replicas.run(self._replica_calls(fn, args, kwargs, global_batch))
                )
        finally:
            self._leave_run()
        self._after_run()
        return result

    def _replica_calls(
        self, fn: Callable[..., Any], args: tuple, kwargs: dict, global_batch: int | None
    ) -> list[Callable[[], Any]]:
        """One call per local replica, each in its replica context, device and view."""
        n = len(self._devices)
        first_id = self._comm.rank * n
        grad_enabled = torch.is_grad_enabled()
        autocast = {
            kind: (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
            for kind in {d.torch_device.type for d in self._devices}
        }

        def on_replica(i: int) -> Callable[[], Any]:
            ctx = ReplicaContext(self, first_id + i, i, global_batch)
            r_args, r_kwargs = select_replica(args, i, n), select_replica(kwargs, i, n)
            device = self._devices[i].torch_device

            def call() -> Any:
                previous = context.set_replica(ctx)
                try:
                    with contextlib.ExitStack() as stack:
                        stack.enter_context(torch.set_grad_enabled(grad_enabled))
                        for kind, (enabled, dtype) in autocast.items():
                            stack.enter_context(torch.autocast(kind, dtype, enabled=enabled))
                        if device.type == "cuda":
                            stack.enter_context(torch.cuda.device(device))
                        if self._intra_op_threads is not None:
                            stack.callback(torch.set_num_threads, torch.get_num_threads())
                            torch.set_num_threads(self._intra_op_threads)
                        view = self._replica_view(i)
                        if view:  # replica 0 of most strategies computes on the primaries
                            stack.enter_context(ReplicaView(view))
                        return fn(*r_args, **r_kwargs)
                finally:
                    context.set_replica(previous)

            return call

        return [on_replica(i) for i in range(n)]

    def _sync_replicas(self, what: str, action: Callable[[], None]) -> None:
        """A merge call: in replica context every replica meets and ``action`` runs once;
        in cross-replica context ``action`` just runs."""
        ctx = context.current_replica()
        if self._replicas is None or ctx is None or ctx.strategy is not self:
            action()
            return

        def unviewed() -> None:
            # Runs in whichever replica thread arrives last; it must see the primaries.
            with torch._C.DisableTorchFunction(), self._all_threads():
                action()

        self._replicas.sync(ctx.local_replica_id, what, unviewed)

    @contextlib.contextmanager
    def _all_threads(self) -> Iterator[None]:
        """Every intra-op thread of the process, for work one replica does while others wait."""
        if self._intra_op_threads is None:
            yield
            return
        previous = torch.get_num_threads()
        torch.set_num_threads(self._process_threads)
        try:
            yield
        finally:
            torch.set_num_threads(previous)

    # ------------------------------------------------------------------ reduce and gather

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The values of the replicas in this process, as a tuple."""
        return local_results(value)

    def reduce(
        self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None
    ) -> torch.Tensor:
        """Combine a per-replica value across all replicas (and along ``axis`` first)."""
        if context.current_replica() is not None:
            raise RuntimeError(
                "strategy.reduce is called in the cross-replica context (outside strategy.run); "
                "inside run use sg.distribute.get_replica_context().all_reduce(op, value)"
            )
        return self._reduce_values(ReduceOp.parse(reduce_op), self._local_values(value), axis)

    def _local_values(self, value: Any) -> list[torch.Tensor]:
        values = [torch.as_tensor(v).detach() for v in local_results(value)]
        n = len(self._devices)
        if len(values) == 1 and n > 1:
            values = values * n  # one value given for every replica (TF: a mirrored value)
        if len(values) != n:
            raise ValueError(f"got {len(values)} per-replica values for {n} local replicas")
        return values

    def _reduce_values(
        self, op: ReduceOp, values: list[torch.Tensor], axis: int | None
    ) -> torch.Tensor:
        destination = self._devices[0].torch_device
        combine = ReduceOp.SUM if op is ReduceOp.MEAN else op
        if axis is None:
            count = torch.tensor(float(self.num_replicas_in_sync))
            parts = values
        else:
            dims = {v.dim() for v in values}
            if any(not -d <= axis < d for d in dims):
                raise ValueError(f"axis {axis} is out of range for values of rank {sorted(dims)}")
            count = torch.tensor(float(sum(v.shape[axis] for v in values)))
            if op in (ReduceOp.SUM, ReduceOp.MEAN):
                parts = [v.sum(axis) for v in values]
            else:
                reducer = torch.amax if op is ReduceOp.MAX else torch.amin
                parts = [reducer(v, axis) for v in values if v.shape[axis] > 0]
                if not parts:
                    raise ValueError(f"cannot take {op.name} along axis {axis} of empty values")
        local = self._cross_device_ops.reduce(combine, parts, destination).clone()
        if op is ReduceOp.MEAN and not local.is_floating_point():
            local = local.double()
        self._comm.all_reduce(local, combine, what=f"strategy.reduce({op.name})")
        if op is not ReduceOp.MEAN:
            return local
        if axis is not None:
            self._comm.all_reduce(count, ReduceOp.SUM, what="strategy.reduce(MEAN) counts")
        return local / count.to(local.device, local.dtype)

    def gather(self, value: Any, axis: int = 0) -> torch.Tensor:
        """Concatenate every replica's value along ``axis`` (sizes along it may differ)."""
        if context.current_replica() is not None:
            raise RuntimeError("strategy.gather is called outside strategy.run")
        destination = self._devices[0].torch_device
        values = [v.to(destination) for v in self._local_values(value)]
        local = torch.cat(values, dim=axis)
        comm = self._comm
        if comm.world_size == 1:
            return local
        axis = axis % local.dim()
        size = torch.tensor([local.shape[axis]], dtype=torch.int64)
        sizes = [int(s) for s in comm.all_gather(size, what="strategy.gather sizes")]
        pad = max(sizes) - local.shape[axis]
        if pad:
            shape = list(local.shape)
            shape[axis] = pad
            local = torch.cat([local, local.new_zeros(shape)], dim=axis)
        pieces = comm.all_gather(local.contiguous(), what="strategy.gather")
        return torch.cat([p.narrow(axis, 0, s) for p, s in zip(pieces, sizes)], dim=axis)

    def _replica_all_reduce(self, ctx: ReplicaContext, reduce_op: Any, value: Any) -> Any:
        """``ReplicaContext.all_reduce``: a sync point among local replicas, then across workers."""
        op = ReduceOp.parse(reduce_op)

        def reduce_one(values: list[torch.Tensor]) -> torch.Tensor:
            return self._reduce_values(op, values, None)

        structure = pytree.tree_map(torch.as_tensor, value)
        if self._replicas is None:
            return pytree.tree_map(lambda t: reduce_one([t]).to(t.device), structure)
        self._merge_values[ctx.local_replica_id] = structure

        def action() -> None:
            flats = [pytree.tree_flatten(v)[0] for v in self._merge_values]
            spec = pytree.tree_flatten(self._merge_values[0])[1]
            reduced = [reduce_one([f[k] for f in flats]) for k in range(len(flats[0]))]
            self._merge_result = (reduced, spec)

        self._sync_replicas("ReplicaContext.all_reduce", action)
        reduced, spec = self._merge_result
        device = self._devices[ctx.local_replica_id].torch_device
        return pytree.tree_unflatten([t.to(device) for t in reduced], spec)

    # ------------------------------------------------------------------ input

    def experimental_distribute_dataset(
        self, dataset: Iterable[Any], options: InputOptions | None = None
    ) -> DistributedDataset:
        """Split each global batch of ``dataset`` across all replicas."""
        return DistributedDataset(self, dataset, options)

    def distribute_datasets_from_function(
        self,
        dataset_fn: Callable[[InputContext], Iterable[Any]],
        options: InputOptions | None = None,
    ) -> DistributedDatasetFromFunction:
        """Build one input pipeline per worker from ``dataset_fn(input_context)``."""
        return DistributedDatasetFromFunction(self, dataset_fn, options)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[Any], Any]) -> Any:
        """A PerReplica of ``value_fn(ctx)`` for each local replica (ctx has the replica id)."""
        n = len(self._devices)
        values = [
            value_fn(ReplicaContext(self, self._comm.rank * n + i, i, None)) for i in range(n)
        ]
        return values[0] if n == 1 else PerReplica(values)

    # ------------------------------------------------------------------ sg.keras.Model's steps

    def _train_batch(self, model: Any, batch: Any) -> None:
        """One ``Model.fit`` step on a distributed global batch: every replica runs the model's
        ``train_step``. A strategy that trains otherwise (a pipeline's schedule) overrides these
        three, so that fit, evaluate and predict stay written once."""
        self.run(model.train_step, args=(batch,))

    def _test_batch(self, model: Any, batch: Any) -> None:
        """One ``evaluate`` step: every replica runs the model's ``test_step``."""
        self.run(model.test_step, args=(batch,))

    def _predict_batch(self, model: Any, batch: Any) -> torch.Tensor:
        """One ``predict`` step: the outputs of every replica, gathered in order."""
        result = self.run(model.predict_step, args=(batch,))
        if not isinstance(result, PerReplica | torch.Tensor):
            raise TypeError(f"predict_step must return a tensor, got {type(result).__name__}")
        return self.gather(result, axis=0)

    # ------------------------------------------------------------------ what strategies specialise

    def _placement_device(self) -> torch.device:
        """Where tensors created in scope live: the first local device."""
        return self._devices[0].torch_device

    def _place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor created in scope, moved to ``_placement_device()`` if it is elsewhere."""
        device = self._placement_device()
        if tensor.device == device:
            return tensor
        with torch.no_grad():
            return tensor.to(device)

    def _adopt(self, tensors: list[tuple[torch.Tensor, bool]]) -> None:
        """New parameters (True) and buffers (False) created in scope, at the scope's exit."""

    def _adopt_model(self, module: torch.nn.Module) -> None:
        """A whole model handed over (``sg.keras.Model(module)``) before an optimizer binds to
        its parameters: where a strategy needs every parameter's path, not just the tensor."""

    def _split_sizes(self, total: int, parts: int) -> list[int]:
        """How a global batch of ``total`` examples is cut into ``parts`` replica batches."""
        return split_sizes(total, parts)

    def _replica_values(self, structure: Any) -> Any:
        """Values computed in a replica, as that replica's own: the identity, except where a
        replica computes on global tensors (a mesh) and holds a part of each."""
        return structure

    def _check_optimizer(
        self, optimizer: torch.optim.Optimizer, num_params: int, num_outside: int
    ) -> None:
        """Refuse optimizers mixing this strategy's parameters with undistributed ones."""
        if num_outside and self.num_replicas_in_sync > 1:
            raise RuntimeError(
                f"this optimizer updates {num_params - num_outside} parameters created in "
                f"{type(self).__name__}.scope() and {num_outside} created outside it; the "
                "outside ones would not be kept in sync. Create the whole model inside "
                "strategy.scope(), or pass it through strategy.distribute_module()"
            )

    def _replica_view(self, replica: int) -> dict[int, torch.Tensor]:
        """id(primary) → this replica's copy; empty where it computes on the primaries."""
        return {}

    def _before_run(self) -> None:
        """Called before each ``run``, in the cross-replica context."""

    def _leave_run(self) -> None:
        """Called when ``run`` ends, also when it raises (undo what ``_before_run`` set)."""

    def _after_run(self) -> None:
        """Called after each ``run`` that succeeded, in the cross-replica context."""

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Called by the optimizer step pre-hook (possibly in every replica thread)."""

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Called by the optimizer step post-hook (possibly in every replica thread)."""
