"""A worker's side of the parameter servers: its shards' plan, and every call it makes to a ps.

``PsClient`` holds this worker's view of the variables (the local copies it computes on and how
each is cut into shards on which ps), and talks to the ps tasks over ``comm.messages`` (one
connection to each ps, asking for the methods of ``shard_store.methods``): create or fetch the
initial values, push gradients and take back new values, pull, move optimizer state for
checkpoints, and say goodbye at exit. ``IndependentWorker`` is a
worker's communicator: workers never meet each other, only the ps.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from stratagem.comm import LocalCommunicator
from stratagem.comm.messages import Connection
from stratagem.comm.rpc_world import RpcWorld
from stratagem.distribute.partitioners import Partitioner, Shard, plan_shards
from stratagem.distribute.ps import shard_store
from stratagem.errors import CollectiveTimeoutError, PeerLostError


class IndependentWorker(LocalCommunicator):
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


class PsClient:
    """This worker's variables on the ps tasks of ``world``, updated by ``rule``."""

    def __init__(
        self,
        world: RpcWorld,
        rule: shard_store.UpdateRule,
        partitioner: Partitioner | None,
        *,
        worker_index: int,
        chief: bool,
        timeout: float,
    ) -> None:
        self._world = world
        self.rule = rule
        self._partitioner = partitioner
        self._worker_index = worker_index
        self._chief = chief
        self._ps_names = world.names("ps")
        self._variables: dict[int, torch.Tensor] = {}  # variable id -> this worker's copy
        self._shards: dict[int, list[Shard]] = {}  # id(param) -> its shards
        self._versions: dict[tuple[int, tuple], int] = {}  # (ps, group keys) -> version pulled
        self._restores = 0  # checkpoints of ours restored: every worker restores the same
        # Requests of this client that changed the ps (everything but reads), once answered:
        # a coordinating chief's own writes, which a function scheduled after them must see.
        self.writes = 0
        self._writes_lock = threading.Lock()
        self.pulls = 0  # pulls asked for (a coordinator's worker skips those it need not make)
        # A coordinator's worker task: the call during which each shard's copy here was last
        # written from the ps (a pull, or a push's answer), and each variable's version after
        # that write. The chief's calls are numbered (``begin_call``); a copy written during
        # call n holds the ps's values as of some time after call n was sent.
        self._call = 0
        self._written_in: dict[shard_store.ShardKey, int] = {}
        self._version_after: dict[int, int] = {}  # variable id -> its version then
        self._ps_ranks = world.ranks("ps")
        self._connections: list[Connection] = []
        try:
            for rank in self._ps_ranks:
                self._connections.append(
                    Connection(
                        world.address(rank),
                        me=world.name,
                        peer=world.describe(rank),
                        secret=world.secret,
                        timeout=timeout,
                    )
                )
        except BaseException:
            self._close()
            raise

    @property
    def ps_names(self) -> list[str]:
        return list(self._ps_names)

    # ------------------------------------------------------------------ creation

    def create(self, params: list[torch.Tensor]) -> None:
        """New variables: shard them; the chief's values create the shards, the other workers
        fetch them, so all start equal. Each call is one creation (a model built in a scope; a
        script may build several, in the same order on every worker), named on the ps by its
        first variable id."""
        first = max(self._variables, default=-1) + 1
        plan = plan_shards(
            [tuple(p.shape) for p in params],
            [p.dtype for p in params],
            self._partitioner,
            len(self._ps_names),
        )
        per_ps: list[dict[shard_store.ShardKey, torch.Tensor]] = [{} for _ in self._ps_names]
        for offset, (p, shards) in enumerate(zip(params, plan)):
            shards = [
                Shard(first + offset, s.index, s.start, s.rows, s.nbytes, s.ps) for s in shards
            ]
            self._variables[first + offset] = p
            self._shards[id(p)] = shards
            for s in shards:
                per_ps[s.ps][(s.variable, s.index)] = _rows(p, s).detach().clone()
        if self._chief:
            rule = dataclasses.asdict(self.rule)
            self._ask(
                "create",
                "the creation of the variables",
                lambda i: [rule, first, shard_store.pairs(per_ps[i])],
            )
        else:
            fetched = self._ask(
                "fetch",
                "a fetch of the initial values",
                lambda i: [first, [list(k) for k in per_ps[i]]],
            )
            for i, values in enumerate(fetched):
                self._write(list(per_ps[i]), values)

    def shards_of(self, p: torch.Tensor) -> list[Shard] | None:
        """Where ``p``'s rows live on the ps (None for a tensor that is not a variable)."""
        return self._shards.get(id(p))

    def variable(
        self, shards: list[Shard], shape: tuple[int, ...], dtype: torch.dtype, trainable: bool
    ) -> tuple[torch.Tensor, bool]:
        """This worker's copy of the chief's variable cut into ``shards`` (a coordinator's
        worker: the chief created it); made on first use, then the same tensor every call,
        trainable as the chief's is now (a layer frozen or unfrozen between calls). Returns it
        and whether it is new (its values still to pull)."""
        vid = shards[0].variable
        p = self._variables.get(vid)
        if p is not None:
            if tuple(p.shape) != tuple(shape) or p.dtype != dtype:
                raise ValueError(
                    f"variable {vid} is {tuple(shape)} {dtype} on the chief and "
                    f"{tuple(p.shape)} {p.dtype} on this worker"
                )
            if p.requires_grad != trainable:
                p.requires_grad_(trainable)
            return p, False
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=trainable)
        self._variables[vid] = p
        self._shards[id(p)] = list(shards)
        return p, True

    def _write(self, keys: list[shard_store.ShardKey], values: list[torch.Tensor]) -> None:
        """Copy shard values pulled from a ps into the local parameters (those received
        straight into them, ``_homes``, are there already)."""
        with torch.no_grad():
            for (variable, index), value in zip(keys, values):
                p = self._variables[variable]
                rows = _rows(p, self._shards[id(p)][index])
                if value.data_ptr() == rows.data_ptr() and value.dtype == rows.dtype:
                    # Written by the receive, behind autograd's back: count it as a change.
                    torch.autograd.graph.increment_version(p)
                else:
                    rows.copy_(value)
                self._written_in[(variable, index)] = self._call
                self._version_after[variable] = p._version

    def _homes(self, keys: Sequence[shard_store.ShardKey]) -> list[torch.Tensor]:
        """Where a reply's values for ``keys`` may be received: the parameters' own rows."""
        homes = []
        for variable, index in keys:
            p = self._variables[variable]
            homes.append(_rows(p.detach(), self._shards[id(p)][index]))
        return homes

    # ------------------------------------------------------------------ push and pull

    def push(self, optimizer: torch.optim.Optimizer) -> None:
        """Push each ps the gradients of its shards (with the optimizer's class and current
        hyperparameters); take back the shards' new values. The local step then finds no
        gradient on these parameters and does nothing."""
        cls = type(optimizer)
        optimizer_class = (cls.__module__, cls.__qualname__)
        # ps -> (the keys of its shards here, per param group (hyperparameters, keys), grads)
        requests: dict[int, tuple[tuple, list[tuple[dict, list]], list[torch.Tensor]]] = {}
        for ps in range(len(self._ps_names)):
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
            "push",
            "a push",
            lambda i: [
                self._worker_index,
                list(optimizer_class),
                [[hyper, [list(k) for k in keys]] for hyper, keys in requests[i][1]],
                self._versions.get((i, requests[i][0]), 0),
                requests[i][2],
            ],
            ps=list(requests),  # only those that own some of the optimizer's shards
            into=lambda i: self._homes(requests[i][0]),
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
        bf16 = self.rule.compression == "bf16" and t.is_floating_point()
        return t.to(torch.bfloat16) if bf16 else t.contiguous()

    def assign_add(self, changes: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Add ``(variable, change)``'s changes to the variables on the ps (TF's
        ``assign_add``): a coordinator's worker sends what a function changed of a variable it
        does not train, and concurrent changes from several workers all count."""
        keys: list[list[shard_store.ShardKey]] = [[] for _ in self._ps_names]
        deltas: list[list[torch.Tensor]] = [[] for _ in self._ps_names]
        for p, change in changes:
            # This copy changed here: the next call pulls it (``fresh_since``). Its version
            # cannot tell: BatchNorm's kernel writes its statistics without counting a version,
            # and a copy that moved on from a stale read would add its own history again.
            self._version_after.pop(self._shards[id(p)][0].variable, None)
            for s in self._shards[id(p)]:
                keys[s.ps].append((s.variable, s.index))
                deltas[s.ps].append(_rows(change, s).contiguous())
        self._ask(
            "assign_add",
            "the changes of variables that are not trained",
            lambda i: [[list(k) for k in keys[i]], deltas[i]],
            ps=[i for i, k in enumerate(keys) if k],
        )

    def begin_call(self, call: int) -> None:
        """A coordinator's worker task: the chief's call number ``call`` starts here (the
        numbers grow from call to call)."""
        self._call = max(self._call, call)

    def forget_calls(self) -> None:
        """A chief said hello (a new one numbers its calls from the start): what was written
        during the calls numbered so far no longer counts."""
        self._written_in.clear()
        self._call = 0

    def fresh_since(self, p: torch.Tensor, call: int) -> bool:
        """Whether this copy of ``p`` was written from the ps during call ``call`` or a later
        one (all its shards), and has not changed here since."""
        shards = self._shards.get(id(p))
        if not shards or self._version_after.get(shards[0].variable) != p._version:
            return False
        return all(self._written_in.get((s.variable, s.index), -1) >= call for s in shards)

    def pull(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Bring this worker's copies (or those of ``params``) up to the ps's current values."""
        keys = self._keys_per_ps(self._variables.values() if params is None else params)
        self.pulls += 1
        pulled = self._ask(
            "read",
            "a pull of the parameters",
            lambda i: [[list(k) for k in keys[i]]],
            ps=[i for i, k in enumerate(keys) if k],
            into=lambda i: self._homes(keys[i]),
        )
        keys = [k for k in keys if k]
        for mine, values in zip(keys, pulled):
            self._write(mine, values)

    def _keys_per_ps(self, params: Iterable[torch.Tensor]) -> list[list[shard_store.ShardKey]]:
        """The keys of these parameters' shards, ps by ps."""
        keys: list[list[shard_store.ShardKey]] = [[] for _ in self._ps_names]
        for p in params:
            for s in self._shards.get(id(p), ()):
                keys[s.ps].append((s.variable, s.index))
        return keys

    # ------------------------------------------------------------------ checkpoints

    def ours(self, objects: list[object]) -> tuple[bool, list[torch.optim.Optimizer]]:
        """Whether a module of ours is among ``objects``, and which optimizers of ours are."""
        modules = any(
            isinstance(o, torch.nn.Module)
            and any(id(t) in self._shards for t in (*o.parameters(), *o.buffers()))
            for o in objects
        )
        optimizers = [
            o
            for o in objects
            if isinstance(o, torch.optim.Optimizer)
            and any(id(p) in self._shards for g in o.param_groups for p in g["params"])
        ]
        return modules, optimizers

    def bring_home(self, objects: list[object]) -> None:
        """The ps's current values into our modules among ``objects``, and its optimizer state
        into our optimizers among them (the chief, before it writes a checkpoint)."""
        modules, optimizers = self.ours(objects)
        if modules or optimizers:
            self.pull()
        for optimizer in optimizers:
            keys = self._keys_per_ps(_params(optimizer))
            held: dict = {}
            for answer in self._ask(
                "optimizer_state",
                "a request for its optimizer state",
                lambda i, keys=keys: [[list(k) for k in keys[i]]],
            ):
                held.update({(k[0], k[1]): state for k, state in answer})
            for p in _params(optimizer):
                shards = self._shards.get(id(p), [])
                states = [held.get((s.variable, s.index)) for s in shards]
                if shards and all(states):
                    optimizer.state[p] = _join_state(p, shards, states)

    def send_restored(self, objects: list[object]) -> None:
        """After every worker restored the same checkpoint: the chief sends the restored values
        and optimizer state to the ps; the others wait for that, then pull."""
        modules, optimizers = self.ours(objects)
        if not (modules or optimizers):
            return
        self._restores += 1
        if not self._chief:
            # Every worker restored the same file; the chief sends it to the ps. Wait for that,
            # so that no gradient of the restored values lands on the ps's older ones.
            # The chief may still be reading the checkpoint: the wait lasts while it is alive.
            self._ask("loaded", "the chief's restored values", lambda i: [self._restores])
            self.pull()
            return
        values: list[dict] = [{} for _ in self._ps_names]
        states: list[dict] = [{} for _ in self._ps_names]
        if modules:
            for p in self._variables.values():
                for s in self._shards[id(p)]:
                    values[s.ps][(s.variable, s.index)] = _rows(p, s).detach().clone()
        for optimizer in optimizers:
            for p in _params(optimizer):
                state = optimizer.state.get(p)
                for s in self._shards.get(id(p), ()) if state else ():
                    states[s.ps][(s.variable, s.index)] = _split_state(p, s, state)
        self._ask(
            "load",
            "the restored values",
            lambda i: [shard_store.pairs(values[i]), shard_store.pairs(states[i])],
        )

    # ------------------------------------------------------------------ the job

    def training_finished(self) -> bool:
        """Whether every worker is done (or lost)."""
        return all(self._ask("workers_done", "whether the workers are done"))

    def ps_stats(self) -> list[dict[str, Any]]:
        """What each ps applied, dropped and held back so far; in sync mode the gradients of
        each update (``counts``), and how many workers it counts as training."""
        return self._ask("stats", "a request for its statistics")

    def finish(self, *, wait: bool = True) -> None:
        """At exit: tell every ps this worker is done (the answer comes when every worker is,
        or was lost; a wait on a worker that stopped answering ends after the operation
        timeout, naming it), then hang up and leave. Without ``wait`` (a coordinating chief,
        whose workers stop only once it has ended) the ps answers at once."""
        # A ps whose connection broke (it ended, or stopped answering) gets no goodbye: that
        # error was raised already.
        open_ps = [i for i, c in enumerate(self._connections) if not c.closed]
        method = "leave" if wait else "depart"
        try:
            self._ask(method, "this worker's goodbye", lambda i: [self._worker_index], ps=open_ps)
        except PeerLostError:
            pass  # a ps that is gone needs no goodbye; the error that mattered came earlier
        except CollectiveTimeoutError as e:
            print(f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            self._close()
            self._world.shutdown()

    def _close(self) -> None:
        for connection in self._connections:
            connection.close()

    def _ask(
        self,
        method: str,
        what: str,
        args: Callable[[int], list] = lambda i: [],
        *,
        ps: list[int] | None = None,
        into: Callable[[int], list[torch.Tensor]] = lambda i: [],
    ) -> list[Any]:
        """Ask ``method`` with ``args(i)`` of ps i, for every ps (or those in ``ps``) at once;
        their answers, in that order (ps i's tensors received into ``into(i)`` where they fit).
        A ps that is gone or stuck is named, with the operation."""
        targets = sorted(range(len(self._ps_names)) if ps is None else ps)
        connections = [self._connections[i] for i in targets]
        for connection in connections:  # in ps order: two threads asking never deadlock
            connection.lock.acquire()
        try:
            ids = [c.send(method, args(i), what=what) for c, i in zip(connections, targets)]
            return [
                c.receive(
                    rid,
                    what=what,
                    silent=self._world.silent,
                    peer_ended=lambda rank=self._ps_ranks[i]: self._world.has_ended(rank),
                    into=into(i),
                )
                for c, i, rid in zip(connections, targets, ids)
            ]
        except PeerLostError as e:
            raise PeerLostError(
                f"{e}. A ps that ends stops the job; with `stratagem run --max-restarts R` it "
                "restarts from the last checkpoint"
            ) from None
        finally:
            if method not in _READS:  # counted once over, answered or not (it may have landed)
                with self._writes_lock:
                    self.writes += 1
            for connection in connections:
                connection.lock.release()


# The requests that leave the ps's variables as they were.
_READS = frozenset(
    {"read", "fetch", "optimizer_state", "stats", "workers_done", "loaded", "leave", "depart"}
)


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
