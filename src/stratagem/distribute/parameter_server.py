"""ParameterServerStrategy: parameters held by ps tasks; workers pull them and push gradients.

1. The cluster has ps tasks beside the chief and workers (``stratagem run -n W --ps K``). Every
   task joins one RPC world (``comm.rpc_world``). On a ps task, creating the strategy (or
   ``sg.distribute.Server(...).join()``) serves the shards until every worker is done, then
   ends the process with exit code 0: the rest of the script is for workers.
2. Scope: each parameter created inside is cut into shards along its first dimension by the
   ``variable_partitioner`` (whole without one), and the shards are placed on the ps tasks,
   balanced by bytes (``partitioners.plan_shards``: every worker computes the same plan). The
   chief's initial values create the shards; the other workers pull them, so all start equal.
   Each worker keeps a local copy of every parameter to compute on; buffers stay local.
3. ``optimizer.step()``: the worker pushes each ps the gradients of its shards (with the
   optimizer's class and current hyperparameters) and gets back the shards' new values; the
   update itself runs on the ps that owns the shard, with the optimizer state there
   (``ps_server``). The local step then finds no gradient and does nothing. How pushes become
   updates is the mode: ``async`` (each push applied at once; bounded staleness and a staleness
   policy), ``sync`` (the mean of ``replicas_to_aggregate`` pushes per step), and sync with
   ``backup_workers`` (n + b workers, the first n pushes of a step win, late ones are dropped).
4. Each worker trains on its own batches at its own pace: ``num_replicas_in_sync`` is 1 per
   worker, and ``strategy.reduce`` and metrics are this worker's.
   ``experimental_distribute_dataset`` gives every worker all of the dataset (each its own pass
   and shuffle, so that ``evaluate`` on any worker sees all of its data);
   ``distribute_datasets_from_function`` gets an ``InputContext`` with the worker's index among
   the W workers, to shard by it.
"""

from __future__ import annotations

import atexit
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed.rpc as rpc

from stratagem.cluster import ClusterResolver, collective_members, resolve_cluster
from stratagem.cluster.roles import describe_jobs
from stratagem.comm import LocalCommunicator, set_current_communicator
from stratagem.comm.process_group import Timeouts
from stratagem.comm.rpc_world import RpcWorld, rpc_name
from stratagem.comm.runtime import RemoteStateHooks, add_remote_state_hooks
from stratagem.distribute import ps_server
from stratagem.distribute.devices import LogicalDevice
from stratagem.distribute.input import DistributedDatasetFromFunction, InputContext, InputOptions
from stratagem.distribute.partitioners import Partitioner, Shard, plan_shards
from stratagem.distribute.strategy import Strategy, StrategyExtended
from stratagem.errors import PeerLostError

MODES = ("async", "sync")
STALENESS_POLICIES = ("apply", "scale", "drop")


class Server:
    """``sg.distribute.Server(cluster_resolver=None)``: this ps task, serving its shards.

    ``join()`` blocks until every worker has finished, then returns (TF's ``server.join()``
    never returns; here the ps can exit cleanly when the job is done).
    """

    def __init__(self, cluster_resolver: ClusterResolver | None = None) -> None:
        resolver = cluster_resolver if cluster_resolver is not None else resolve_cluster()
        if resolver.task_type != "ps":
            raise ValueError(
                f"sg.distribute.Server serves a ps task; this process is {resolver.describe()}"
            )
        timeouts = Timeouts.from_env()
        # Creating the first torch optimizer imports torch._dynamo (seconds); do it now, while
        # the workers start, rather than inside the first push they wait on.
        torch.optim.SGD([torch.zeros(1, requires_grad=True)])
        num_workers = len(collective_members(resolver.cluster_spec()))
        self.store = ps_server.serve(rpc_name("ps", resolver.task_id or 0), num_workers)
        self._world = RpcWorld(
            resolver, rendezvous_timeout=timeouts.rendezvous, rpc_timeout=timeouts.operation
        )

    def join(self) -> None:
        """Serve until every worker is done or lost, then leave the RPC world."""
        workers = self._world.ranks("chief") + self._world.ranks("worker")
        index = {rank: i for i, rank in enumerate(workers)}  # the strategy's worker index

        def done(rank: int) -> bool:
            if self.store.has_left(index[rank]):
                return True
            if not self._world.has_ended(rank):
                return False
            print(
                f"{self._world.describe(rank)} ended without saying it was done (lost); "
                "training goes on without it",
                file=sys.stderr,
                flush=True,
            )
            self.store.leave(index[rank], lost=True)
            return True

        self._world.wait_for(workers, done, threading.Event())
        # Everyone alive is done: all leave together, unless a lost worker would block that.
        self._world.shutdown(graceful=not self.store.lost_any)


