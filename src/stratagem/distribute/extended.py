"""``strategy.extended``: the contract between a strategy and everything that uses it.

As in TensorFlow, ``Strategy`` (the API a script calls) only forwards; ``StrategyExtended``
implements it, and library code (Keras, checkpoints, input) talks to it. This class is the
**core** every strategy has: two **required** members (``adopt``: what scope does to new
parameters and buffers; ``before_optimizer_step``: how the replicas' gradients become one
update); **public methods that validate, then call hooks** (``call_for_each_replica``,
``merge_call``, ``reduce``, ``gather``, ``accumulate_gradients``, the input methods) whose hooks
have defaults a strategy overrides where it differs; **placement** (the capture hooks that
``machinery/scope_hooks.py`` calls, ``adopt_model``, ``distribute_module``); **process facts**
and **checkpoint state**. Hooks only the strategy itself calls are protected (TF's ``_x``);
every override carries ``@override``. What only some strategies do is a capability
(``capabilities.py``). ``docs/architecture.md`` tables every member, and
``docs/writing_a_strategy.md`` walks through writing a strategy.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from stratagem.cluster.torchrun import ELASTIC_CHANGE_VARIABLE
from stratagem.comm import Communicator, ReduceOp
from stratagem.comm.cross_device_ops import CrossDeviceOps, ReductionToOneDevice
from stratagem.distribute.capabilities import DefersGradients, MergesReplicas, PipelinedSteps
from stratagem.distribute.machinery import context, scope_hooks
from stratagem.distribute.machinery.context import ReplicaContext, StrategyLike
from stratagem.distribute.machinery.input import (
    DistributedDataset,
    DistributedDatasetFromFunction,
    InputContext,
    InputOptions,
    recorded_global_batch_size,
    split_sizes,
)
from stratagem.distribute.machinery.per_replica import (
    PerReplica,
    local_results,
    regroup,
    select_replica,
)
from stratagem.distribute.machinery.reduction import gather_values, reduce_values
from stratagem.distribute.machinery.replica_devices import ReplicaDevice, parse_device
from stratagem.distribute.machinery.replica_random import ReplicaRandom, replica_generators
from stratagem.distribute.machinery.replica_threads import ReplicaView


class StrategyExtended(ABC):
    """``strategy.extended``: how a strategy places, steps, communicates and checkpoints.

    ``container_strategy`` is the ``Strategy`` this extends (TF's ``_container_strategy()``);
    ``devices`` are this process's replicas, one each (``"cpu:0"``, ``"cuda:1"``, a
    ``torch.device``); ``comm`` reaches the other processes;
    ``gradient_aggregation`` is ``ReduceOp.SUM`` (the seeds' convention: each replica's loss is
    its share of the global mean) or ``ReduceOp.MEAN`` (PyTorch's: each replica's loss is its
    own mean); ``sync_timeout`` bounds a wait at a sync point between replica threads.
    """

    def __init__(
        self,
        container_strategy: StrategyLike,
        devices: Sequence[str | torch.device | ReplicaDevice],
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
                f"gradient_aggregation must be ReduceOp.SUM (TensorFlow's convention, with the "
                f"loss divided by the global batch) or ReduceOp.MEAN (PyTorch's), got {aggregation}"
            )
        devices = [d if isinstance(d, ReplicaDevice) else parse_device(d) for d in devices]
        if not devices:
            raise ValueError(f"a strategy needs at least one device, got {devices!r}")
        scope_hooks.install_hooks()
        self._container = container_strategy
        self._devices = devices
        self._comm = comm
        self._cluster_resolver = cluster_resolver
        self._cross_device_ops = cross_device_ops or ReductionToOneDevice()
        self._aggregation = aggregation
        self._captured: list[tuple[torch.Tensor, bool]] = []
        # A parameter moved to ``_placement_device`` -> the parameter that replaced it.
        self._placed: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # Parameters created in scope on their own (``_keep_variable``), held weakly until
        # adopted: one that dies first (a temporary) is nobody's variable.
        self._created: list[weakref.ref[torch.Tensor]] = []
        self._sync_timeout = sync_timeout
        self._merge_values: list[Any] = [None] * len(devices)
        self._merge_result: Any = None
        # accumulate_gradients(): how many blocks are open (replica threads each open one),
        # and whether one was opened since the last run began (``_deferred_in_run``).
        self._accumulation_lock = threading.Lock()
        self._accumulating = 0
        self._accumulated_in_run = False

    # ================================================================== process facts

    @property
    def strategy(self) -> StrategyLike:
        """The ``Strategy`` this extends (what ``ReplicaContext.strategy`` and scopes name)."""
        return self._container

    @property
    def communicator(self) -> Communicator:
        """Collectives among this strategy's processes (the replicas' processes)."""
        return self._comm

    @property
    def cluster_resolver(self) -> Any:
        return self._cluster_resolver

    @property
    def num_replicas_in_sync(self) -> int:
        return len(self._devices) * self._comm.world_size

    @property
    def replica_devices(self) -> tuple[torch.device, ...]:
        """The torch devices of this process's replicas, in replica order."""
        return tuple(d.torch_device for d in self._devices)

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """TF's name: the devices this process computes on."""
        return tuple(d.name for d in self._devices)

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """TF's name: where the variables live (the first replica's device by default)."""
        return self.worker_devices[:1]

    @property
    def should_checkpoint(self) -> bool:
        """Whether this process writes checkpoints and saved models (the chief)."""
        return self._comm.is_chief

    @property
    def should_save_summary(self) -> bool:
        """Whether this process writes summaries and prints progress (the chief)."""
        return self._comm.is_chief

    @property
    def should_init(self) -> bool:
        return True

    @property
    def gradient_aggregation(self) -> ReduceOp:
        """How gradients are combined across replicas: ``SUM`` or ``MEAN`` (see the class)."""
        return self._aggregation

    @property
    def membership_change(self) -> str:
        """What changed in the job's membership before this process started, in words, as the
        elastic agent tells its workers ("continued with 2 of 3 workers; worker 2 lost: ...");
        "" when nothing did."""
        return os.environ.get(ELASTIC_CHANGE_VARIABLE, "")

    def offer_in_place(self) -> bool:
        """Whether this worker goes on in its own process after a peer of an elastic job is
        lost (then it tells the agent so). No by default: the agent starts a new round of new
        processes, which resume from the newest checkpoint."""
        return False

    def rejoin(self, state: Sequence[torch.Tensor], committed: int) -> str:
        """After ``MembershipChanged`` (a peer lost), for a strategy that ``offer_in_place``:
        the agent's word, the group rebuilt in place without the lost, and every survivor given
        the newest ``state`` (from the one that committed the most steps, ``committed`` here).
        Returns what happened, in words."""
        raise NotImplementedError(f"{type(self).__name__} does not rebuild in place")

    def barrier(self, what: str) -> None:
        """Wait until every process of the job reaches this point (``what`` names it)."""
        self._comm.barrier(what=what)

    def describe(self) -> dict[str, Any]:
        """What distributes this process, as plain data (checkpoints record it)."""
        return {
            "strategy": type(self._container).__name__,
            "num_replicas_in_sync": self.num_replicas_in_sync,
            "devices": list(self.worker_devices),
            "rank": self._comm.rank,
            "world_size": self._comm.world_size,
        }

    def variable_created_in_scope(self, v: torch.Tensor) -> bool:
        """TF's name: whether ``v`` was created in (or handed to) this strategy's scope."""
        return scope_hooks.owner_of(v) is self._container

    # ================================================================== placement

    def in_scope(self) -> contextlib.AbstractContextManager[None]:
        """Entered on every ``strategy.scope()`` entry, inside the strategy's scope."""
        return contextlib.nullcontext()

    @property
    def _placement_device(self) -> torch.device:
        """Where tensors created in scope live: the first local device by default."""
        return self._devices[0].torch_device

    def _place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor created in scope, moved to ``_placement_device`` if it is elsewhere."""
        device = self._placement_device
        if tensor.device == device:
            return tensor
        with torch.no_grad():
            return tensor.to(device)

    def capture_parameter(
        self, module: torch.nn.Module, name: str, param: torch.nn.Parameter
    ) -> torch.nn.Parameter | None:
        """A parameter registered in scope: claim it, place it, and keep it for ``adopt`` at
        the scope's exit. Returns the parameter to register instead, or None to keep it."""
        placed = self._placed.get(param)
        if placed is None:
            placed = self._place(param)
            if placed is not param:
                placed = torch.nn.Parameter(placed, requires_grad=param.requires_grad)
                # One replacement however many names register it: a tied parameter (the
                # same tensor under two names, as distribute_module meets it) stays one.
                self._placed[param] = placed
        scope_hooks.claim(placed, self._container)
        self._captured.append((placed, True))
        return placed if placed is not param else None

    def capture_buffer(
        self, module: torch.nn.Module, name: str, buffer: torch.Tensor
    ) -> torch.Tensor | None:
        """A buffer registered in scope; as ``capture_parameter``."""
        placed = self._place(buffer)
        scope_hooks.claim(placed, self._container)
        self._captured.append((placed, False))
        return placed if placed is not buffer else None

    def capture_variable(self, param: torch.nn.Parameter) -> None:
        """A parameter just created in scope (``nn.Parameter(...)``, TF's ``tf.Variable``),
        whether it stays on its own or a module registers it next (``capture_parameter`` then
        sees it again). By default it is left alone: a strategy that distributes modules (lays
        them out, shards them, splits them into stages) sees only what modules register. A
        strategy that distributes every variable whole calls ``_keep_variable`` here."""

    def _keep_variable(self, param: torch.nn.Parameter) -> None:
        """Claim a parameter created in scope and adopt it with the next ``adopt_captured``
        (placed on ``_placement_device`` then, in place), if it is still alive by then."""
        scope_hooks.claim(param, self._container)
        self._created.append(weakref.ref(param))

    def _created_variables(self) -> list[tuple[torch.Tensor, bool]]:
        created, self._created = self._created, []
        alive = [p for ref in created if (p := ref()) is not None]
        device = self._placement_device
        with torch.no_grad():
            for p in alive:
                if p.device != device:
                    # In place: the caller's object (and any optimizer made over it) stays
                    # the variable.
                    p.data = p.data.to(device)
        return [(p, True) for p in alive]

    def adopt_captured(self) -> None:
        """Adopt what was captured since the last call (at the outermost scope's exit, and
        before any step: see ``adopt_pending``)."""
        captured, self._captured = self._captured, []
        captured += self._created_variables()
        # A tensor re-registered under another name is captured twice; adopt it once.
        unique = list({id(t): (t, is_param) for t, is_param in captured}.values())
        if unique:
            self.adopt(unique)

    def adopt_pending(self) -> None:
        """Adopt what was captured and not adopted yet, before it is used by a step.

        TF distributes a variable when it is created, so TF's tutorials train inside
        ``with strategy.scope():``. Adoption here waits for the scope's end (one broadcast for
        a whole model, paths known), so every step (``run``, an optimizer step outside ``run``)
        first adopts what the scope has captured so far: a step inside the scope computes on
        the same distributed variables as one after it. Idempotent and cheap when nothing is
        pending; called in the cross-replica context only.
        """
        if self._captured or self._created:
            self.adopt_captured()

    @abstractmethod
    def adopt(self, tensors: list[tuple[torch.Tensor, bool]]) -> None:
        """Required: new parameters (True) and buffers (False) created in scope, at the scope's
        exit (and before a step inside it): mirror them, broadcast their initial values, shard
        them... or nothing, saying why."""

    def adopt_model(self, module: torch.nn.Module) -> None:
        """A whole model handed over (``sg.keras.Model(module)``) before an optimizer binds to
        its parameters: where a strategy needs every parameter's path, not just the tensor."""

    def distribute_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """The explicit form of ``scope()``: distribute a module built elsewhere; returns it."""
        with torch.no_grad():
            for submodule in module.modules():
                # Through torch's own dicts: registering anew would run the capture hooks again.
                for name, p in list(submodule._parameters.items()):
                    if p is not None and scope_hooks.owner_of(p) is None:
                        new = self.capture_parameter(submodule, name, p)
                        if new is not None:
                            submodule._parameters[name] = new
                for name, b in list(submodule._buffers.items()):
                    if b is not None and scope_hooks.owner_of(b) is None:
                        new = self.capture_buffer(submodule, name, b)
                        if new is not None:
                            submodule._buffers[name] = new
        self.adopt_captured()
        return module

    # ================================================================== steps

    def call_for_each_replica(
        self, fn: Callable[..., Any], args: Iterable[Any] = (), kwargs: dict | None = None
    ) -> Any:
        """``strategy.run``: ``fn`` once per replica; PerReplica arguments give each replica its
        own value. With one local replica the result is fn's, as is; with several, the same
        structure with PerReplica leaves."""
        if context.current_replica() is not None:
            raise RuntimeError("strategy.run cannot be called inside strategy.run")
        self._check_replica_steps("run")
        self.adopt_pending()
        args, kwargs = self._run_arguments(tuple(args), dict(kwargs or {}))
        global_batch = recorded_global_batch_size((args, kwargs))
        self._accumulated_in_run = False
        self._before_run()
        try:
            with self._run_guard():
                # Before leave_run: a mesh's replica values need the run's batch size.
                result = self.replica_values(self._run_replicas(fn, args, kwargs, global_batch))
        finally:
            self._leave_run()
        self._after_run()
        return result

    def _run_replicas(
        self, fn: Callable[..., Any], args: tuple, kwargs: dict, global_batch: int | None
    ) -> Any:
        n = len(self._devices)
        first_id = self._comm.rank * n
        if n == 1:
            ctx = ReplicaContext(self._container, first_id, 0, global_batch)
            previous = context.set_replica(ctx)
            view = self._replica_view(0)  # empty unless it computes on copies
            try:
                with ReplicaView(view) if view else contextlib.nullcontext():
                    return fn(*select_replica(args, 0, 1), **select_replica(kwargs, 0, 1))
            finally:
                context.set_replica(previous)
        calls = self._replica_calls(fn, args, kwargs, global_batch)
        return regroup(self.run_replica_calls(calls))

    def run_replica_calls(self, calls: list[Callable[[], Any]]) -> list[Any]:
        """Run one call per local replica (each sets its own replica context, device and
        view) and return their results in order. With one local replica it is just called;
        several need a way to run: on threads that meet at merge calls (``ThreadedReplicas``),
        or another (a strategy overrides this: in turn, say)."""
        if len(calls) != 1:
            raise NotImplementedError(
                f"{type(self._container).__name__} has {len(calls)} local replicas and no way to "
                "run them: its StrategyExtended subclass must override run_replica_calls (or "
                "derive from stratagem.distribute.threaded_replicas.ThreadedReplicas)"
            )
        return [calls[0]()]

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
        # Drawn here, before any replica runs: see ``machinery.replica_random``.
        generators = replica_generators([d.torch_device for d in self._devices])

        def on_replica(i: int) -> Callable[[], Any]:
            ctx = ReplicaContext(self._container, first_id + i, i, global_batch)
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
                        self._enter_replica(i, stack)
                        view = self._replica_view(i)
                        if view:  # replica 0 of most strategies computes on the primaries
                            stack.enter_context(ReplicaView(view))
                        if generators[i] is not None:
                            stack.enter_context(ReplicaRandom(generators[i]))
                        return fn(*r_args, **r_kwargs)
                finally:
                    context.set_replica(previous)

            return call

        return [on_replica(i) for i in range(n)]

    def _replica_view(self, replica: int) -> dict[int, torch.Tensor]:
        """id(primary) → this replica's copy; empty where it computes on the primaries."""
        return {}

    def _enter_replica(self, replica: int, stack: contextlib.ExitStack) -> None:
        """Called in each replica's call of a run of several, before ``fn``: enter (on
        ``stack``) what that replica runs under besides its context, device, view and random
        stream (nothing by default)."""

    def _run_arguments(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``run``'s arguments as the replicas get them (a mesh makes global DTensors of the
        batch); as they are by default."""
        return args, kwargs

    def _run_guard(self) -> contextlib.AbstractContextManager[None]:
        """Entered around the replicas' calls of a ``run`` (a mesh names a peer lost in
        DTensor's own collectives); nothing by default."""
        return contextlib.nullcontext()

    def _before_run(self) -> None:
        """Called before each ``run``, in the cross-replica context."""

    def _leave_run(self) -> None:
        """Called when ``run`` ends, also when it raises (undo what ``_before_run`` set)."""

    def _after_run(self) -> None:
        """Called after each ``run`` that succeeded, in the cross-replica context."""

    def merge_call(self, what: str, action: Callable[[], None]) -> None:
        """TF's merge call: in a replica context every local replica meets and ``action`` runs
        once; in the cross-replica context ``action`` just runs. ``what`` names the meeting.
        Several local replicas meet only where the strategy ``MergesReplicas``."""
        ctx = context.current_replica()
        if ctx is None or ctx.strategy is not self._container:
            action()
            return
        if len(self._devices) == 1:
            if self._replica_view(0):
                # The one replica computes on copies (CentralStorageStrategy on one device):
                # the action, an update of the primaries, must see them, not the copies.
                with torch._C.DisableTorchFunction():
                    action()
            else:
                action()
            return
        if not isinstance(self, MergesReplicas):
            raise NotImplementedError(
                f"{type(self._container).__name__} runs its replicas one after another, so they "
                f"cannot meet at {what} inside strategy.run"
            )
        self.merge_replicas(ctx, what, action)

    def check_optimizer(
        self, optimizer: torch.optim.Optimizer, num_params: int, num_outside: int
    ) -> None:
        """Refuse optimizers mixing this strategy's parameters with undistributed ones."""
        if num_outside and self.num_replicas_in_sync > 1:
            raise RuntimeError(
                f"this optimizer updates {num_params - num_outside} parameters created in "
                f"{type(self._container).__name__}.scope() and {num_outside} created outside "
                "it; the outside ones would not be kept in sync. Create the whole model inside "
                "strategy.scope(), or pass it through strategy.distribute_module()"
            )

    @contextlib.contextmanager
    def accumulate_gradients(self) -> Iterator[None]:
        """Backward passes in this block only accumulate gradients locally; the replicas'
        gradients are combined once, by the next backward outside it (overlapped with that
        backward, where the strategy overlaps reductions) or by the next optimizer step.

        For gradient accumulation in a custom loop, as DDP's ``no_sync()``: the first k-1
        micro-batches' backward passes inside, the k-th outside, then ``optimizer.step()``. The
        result is exact: the same gradients as without the block, for 1/k of the traffic.
        Inside or around ``strategy.run``; every process must enter it for the same passes.
        """
        with self._accumulation_lock:
            if self._accumulating == 0:
                self._defer(True)
            self._accumulating += 1
            self._accumulated_in_run = True
        try:
            yield
        finally:
            with self._accumulation_lock:
                self._accumulating -= 1
                if self._accumulating == 0:
                    self._defer(False)

    def _defer(self, defer: bool) -> None:
        # A strategy without DefersGradients combines gradients at the step: nothing to hold.
        if isinstance(self, DefersGradients):
            self.defer_gradient_reduction(defer)

    def _deferred_in_run(self) -> bool:
        """Whether gradients are held back now, or a block of ``accumulate_gradients`` was
        opened during the current ``run`` (for strategies that combine gradients after run)."""
        return self._accumulating > 0 or self._accumulated_in_run

    @abstractmethod
    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Required: how the replicas' gradients become one update. Called by the optimizer
        step pre-hook before every ``optimizer.step()`` over parameters this strategy owns
        (possibly once in every replica thread)."""

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Called by the optimizer step post-hook (possibly in every replica thread)."""

    def replica_values(self, structure: Any) -> Any:
        """Values computed in a replica, as that replica's own: the identity, except where a
        replica computes on global tensors (a mesh) and holds a part of each."""
        return structure

    # ================================================================== reduce and gather

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """``strategy.reduce``: combine a per-replica value across all replicas (and along
        ``axis`` first)."""
        if context.current_replica() is not None:
            raise RuntimeError(
                "strategy.reduce is called in the cross-replica context (outside strategy.run); "
                "inside run use sg.distribute.get_replica_context().all_reduce(op, value)"
            )
        self._check_replica_steps("reduce")
        op = ReduceOp.parse(reduce_op)
        if isinstance(value, tuple | list | dict) and not isinstance(value, PerReplica):
            # A structure of values (what run returns for fn's structure): each leaf reduced,
            # the structure kept, as TF's nest.map_structure does; never stacked into one.
            return pytree.tree_map(
                lambda leaf: self._reduce_values(op, self._local_values(leaf), axis),
                value,
                is_leaf=lambda leaf: isinstance(leaf, PerReplica),
            )
        return self._reduce_values(op, self._local_values(value), axis)

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
        return reduce_values(
            op,
            values,
            axis,
            num_replicas=self.num_replicas_in_sync,
            cross_device_ops=self._cross_device_ops,
            comm=self._comm,
            destination=self._devices[0].torch_device,
        )

    def gather(self, value: Any, axis: int = 0) -> Any:
        """``strategy.gather``: every replica's value concatenated along ``axis`` (sizes along
        it may differ)."""
        if context.current_replica() is not None:
            raise RuntimeError("strategy.gather is called outside strategy.run")
        self._check_replica_steps("gather")
        destination = self._devices[0].torch_device
        values = [v.to(destination) for v in self._local_values(value)]
        return gather_values(values, axis, self._comm)

    def _check_replica_steps(self, what: str) -> None:
        """A pipeline's processes hold stages, not replicas: ``what`` is refused, naming how
        to train instead."""
        if isinstance(self, PipelinedSteps):
            raise NotImplementedError(self.replica_steps_refused(what))

    def local_results(self, value: Any) -> tuple[Any, ...]:
        """The values of the replicas in this process, as a tuple."""
        return local_results(value, len(self._devices))

    def replica_all_reduce(self, ctx: ReplicaContext, reduce_op: Any, value: Any) -> Any:
        """``ReplicaContext.all_reduce``: a sync point among local replicas, then across
        processes."""
        op = ReduceOp.parse(reduce_op)

        def reduce_one(values: list[torch.Tensor]) -> torch.Tensor:
            return self._reduce_values(op, values, None)

        structure = pytree.tree_map(torch.as_tensor, value)
        if len(self._devices) == 1:
            return pytree.tree_map(lambda t: reduce_one([t]).to(t.device), structure)
        self._merge_values[ctx.local_replica_id] = structure

        def action() -> None:
            flats = [pytree.tree_flatten(v)[0] for v in self._merge_values]
            spec = pytree.tree_flatten(self._merge_values[0])[1]
            reduced = [reduce_one([f[k] for f in flats]) for k in range(len(flats[0]))]
            self._merge_result = (reduced, spec)

        self.merge_call("ReplicaContext.all_reduce", action)
        reduced, spec = self._merge_result
        device = self._devices[ctx.local_replica_id].torch_device
        return pytree.tree_unflatten([t.to(device) for t in reduced], spec)

    # ================================================================== input

    def split_sizes(self, total: int, parts: int, full: int | None = None) -> list[int]:
        """How a global batch of ``total`` examples is cut into ``parts`` replica batches;
        ``full`` is the dataset's full batch when ``total`` is a smaller, last one (TF's cut)."""
        return split_sizes(total, parts, full)

    def distribute_dataset(
        self, dataset: Iterable[Any], options: InputOptions | None = None
    ) -> Iterable[Any]:
        """``experimental_distribute_dataset``: each global batch split across all replicas
        (or, where ``_splits_global_batches`` says not, every process gets it whole)."""
        return DistributedDataset(self, dataset, options, split=self._splits_global_batches())

    def _splits_global_batches(self) -> bool:
        """Whether a distributed dataset cuts each global batch into the replicas' parts
        (a pipeline's processes each get it whole); True by default."""
        return True

    def distribute_datasets_from_function(
        self,
        dataset_fn: Callable[[InputContext], Iterable[Any]],
        options: InputOptions | None = None,
    ) -> Iterable[Any]:
        """One input pipeline per process from ``dataset_fn(input_context)``."""
        self._check_replica_steps("distribute_datasets_from_function")
        return DistributedDatasetFromFunction(self, dataset_fn, self._input_context(), options)

    def _input_context(self) -> InputContext:
        """This process's input pipeline among the job's: one per process by default."""
        comm = self._comm
        return InputContext(
            num_input_pipelines=comm.world_size,
            input_pipeline_id=comm.rank,
            num_replicas_in_sync=self.num_replicas_in_sync,
        )

    def distribute_values_from_function(self, value_fn: Callable[[Any], Any]) -> Any:
        """A PerReplica of ``value_fn(ctx)`` for each local replica (ctx has the replica id)."""
        n = len(self._devices)
        values = [
            value_fn(ReplicaContext(self._container, self._comm.rank * n + i, i, None))
            for i in range(n)
        ]
        return values[0] if n == 1 else PerReplica(values)

    # ================================================================== checkpoint state

    def before_checkpoint_write(self, objects: list[object]) -> None:
        """Called on every process before a checkpoint or saved model of ``objects`` (modules,
        optimizers, tensors) is written by the process that ``should_checkpoint``: bring state
        held elsewhere home. A strategy may make it a collective (every process calls it at the
        same point)."""

    def after_checkpoint_restore(self, objects: list[object]) -> None:
        """Called on every process after ``objects`` were restored from a checkpoint: send
        state held elsewhere its restored values."""
