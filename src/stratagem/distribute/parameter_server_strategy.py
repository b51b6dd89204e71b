"""ParameterServerStrategy: parameters held by ps tasks; workers pull them and push gradients.

1. Every task joins one world (``comm.rpc_world``); workers talk to each ps over
   ``comm.messages``. On a ps task, creating the strategy serves its shards until every worker
   is done, then ends the process with exit code 0: the rest of the script is for workers.
2. Scope: each parameter is cut along dim 0 by the ``variable_partitioner`` and its shards are
   placed on the ps tasks, balanced by bytes (``partitioners.plan_shards``); the chief's values
   create them, the others pull them (a coordinating chief's state buffers too: BatchNorm's).
3. ``optimizer.step()`` pushes each ps its shards' gradients and gets back their new values;
   the update runs on the ps (``ps/shard_store.py``). Modes: ``async`` (bounded staleness, a
   staleness policy), ``sync`` (the mean of ``replicas_to_aggregate`` pushes, ``backup_workers``).
4. Each worker trains at its own pace: ``num_replicas_in_sync`` is 1, ``reduce`` and metrics are
   the worker's own; ``experimental_distribute_dataset`` gives each worker all the data, but in
   sync mode cuts a DATA dataset's global batches across the workers (``input.WorkerPart``).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import hashlib
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary
from typing_extensions import override

from stratagem.cluster import ClusterResolver, collective_members, is_coordinated
from stratagem.cluster.roles import describe_jobs
from stratagem.comm.rpc_world import RpcWorld
from stratagem.distribute.capabilities import ChiefCoordination
from stratagem.distribute.extended import StrategyExtended
from stratagem.distribute.machinery import scope_hooks
from stratagem.distribute.machinery.input import (
    DistributedDataset,
    InputContext,
    InputOptions,
    PerWorkerDistributedDataset,
    PerWorkerDistributedDatasetsFromFunction,
    WorkerPart,
)
from stratagem.distribute.machinery.worker_job import WorkerJob
from stratagem.distribute.partitioners import Partitioner, Shard
from stratagem.distribute.ps import chief_reads
from stratagem.distribute.ps.client import IndependentWorker, PsClient
from stratagem.distribute.ps.shard_store import UpdateRule
from stratagem.distribute.ps.task_server import PsTaskServer
from stratagem.distribute.strategy import Strategy

MODES = ("async", "sync")
STALENESS_POLICIES = ("apply", "scale", "drop")


class ParameterServerStrategy(Strategy):
    """``sg.distribute.ParameterServerStrategy(cluster_resolver=None, variable_partitioner=None,
    mode="async", replicas_to_aggregate=None, backup_workers=0, max_staleness=None)``."""

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        variable_partitioner: Partitioner | None = None,
        mode: str = "async",
        replicas_to_aggregate: int | None = None,
        backup_workers: int = 0,
        max_staleness: int | None = None,
        *,
        staleness_policy: str = "apply",
        max_gradient_staleness: int | None = None,
        compression: str | None = None,
        _world: RpcWorld | None = None,
    ) -> None:
        job = WorkerJob.set_up(
            type(self).__name__,
            ("chief", "worker", "ps", "evaluator"),
            cluster_resolver,
            on_gpu=False,
        )
        resolver = job.resolver
        spec = resolver.cluster_spec()
        num_ps = spec.num_tasks("ps") if spec and "ps" in spec.jobs else 0
        if num_ps == 0:
            raise ValueError(
                "ParameterServerStrategy needs ps tasks to hold the parameters; this cluster has "
                f"{describe_jobs(spec) if spec else 'no cluster at all'}. Launch with "
                "`stratagem run -n W --ps K script.py`, or give TF_CONFIG a 'ps' job"
            )
        if variable_partitioner is not None and not callable(variable_partitioner):
            raise TypeError(
                "variable_partitioner must be a partitioner such as "
                "sg.distribute.experimental.partitioners.FixedShardsPartitioner(2); got "
                f"{variable_partitioner!r}"
            )
        workers = collective_members(spec)
        needed = _check_options(
            mode,
            len(workers),
            replicas_to_aggregate,
            backup_workers,
            max_staleness,
            staleness_policy,
            max_gradient_staleness,
            compression,
        )
        rule = UpdateRule(
            mode=mode,
            num_workers=len(workers),
            replicas_to_aggregate=needed,
            max_staleness=max_staleness,
            staleness_policy=staleness_policy,
            max_gradient_staleness=max_gradient_staleness,
            compression=compression,
        )
        if resolver.task_type == "ps":
            PsTaskServer(job=job).join()
            raise SystemExit(0)  # the job is done: the rest of the script is the workers'
        extended = ParameterServerExtended(self, job, variable_partitioner, rule, _world)
        super().__init__(extended)
        self.mode = mode
        self._ps_extended = extended
        self._client = extended.client
        # The chief of a cluster with a chief coordinates (TF2: ClusterCoordinator, fit
        # schedules); without one every worker runs the loop (between-graph, TF1).
        self.coordinated = extended.coordinating

    @property
    def cluster_coordinator(self) -> Any:
        """The one ClusterCoordinator of this strategy, once made (None before)."""
        return self._ps_extended.cluster_coordinator

    @cluster_coordinator.setter
    def cluster_coordinator(self, coordinator: Any) -> None:
        # Kept by the extended, which refreshes the chief's copies through it.
        self._ps_extended.cluster_coordinator = coordinator

    def __repr__(self) -> str:
        e = self._ps_extended
        return (
            f"ParameterServerStrategy(mode={self.mode!r}, workers={e.num_workers}, "
            f"ps={len(self._client.ps_names)}, worker={e.worker_index})"
        )

    def pull(self) -> None:
        """Bring this worker's copies up to the ps's current values (e.g. before evaluating)."""
        self._client.pull()

    def training_finished(self) -> bool:
        """Whether every worker is done (or lost): an evaluator's loop ends on it."""
        return self._client.training_finished()

    def ps_stats(self) -> list[dict[str, Any]]:
        """What each ps applied, dropped and held back so far (for tests and benchmarks)."""
        return self._client.ps_stats()