class _IndependentWorker(LocalCommunicator):
    """A worker's communicator: no collectives (workers meet only at the ps), but the job's
    chief rule, so that checkpoints and summaries are written by the chief alone."""

    def __init__(self, chief: bool, name: str) -> None:
        super().__init__()
        self._chief = chief
        self._name = name

    @property
    def is_chief(self) -> bool:
        return self._chief

    def peer_name(self, rank: int) -> str:
        return self._name


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
    ) -> None:
        resolver = cluster_resolver if cluster_resolver is not None else resolve_cluster()
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
        self.mode = mode
        self._rule = ps_server.UpdateRule(
            mode=mode,
            num_workers=len(workers),
            replicas_to_aggregate=needed,
            max_staleness=max_staleness,
            staleness_policy=staleness_policy,
            max_gradient_staleness=max_gradient_staleness,
            compression=compression,
        )
        self._partitioner = variable_partitioner
        self._num_ps = num_ps
        if resolver.task_type == "ps":
            Server(resolver).join()
            raise SystemExit(0)  # the job is done: the rest of the script is the workers'
        timeouts = Timeouts.from_env()
        self._world = RpcWorld(
            resolver, rendezvous_timeout=timeouts.rendezvous, rpc_timeout=timeouts.operation
        )
        atexit.register(self._finish)
        # An evaluator reads the parameters while the workers train; it pushes nothing.
        self._evaluator = resolver.task_type == "evaluator"
        me = (resolver.task_type, resolver.task_id)
        self._worker_index = -1 if self._evaluator else workers.index(me)  # type: ignore[arg-type]
        self._num_workers = len(workers)
        self._ps_names = self._world.names("ps")
        comm = _IndependentWorker(resolver.is_chief, self._world.describe(self._world.rank))
        set_current_communicator(comm)
        add_remote_state_hooks(
            RemoteStateHooks(self._before_checkpoint_write, self._after_checkpoint_restore)
        )
        super().__init__(
            [LogicalDevice("cpu:0", torch.device("cpu"))],
            comm=comm,
            cluster_resolver=resolver,
        )
        self._variables: list[torch.Tensor] = []  # in creation order: the variable ids
        self._shards: dict[int, list[Shard]] = {}  # id(param) -> its shards
        self._versions: dict[tuple[int, tuple], int] = {}  # (ps, group keys) -> version pulled
        self._restores = 0  # checkpoints of ours restored: every worker restores the same
        self._lock = threading.Lock()

    @property
    def extended(self) -> StrategyExtended:
        chief = self._comm.is_chief
        return StrategyExtended(("cpu:0",), tuple(self._ps_names), chief, chief)

    def __repr__(self) -> str:
        return (
            f"ParameterServerStrategy(mode={self.mode!r}, workers={self._num_workers}, "
            f"ps={self._num_ps}, worker={self._worker_index})"
        )

    # Scope: shards on the ps ------------------------------------------------------------

    def _adopt(self, tensors: list[tuple[torch.Tensor, bool]]) -> None:
        params = [t for t, is_param in tensors if is_param]
        if not params:
            return
        first = len(self._variables)
        plan = plan_shards(
            [tuple(p.shape) for p in params],
            [p.dtype for p in params],
            self._partitioner,
            self._num_ps,
        )
        per_ps: list[dict[ps_server.ShardKey, torch.Tensor]] = [{} for _ in self._ps_names]
        for offset, (p, shards) in enumerate(zip(params, plan)):
            shards = [
                Shard(first + offset, s.index, s.start, s.rows, s.nbytes, s.ps) for s in shards
            ]
            self._variables.append(p)
            self._shards[id(p)] = shards
            for s in shards:
                per_ps[s.ps][(s.variable, s.index)] = _rows(p, s).detach().clone()
        if self._comm.is_chief:
            self._ask(
                ps_server.rpc_create,
                "the creation of the variables",
                lambda i: (self._rule, per_ps[i]),
            )
        else:
            fetched = self._ask(
                ps_server.rpc_fetch, "a fetch of the initial values", lambda i: (list(per_ps[i]),)
            )
            for i, values in enumerate(fetched):
                self._write(list(per_ps[i]), values)

    def _write(self, keys: list[ps_server.ShardKey], values: list[torch.Tensor]) -> None:
        """Copy shard values pulled from a ps into the local parameters."""
        with torch.no_grad():
            for (variable, index), value in zip(keys, values):
                p = self._variables[variable]
                _rows(p, self._shards[id(p)][index]).copy_(value)

    def _check_optimizer(
        self, optimizer: torch.optim.Optimizer, num_params: int, num_outside: int
    ) -> None:
        if num_outside:
            raise RuntimeError(
                f"this optimizer updates {num_outside} parameters created outside "
                "ParameterServerStrategy.scope(); their updates would stay on this worker. "
                "Create the whole model inside strategy.scope()"
            )

    # optimizer.step(): push gradients, pull values ------------------------------------

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._evaluator:
            raise RuntimeError(
                "an evaluator task reads the parameters (strategy.pull()) and evaluates; it "
                "does not train: optimizer.step() is for the chief and the workers"
            )
        cls = type(optimizer)
        optimizer_class = (cls.__module__, cls.__qualname__)
        # ps -> (the keys of its shards here, per param group (hyperparameters, keys), grads)
        requests: dict[int, tuple[tuple, list[tuple[dict, list]], list[torch.Tensor]]] = {}
        for ps in range(self._num_ps):
            groups, grads = [], []
            for group in optimizer.param_groups:
                hyper = {k: v for k, v in group.items() if k != "params"}
                keys = []
                for p in group["params"]:
                    for s in self._shards.get(id(p), ()):
                        if s.ps != ps:
                            continue
                        keys.append((s.variable, s.index))
                        grads.append(self._wire(_rows(p.grad, s) if p.grad is not None
                                                else torch.zeros_like(_rows(p, s))))  # fmt: skip
                groups.append((hyper, keys))
            if any(keys for _, keys in groups):
                group_keys = tuple(k for _, keys in groups for k in keys)
                requests[ps] = (group_keys, groups, grads)
        answers = self._ask(
            ps_server.rpc_push,
            "a push",
            lambda i: (
                self._worker_index,
                optimizer_class,
                requests[i][1],
                self._versions.get((i, requests[i][0]), 0),
                requests[i][2],
            ),
            ps=list(requests),  # only those that own some of the optimizer's shards
        )
        for (ps, (keys, _, _)), (values, version) in zip(requests.items(), answers):
            self._versions[(ps, keys)] = version
            self._write(list(keys), values)
        # The update happened on the ps: the local step must find nothing to do.
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) in self._shards:
                    p.grad = None

    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.to(torch.bfloat16) if self._rule.compression == "bf16" else t.contiguous()

    # Reading the parameters (evaluation, checkpoints) ------------------------------------

    def pull(self) -> None:
        """Bring this worker's copies up to the ps's current values (e.g. before evaluating)."""
        keys = self._keys_per_ps(self._variables)
        pulled = self._ask(ps_server.rpc_read, "a pull of the parameters", lambda i: (keys[i],))
        for mine, values in zip(keys, pulled):
            self._write(mine, values)

    def _keys_per_ps(self, params: Iterable[torch.Tensor]) -> list[list[ps_server.ShardKey]]:
        """The keys of these parameters' shards, ps by ps."""
        keys: list[list[ps_server.ShardKey]] = [[] for _ in self._ps_names]
        for p in params:
            for s in self._shards.get(id(p), ()):
                keys[s.ps].append((s.variable, s.index))
        return keys

    # Checkpoints: the chief's own write brings the ps's values and optimizer state home -----

    def _ours(self, objects: list[object]) -> tuple[bool, list[torch.optim.Optimizer]]:
        """Whether a module of ours is among ``objects``, and which optimizers of ours are."""
        modules = any(
            isinstance(o, torch.nn.Module) and any(id(p) in self._shards for p in o.parameters())
            for o in objects
        )
        optimizers = [
            o
            for o in objects
            if isinstance(o, torch.optim.Optimizer)
            and any(id(p) in self._shards for g in o.param_groups for p in g["params"])
        ]
        return modules, optimizers

    def _before_checkpoint_write(self, objects: list[object]) -> None:
        modules, optimizers = self._ours(objects)
        if modules or optimizers:
            self.pull()
        for optimizer in optimizers:
            keys = self._keys_per_ps(_params(optimizer))
            held: dict = {}
            for answer in self._ask(
                ps_server.rpc_optimizer_state,
                "a request for its optimizer state",
                lambda i, keys=keys: (keys[i],),
            ):
                held.update(answer)
            for p in _params(optimizer):
                shards = self._shards.get(id(p), [])
                states = [held.get((s.variable, s.index)) for s in shards]
                if shards and all(states):
                    optimizer.state[p] = _join_state(p, shards, states)

    def _after_checkpoint_restore(self, objects: list[object]) -> None:
        modules, optimizers = self._ours(objects)
        if not (modules or optimizers):
            return
        self._restores += 1
        if not self._comm.is_chief:
            # Every worker restored the same file; the chief sends it to the ps. Wait for that,
            # so that no gradient of the restored values lands on the ps's older ones.
            self._ask(
                ps_server.rpc_loaded,
                "the chief's restored values",
                lambda i: (self._restores,),
                timeout=0,  # no timeout: the chief may still be reading the checkpoint
            )
            self.pull()
            return
        values: list[dict] = [{} for _ in self._ps_names]
        states: list[dict] = [{} for _ in self._ps_names]
        if modules:
            for p in self._variables:
                for s in self._shards[id(p)]:
                    values[s.ps][(s.variable, s.index)] = _rows(p, s).detach().clone()
        for optimizer in optimizers:
            for p in _params(optimizer):
                state = optimizer.state.get(p)
                for s in self._shards.get(id(p), ()) if state else ():
                    states[s.ps][(s.variable, s.index)] = _split_state(p, s, state)
        self._ask(ps_server.rpc_load, "the restored values", lambda i: (values[i], states[i]))

    def training_finished(self) -> bool:
        """Whether every worker is done (or lost): an evaluator's loop ends on it."""
        return all(self._ask(ps_server.rpc_workers_done, "whether the workers are done"))

    def ps_stats(self) -> list[dict[str, int]]:
        """What each ps applied, dropped and held back so far (for tests and benchmarks)."""
        return self._ask(ps_server.rpc_stats, "a request for its statistics")

    def _finish(self) -> None:
        """At exit: tell every ps this worker is done, then leave the RPC world."""
        graceful = False
        try:
            lost = self._ask(
                ps_server.rpc_leave,
                "this worker's goodbye",
                lambda i: (self._worker_index,),
                timeout=0,  # no timeout: the answer comes when the slowest worker is done
            )
            graceful = not any(lost)
        except PeerLostError:
            pass  # a ps that is gone needs no goodbye; the error that mattered came earlier
        finally:
            self._world.shutdown(graceful=graceful)

    def _ask(
        self,
        fn: Callable[..., Any],
        what: str,
        args: Callable[[int], tuple] = lambda i: (),
        *,
        ps: list[int] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Call ``fn`` with ``args(i)`` on ps i, for every ps (or those in ``ps``) at once;
        their answers, in that order. A ps that is gone is named instead of a bare RPC error."""
        targets = list(range(self._num_ps)) if ps is None else ps
        extra = {} if timeout is None else {"timeout": timeout}
        names = [self._ps_names[i] for i in targets]
        futures = [rpc.rpc_async(n, fn, args=args(i), **extra) for n, i in zip(names, targets)]
        answers = []
        for name, future in zip(names, futures):
            try:
                answers.append(future.wait())
            except RuntimeError as exc:
                rank = self._world.members.index(("ps", int(name.split(":")[1])))
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
                raise PeerLostError(
                    f"{self._world.describe(rank)} did not answer {what}: {first}. A ps that "
                    "ends stops the job; with `stratagem run --max-restarts R` it restarts from "
                    "the last checkpoint"
                ) from None
        return answers

    # Input: each worker its own pipeline --------------------------------------------------

    def distribute_datasets_from_function(
        self,
        dataset_fn: Callable[[InputContext], Iterable[Any]],
        options: InputOptions | None = None,
    ) -> DistributedDatasetFromFunction:
        ctx = InputContext(
            num_input_pipelines=self._num_workers,
            input_pipeline_id=self._worker_index,
            num_replicas_in_sync=1,
        )
        return DistributedDatasetFromFunction(self, lambda _: dataset_fn(ctx), options)


def _rows(t: torch.Tensor, s: Shard) -> torch.Tensor:
    return t if t.dim() == 0 else t.narrow(0, s.start, s.rows)


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _per_row(value: Any, p: torch.Tensor) -> bool:
    """Whether a piece of optimizer state has one row per row of its parameter (cut with it)."""
    return (
        isinstance(value, torch.Tensor)
        and value.dim() > 0
        and p.dim() > 0
        and value.shape[0] == p.shape[0]
    )


def _split_state(p: torch.Tensor, s: Shard, state: dict[str, Any]) -> dict[str, Any]:
    """A parameter's optimizer state as its shard ``s`` holds it (scalars such as ``step``
    whole, per-row tensors such as momentum cut like the parameter)."""
    return {n: _rows(v, s).clone() if _per_row(v, p) else v for n, v in state.items()}


def _join_state(p: torch.Tensor, shards: list[Shard], states: list[dict]) -> dict[str, Any]:
    """The inverse of ``_split_state``: the shards' states as the whole parameter's."""
    joined = {}
    for name, first in states[0].items():
        pieces = [st[name] for st in states]
        if (
            isinstance(first, torch.Tensor)
            and p.dim() > 0
            and first.dim() > 0
            and ([t.shape[0] for t in pieces] == [s.rows for s in shards])
        ):
            joined[name] = torch.cat(pieces)
        else:
            joined[name] = first
    return joined


__all__ = ["ParameterServerStrategy", "Server"]