@dataclasses.dataclass(frozen=True)
class VariableShard:
    """One shard of a ps variable: its shape and the ps that holds it (TF's device string)."""

    shape: tuple[int, ...]
    device: str


class ParameterServerExtended(StrategyExtended, ChiefCoordination):
    """One replica per worker; parameters sharded on the ps tasks, updated there by ``rule``."""

    def __init__(
        self,
        container: Strategy,
        job: WorkerJob,
        partitioner: Partitioner | None,
        rule: UpdateRule,
        world: RpcWorld | None = None,
    ) -> None:
        resolver, timeouts = job.resolver, job.timeouts
        # A coordinator's worker task (``sg.distribute.Server``) has joined the world already
        # and says goodbye to the ps itself when the chief is done.
        serving = world is not None
        self._serving = serving  # a coordinator's worker task: its chief schedules its input
        world = world or RpcWorld(resolver, rendezvous_timeout=timeouts.rendezvous)
        # An evaluator reads the parameters while the workers train; it pushes nothing.
        self._evaluator = resolver.task_type == "evaluator"
        workers = collective_members(resolver.cluster_spec())
        me = (resolver.task_type, resolver.task_id)
        self.worker_index = -1 if self._evaluator else workers.index(me)  # type: ignore[arg-type]
        self.num_workers = len(workers)
        self.client = PsClient(
            world,
            rule,
            partitioner,
            worker_index=self.worker_index,
            chief=resolver.is_chief,
            timeout=timeouts.operation,
        )
        self.world = world
        self.cluster_coordinator: Any = None  # the one ClusterCoordinator, once made
        # A coordinator's worker task: checks, before each push, that the scheduled function
        # that steps was not cancelled (``CoordinatorSeam.guard_steps``).
        self.step_guard: Callable[[], None] = lambda: None
        # Parameter -> the (module, name) places it was registered at in scope, until adopted.
        self._registrations: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # A coordinating chief's buffer -> the (module, name) places it was registered at.
        self._buffer_places: WeakIdKeyDictionary = WeakIdKeyDictionary()
        spec = resolver.cluster_spec()
        self._coordinating = resolver.task_type == "chief" and is_coordinated(spec)
        if not serving:
            # A coordinating chief does not wait for its workers at exit: they stop serving
            # only when it has ended (or said goodbye).
            atexit.register(functools.partial(self.client.finish, wait=not self.coordinating))
        else:
            # A coordinator's worker reads the W workers' input, the chief none: its input
            # pipeline is its index among the worker tasks (the ps still know it by its place
            # among chief and workers, the client's index).
            self.worker_index = sorted(spec.task_indices("worker")).index(resolver.task_id or 0)
            self.num_workers = spec.num_tasks("worker")
        super().__init__(
            container,
            [job.device],
            comm=IndependentWorker(resolver.is_chief, world.describe(world.rank)),
            cluster_resolver=resolver,
        )

    @property
    @override
    def coordinating(self) -> bool:
        """Whether this is the chief of a cluster with a chief: TF2's coordinator, which
        schedules functions (``ClusterCoordinator``, a coordinated ``fit``)."""
        return self._coordinating

    @property
    @override
    def coordinator_seam(self) -> CoordinatorSeam:
        """What TF2's coordinator (the chief, its worker tasks) uses of this strategy."""
        return CoordinatorSeam(self)

    @property
    @override
    def parameter_devices(self) -> tuple[str, ...]:
        return tuple(self.client.ps_names)

    @override
    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "mode": self.client.rule.mode}

    # Scope: shards on the ps ------------------------------------------------------------

    @override
    def capture_variable(self, param: torch.nn.Parameter) -> None:
        # TF places every variable created in the scope on a ps, a layer's or not: a parameter
        # on its own (a step counter, torch.nn.Parameter(..., requires_grad=False)) is one too.
        self._keep_variable(param)

    @override
    def capture_parameter(
        self, module: torch.nn.Module, name: str, param: torch.nn.Parameter
    ) -> torch.nn.Parameter | None:
        placed = super().capture_parameter(module, name, param)
        registered = param if placed is None else placed
        self._registrations.setdefault(registered, []).append((weakref.ref(module), name))
        if self.coordinating:
            # The workers train the ps's values: the chief's module reads them (chief_reads).
            chief_reads.watch(module, self.refresh_chief_copies)
        return placed

    def refresh_chief_copies(self) -> None:
        """The coordinating chief, before a module of its scope is read: its copies of the
        variables as the ps has them now (a no-op until a coordinator ran a function)."""
        if self.cluster_coordinator is not None:
            self.cluster_coordinator.refresh()

    @override
    def capture_buffer(
        self, module: torch.nn.Module, name: str, buffer: torch.Tensor
    ) -> torch.Tensor | None:
        placed = super().capture_buffer(module, name, buffer)
        if self.coordinating:
            # Whether it is state (persistent) is known only once registered: see adopt.
            kept = buffer if placed is None else placed
            self._buffer_places.setdefault(kept, []).append((weakref.ref(module), name))
            chief_reads.watch(module, self.refresh_chief_copies)
        return placed

    @override
    def adopt(self, tensors: list[tuple[torch.Tensor, bool]]) -> None:
        params = [t for t, is_param in tensors if is_param and self._still_registered(t)]
        # TF2's coordinator keeps every variable on the ps, a layer's non-trainable ones too
        # (BatchNorm's moving statistics): a coordinating chief's state buffers are variables
        # that do not train, which the workers' functions update there (worker.py).
        state = [t for t, is_param in tensors if not is_param and self._is_state_buffer(t)]
        if params or state:
            self.client.create(params + state)

    def _is_state_buffer(self, buffer: torch.Tensor) -> bool:
        """Whether a coordinating chief's module still holds ``buffer`` as state: persistent
        (in its ``state_dict``, as a TF variable is in a checkpoint) and a number that an
        update adds to (not a bool mask). Other buffers stay each process's own."""
        places = self._buffer_places.pop(buffer, None)
        if places is None or buffer.dtype == torch.bool or buffer.is_complex():
            return False
        return any(
            (module := ref()) is not None
            and module._buffers.get(name) is buffer
            and name not in module._non_persistent_buffers_set
            for ref, name in places
        )

    def _still_registered(self, param: torch.Tensor) -> bool:
        """Whether a module still holds ``param`` where it was registered. Tying replaces a
        parameter made in scope (GPT-2's own ``lm_head.weight``, before ``tie_weights`` makes
        it ``wte.weight``): a variable on the ps for it would be held, and pulled, for nothing.
        (A worker's scope captures the same parameters as every other's: they agree on it.)"""
        places = self._registrations.pop(param, None)
        if places is None:
            return True  # captured without a module registration: kept
        return any(
            (module := ref()) is not None and module._parameters.get(name) is param
            for ref, name in places
        )

    def bind_variable(
        self, shards: list[Shard], shape: tuple[int, ...], dtype: torch.dtype, trainable: bool
    ) -> tuple[torch.Tensor, bool]:
        """A coordinator's worker: its copy of the chief's variable in ``shards``, owned by
        this strategy (its optimizer steps push to the ps); and whether it is new."""
        p, new = self.client.variable(shards, shape, dtype, trainable)
        if new:
            scope_hooks.claim(p, self._container)
        return p, new

    def variable_shards(self, v: torch.Tensor) -> list[VariableShard]:
        """The shards of ps variable ``v`` in order, each with its ``shape`` and the ``device``
        of the ps holding it, as TF's ``ShardedVariable.variables`` (``layer.weights``) shows
        them: ``/job:ps/replica:0/task:I/device:CPU:0``. One shard for an uncut variable."""
        shards = self.client.shards_of(v)
        if shards is None:
            raise ValueError(
                f"this tensor of shape {tuple(v.shape)} is not a variable on the ps: build it in "
                "ParameterServerStrategy.scope() (its scope's end places it)"
            )
        rest = tuple(v.shape[1:])
        tasks = [name.rpartition(":")[2] for name in self.client.ps_names]  # "ps:1" -> "1"
        return [
            VariableShard(
                shape=(s.rows, *rest) if v.dim() else (),
                device=f"/job:ps/replica:0/task:{tasks[s.ps]}/device:CPU:0",
            )
            for s in shards
        ]

    @override
    def check_optimizer(
        self, optimizer: torch.optim.Optimizer, num_params: int, num_outside: int
    ) -> None:
        if num_outside:
            raise RuntimeError(
                f"this optimizer updates {num_outside} parameters created outside "
                "ParameterServerStrategy.scope(); their updates would stay on this worker. "
                "Create the whole model inside strategy.scope()"
            )

    # optimizer.step(): push gradients, pull values ------------------------------------

    @override
    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._evaluator:
            raise RuntimeError(
                "an evaluator task reads the parameters (strategy.pull()) and evaluates; it "
                "does not train: optimizer.step() is for the chief and the workers"
            )
        self.step_guard()
        self.client.push(optimizer)

    # Checkpoints: the chief's own write brings the ps's values and optimizer state home -----

    @override
    def before_checkpoint_write(self, objects: list[object]) -> None:
        if self.should_checkpoint:
            self.client.bring_home(objects)

    @override
    def after_checkpoint_restore(self, objects: list[object]) -> None:
        self.client.send_restored(objects)

    # Input: each worker its own pipeline --------------------------------------------------

    @override
    def distribute_dataset(
        self, dataset: Iterable[Any], options: InputOptions | None = None
    ) -> Iterable[Any]:
        if self.coordinating:
            # TF2's coordinator: built on every worker by create_per_worker_dataset, not here.
            return PerWorkerDistributedDataset(dataset, options)
        if self.client.rule.mode == "sync" and not (self._evaluator or self._serving):
            # Between-graph sync: one global batch per update, a DATA dataset cut across the
            # workers; its position (the chief's, saved with the ps's values after the same
            # update) restores on any number of workers.
            part = WorkerPart(self.worker_index, self.num_workers, self._job_seed())
            return DistributedDataset(self, dataset, options, worker_part=part)
        return super().distribute_dataset(dataset, options)

    def _job_seed(self) -> int:
        """A seed every worker of this job derives alike (for unseeded shuffles), from the
        job's secret, or its cluster where it runs without one."""
        secret = self.world.secret or repr(self.cluster_resolver.cluster_spec().as_dict()).encode()
        digest = hashlib.sha256(b"stratagem input seed " + secret).digest()
        return int.from_bytes(digest[:8], "big") >> 2

    @override
    def distribute_datasets_from_function(
        self,
        dataset_fn: Callable[[InputContext], Iterable[Any]],
        options: InputOptions | None = None,
    ) -> Iterable[Any]:
        if self.coordinating:
            return PerWorkerDistributedDatasetsFromFunction(dataset_fn, options)
        return super().distribute_datasets_from_function(dataset_fn, options)

    @override
    def _input_context(self) -> InputContext:
        # Each worker its own pipeline, of one replica: its index among the W workers.
        return InputContext(
            num_input_pipelines=self.num_workers,
            input_pipeline_id=self.worker_index,
            num_replicas_in_sync=1,
        )


class CoordinatorSeam:
    """What TF2's coordinator uses of a ``ParameterServerStrategy``, and nothing else: on the
    chief (``ClusterCoordinator``) and on a worker task serving it (``sg.distribute.Server``).
    ``strategy.extended.coordinator_seam``; a worker task's strategy is made by
    ``CoordinatorSeam.for_worker_task``."""

    def __init__(self, extended: ParameterServerExtended) -> None:
        self._extended = extended
        self._client = extended.client

    @staticmethod
    def for_worker_task(resolver: ClusterResolver, world: RpcWorld) -> CoordinatorSeam:
        """A coordinator's worker task's own strategy (in the world its server joined), whose
        functions compute on copies of the chief's variables."""
        strategy = ParameterServerStrategy(resolver, _world=world)
        extended = strategy.extended
        assert isinstance(extended, ParameterServerExtended)
        return extended.coordinator_seam

    @property
    def strategy(self) -> Strategy:
        return self._extended.strategy

    @property
    def world(self) -> RpcWorld:
        """Every task of the job: addresses, liveness, incarnations, the job's secret."""
        return self._extended.world

    @property
    def worker_index(self) -> int:
        """This worker's index among the W worker tasks (its input pipeline)."""
        return self._extended.worker_index

    @property
    def compression(self) -> str | None:
        return self._client.rule.compression

    def use_compression(self, compression: str | None) -> None:
        """A worker task: push and pull as the chief's strategy does (told in its hello)."""
        if compression not in (None, "bf16"):
            raise ValueError(f"compression must be None or 'bf16'; the chief sent {compression!r}")
        self._client.rule = dataclasses.replace(self._client.rule, compression=compression)

    def shards_of(self, tensor: torch.Tensor) -> list[Shard] | None:
        """Where a variable's rows live on the ps (None for a tensor that is not one)."""
        return self._client.shards_of(tensor)

    def bind_variable(
        self, shards: list[Shard], shape: tuple[int, ...], dtype: torch.dtype, trainable: bool
    ) -> torch.Tensor:
        """A worker task: its one copy of the chief's variable in ``shards``."""
        return self._extended.bind_variable(shards, shape, dtype, trainable)[0]

    def guard_steps(self, check: Callable[[], None]) -> None:
        """A worker task: ``check()`` runs before each optimizer step's push (it raises to
        stop a scheduled function the chief cancelled)."""
        self._extended.step_guard = check

    def assign_add(self, changes: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """A worker task: add these ``(variable, change)`` to the variables on the ps."""
        self._client.assign_add(changes)

    def pull(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """These copies (all by default) as the ps has them now."""
        self._client.pull(params)

    @property
    def writes(self) -> int:
        """The chief: how many of its requests to the ps changed variables there (its own
        steps, restores, creations), counted once each ended."""
        return self._client.writes

    def begin_call(self, call: int) -> None:
        """A worker task: the chief's call number ``call`` starts (``PsClient.begin_call``)."""
        self._client.begin_call(call)

    def forget_calls(self) -> None:
        """A worker task: a chief said hello; its calls are numbered anew."""
        self._client.forget_calls()

    def pull_unless_fresh(self, params: list[torch.Tensor], since: int) -> None:
        """A worker task: pull those of ``params`` whose copy here was not written from the
        ps during call ``since`` or later, or has changed here since."""
        stale = [p for p in params if not self._client.fresh_since(p, since)]
        if stale:
            self._client.pull(stale)

    def finish(self) -> None:
        """A worker task, when the chief is done: tell each ps, hang up, leave."""
        self._client.finish()


def _check_options(
    mode: str,
    num_workers: int,
    replicas_to_aggregate: int | None,
    backup_workers: int,
    max_staleness: int | None,
    staleness_policy: str,
    max_gradient_staleness: int | None,
    compression: str | None,
) -> int:
    """Validate the options against the cluster; the replicas aggregated per sync step."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
    for what, value in (
        ("backup_workers", backup_workers),
        ("max_staleness", max_staleness),
        ("max_gradient_staleness", max_gradient_staleness),
    ):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{what} must be an int; got {value!r}")
        if value is not None and value < 0:
            raise ValueError(f"{what} must be >= 0; got {value}")
    if staleness_policy not in STALENESS_POLICIES:
        raise ValueError(
            f"staleness_policy must be one of {STALENESS_POLICIES}; got {staleness_policy!r}"
        )
    if staleness_policy == "drop" and max_gradient_staleness is None:
        raise ValueError(
            "staleness_policy='drop' needs max_gradient_staleness: gradients computed on "
            "parameters more than that many updates old are dropped"
        )
    if compression not in (None, "bf16"):
        raise ValueError(f"compression must be None or 'bf16'; got {compression!r}")
    if mode == "async":
        if backup_workers or replicas_to_aggregate is not None:
            raise ValueError(
                "backup_workers and replicas_to_aggregate are for mode='sync'; async mode "
                "applies every push on its own"
            )
        return 1
    if max_staleness is not None or staleness_policy != "apply":
        raise ValueError("max_staleness and staleness_policy are for mode='async'")
    if backup_workers >= num_workers:
        raise ValueError(
            f"backup_workers={backup_workers} leaves no worker to aggregate: the cluster has "
            f"{num_workers} workers (chief included); each step waits for workers - backups"
        )
    needed = replicas_to_aggregate
    if needed is None:
        needed = num_workers - backup_workers
    if isinstance(needed, bool) or not isinstance(needed, int) or needed < 1:
        raise ValueError(f"replicas_to_aggregate must be a positive int; got {needed!r}")
    if needed > num_workers:
        raise ValueError(
            f"replicas_to_aggregate={needed} is more than the {num_workers} workers (chief "
            "included) of the cluster: no step could ever complete"
        )
    return needed


__all__ = ["CoordinatorSeam", "ParameterServerStrategy"]
