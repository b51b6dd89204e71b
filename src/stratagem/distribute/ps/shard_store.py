"""What a ps task holds and does: variable shards, their optimizer, and each mode's update
rule (the task that serves them is ``task_server.PsTaskServer``).

``methods`` is the fixed table of what workers may ask through ``comm.messages`` (each call on
the asking worker's connection thread, its arguments plain data). Per optimizer a worker pushes
for: the shards it updates on this ps, a torch optimizer of the worker's class over them (its
state lives here), and a version (updates applied). ``async``: a push is applied at once, as is,
scaled by ``1 / (1 + staleness)`` or dropped beyond a bound, and with ``max_staleness=s`` a
worker more than ``s`` steps ahead of the slowest gets its reply once the slowest catches up.
``sync``: gradients for the current version are summed until ``replicas_to_aggregate`` arrived,
then their mean is applied; a late one is dropped and its worker gets the current values. A
lost worker that comes back (restarted alone) is taken back at its first push: in sync mode
that late gradient is dropped and it counts from the next update on; in async mode it is
applied, its clock starting at the slowest one's. Replies carry copies.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.futures import Future

from stratagem.comm.messages import Later
from stratagem.errors import PeerDataError

ShardKey = tuple[int, int]  # (variable, shard index)
Reply = tuple[list[torch.Tensor], int]  # (values of the group's shards, version)


@dataclass(frozen=True)
class UpdateRule:
    """How gradients become updates: the strategy's mode and its options (sent by the chief)."""

    mode: str  # "async" or "sync"
    num_workers: int
    replicas_to_aggregate: int
    max_staleness: int | None = None
    staleness_policy: str = "apply"  # "apply", "scale" or "drop"
    max_gradient_staleness: int | None = None
    compression: str | None = None  # None or "bf16"


@dataclass
class _Group:
    keys: tuple[ShardKey, ...]
    optimizer: torch.optim.Optimizer
    version: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    total: list[torch.Tensor] | None = None  # sync: the sum of this version's gradients so far
    count: int = 0
    waiting: list[Future] = field(default_factory=list)  # sync: contributors to this version
    contributors: set[int] = field(default_factory=set)  # sync: workers pushed for this version
    clocks: dict[int, int] = field(default_factory=dict)  # steps pushed, per worker
    parked: list[tuple[int, Future]] = field(default_factory=list)  # bounded staleness
    # Async: each worker's reply is copied into its own buffers, reused from push to push (a
    # worker pushes again only after it has received its last reply whole).
    replies: dict[int, list[torch.Tensor]] = field(default_factory=dict)


@dataclass
class Stats:
    applied: int = 0  # gradients applied (async) or contributed to an applied mean (sync)
    dropped: int = 0  # gradients dropped: late in sync, too stale in async
    steps: int = 0  # updates applied
    waits: int = 0  # replies held back by the staleness bound
    counts: list[int] = field(default_factory=list)  # sync: the gradients of each update


class ShardStore:
    """The shards this ps task holds, and the update rule; one per ps process."""

    def __init__(self, name: str, num_workers: int) -> None:
        self.name = name
        self.num_workers = num_workers
        self.rule: UpdateRule | None = None
        self.stats = Stats()
        self._shards: dict[ShardKey, torch.Tensor] = {}
        self._groups: dict[tuple[ShardKey, ...], _Group] = {}
        self._lock = threading.Lock()  # the dicts above, and the workers' states
        # One future per creation (a model built in a scope; a script may build several), keyed
        # by its first variable id: set when the chief has created those shards.
        self._created: dict[int, Future] = {}
        self._left: set[int] = set()  # workers that finished or were lost
        self._lost: set[int] = set()  # of those, the lost: one may come back (restarted)
        self._lost_any = False
        self._goodbyes: list[Future] = []  # workers waiting for the others to finish
        self._pending_state: dict[ShardKey, dict[str, Any]] = {}  # restored, no optimizer yet
        self._loads = 0  # restores the chief has sent
        self._load_waiters: list[tuple[int, Future]] = []

    # --- creation and reads -----------------------------------------------------------

    def create(self, rule: UpdateRule, first: int, shards: dict[ShardKey, torch.Tensor]) -> None:
        """The chief's values for the variables ``first``, ``first + 1``... of one creation."""
        with self._lock:
            ready = self._creation(first)
            if ready.done():
                return  # created already: a restarted chief's values must not overwrite
            if self.rule is None:
                self.rule = rule
            elif rule != self.rule:
                raise ValueError(
                    f"{self.name}: variables created by a ParameterServerStrategy with the options "
                    f"{asdict(rule)}, but this ps already holds variables of one with "
                    f"{asdict(self.rule)}; a job has one ParameterServerStrategy: create it "
                    "once, with one set of options"
                )
            for key, value in shards.items():
                # A trainable variable's shard takes gradients; an integer one (a step counter,
                # TF's tf.Variable(0, dtype=tf.int64)) cannot, and needs none.
                differentiable = value.is_floating_point() or value.is_complex()
                self._shards[key] = value.detach().clone().requires_grad_(differentiable)
        ready.set_result(None)

    def _creation(self, first: int) -> Future:
        # Under self._lock.
        return self._created.setdefault(first, Future())

    def when_created(self, first: int) -> Future:
        """Set once the chief has created the variables of the creation starting at ``first``."""
        with self._lock:
            return self._creation(first)

    @property
    def num_shards(self) -> int:
        """How many shards this ps holds (a variable of the workers' is one per ps it is cut
        over, however many names it has in their model)."""
        with self._lock:
            return len(self._shards)

    def read(self, keys: Sequence[ShardKey]) -> list[torch.Tensor]:
        self._check_keys(keys)
        return [self._wire(self._shards[k].detach().clone()) for k in keys]

    def _check_keys(self, keys: Sequence[ShardKey]) -> None:
        missing = [k for k in keys if k not in self._shards]
        if missing:
            raise KeyError(
                f"{self.name} holds no shard {missing[0]} (variable, shard); it holds "
                f"{len(self._shards)} shards: every worker must build the same model"
            )

    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        assert self.rule is not None
        bf16 = self.rule.compression == "bf16" and t.is_floating_point()  # not a counter
        return t.to(torch.bfloat16) if bf16 else t

    def assign_add(self, keys: Sequence[ShardKey], deltas: Sequence[torch.Tensor]) -> None:
        """Add a worker's changes to these shards (TF's ``assign_add`` on a ps variable: what
        a scheduled function changed of a variable that is not trained, a step counter)."""
        self._check_keys(keys)
        if len(deltas) != len(keys):
            raise ValueError(f"assign_add: {len(keys)} shards and {len(deltas)} changes")
        with self._lock, torch.no_grad():
            for key, delta in zip(keys, deltas):
                shard = self._shards[key]
                if not isinstance(delta, torch.Tensor) or delta.shape != shard.shape:
                    raise ValueError(
                        f"assign_add: shard {key} is {tuple(shard.shape)} {shard.dtype}; the "
                        f"change sent is {delta!r:.80}"
                    )
                shard.add_(delta.to(shard.dtype))

    # --- pushes -----------------------------------------------------------------------

    def push(
        self,
        worker: int,
        optimizer_class: tuple[str, str],
        groups: Sequence[tuple[dict[str, Any], Sequence[ShardKey]]],
        version: int,
        grads: Sequence[torch.Tensor],
    ) -> Future:
        """A worker's gradients for the shards of one optimizer; the future is the reply."""
        assert self.rule is not None, "push before create"
        back = self._take_back(worker)
        group = self._group(optimizer_class, groups)
        rule = self.rule
        reply: Future = Future()
        with group.lock:
            if back:
                # Its clock starts at the slowest one's: the steps it missed hold nobody back.
                others = [c for w, c in group.clocks.items() if w != worker and w not in self._left]
                group.clocks[worker] = min(others, default=0)
            self._set_hyperparameters(group, groups)
            if rule.mode == "sync":
                self._push_sync(group, worker, version, grads, reply)
            else:
                self._push_async(group, worker, version, grads, reply)
        return reply

    def _take_back(self, worker: int) -> bool:
        """Whether ``worker`` was lost and pushes again (restarted): it counts among those
        training again. In sync mode its push is for an older version (it never saw the current
        one), so it is dropped and the worker answered with the current values: from the next
        update on its gradients count, and the update under way waits for them (no update mixes
        gradients of two versions)."""
        with self._lock:
            if worker not in self._lost:
                return False
            self._lost.discard(worker)
            self._left.discard(worker)
            return True

    def _group(
        self,
        optimizer_class: tuple[str, str],
        groups: Sequence[tuple[dict[str, Any], Sequence[ShardKey]]],
    ) -> _Group:
        keys = tuple(k for _, ks in groups for k in ks)
        with self._lock:
            group = self._groups.get(keys)
            if group is None:
                self._check_keys(keys)
                cls = _import(optimizer_class)
                param_groups = [
                    {"params": [self._shards[k] for k in ks], **hyper} for hyper, ks in groups if ks
                ]
                group = _Group(keys, cls(param_groups))
                for k in keys:  # state restored from a checkpoint before the first push
                    if k in self._pending_state:
                        group.optimizer.state[self._shards[k]] = self._pending_state.pop(k)
                self._groups[keys] = group
            return group

    @staticmethod
    def _set_hyperparameters(
        group: _Group, groups: Sequence[tuple[dict[str, Any], Sequence[ShardKey]]]
    ) -> None:
        # The worker's current options (a learning-rate schedule changes them), group by group.
        live = [hyper for hyper, ks in groups if ks]
        for param_group, hyper in zip(group.optimizer.param_groups, live):
            param_group.update(hyper)

    def _apply(self, group: _Group, grads: Sequence[torch.Tensor], scale: float) -> None:
        params = [p for g in group.optimizer.param_groups for p in g["params"]]
        for p, g in zip(params, grads):
            g = g.to(p.dtype)
            p.grad = g if scale == 1.0 else g.mul_(scale)
        group.optimizer.step()
        for p in params:
            p.grad = None
        group.version += 1
        self.stats.steps += 1

    def _values(self, group: _Group) -> Reply:
        """The group's values now (a copy: the reply is sent after the group's lock is let go)."""
        return [self._wire(self._shards[k].detach().clone()) for k in group.keys], group.version

    def _values_for(self, group: _Group, worker: int) -> Reply:
        """``_values`` copied into ``worker``'s reply buffers (under the group's lock)."""
        buffers = group.replies.get(worker)
        if buffers is None:
            wire = torch.bfloat16 if self.rule and self.rule.compression == "bf16" else None
            buffers = [torch.empty_like(self._shards[k], dtype=wire, requires_grad=False)
                       for k in group.keys]  # fmt: skip
            group.replies[worker] = buffers
        with torch.no_grad():
            for buffer, k in zip(buffers, group.keys):
                buffer.copy_(self._shards[k])
        return list(buffers), group.version

    def _push_sync(
        self,
        group: _Group,
        worker: int,
        version: int,
        grads: Sequence[torch.Tensor],
        reply: Future,
    ) -> None:
        assert self.rule is not None
        if version < group.version:  # late: this version was applied without it
            self.stats.dropped += 1
            reply.set_result(self._values(group))
            return
        if group.total is None:
            # bf16 on the wire, summed in float32.
            group.total = [g.to(torch.float32 if g.dtype == torch.bfloat16 else g.dtype).clone()
                           for g in grads]  # fmt: skip
        else:
            for t, g in zip(group.total, grads):
                t.add_(g.to(t.dtype))
        group.count += 1
        group.contributors.add(worker)
        group.waiting.append(reply)
        self._step_if_complete(group)

    def _step_if_complete(self, group: _Group) -> None:
        """Sync: once enough gradients of this version are in, apply their mean and reply."""
        if not group.waiting or group.count < self._needed():
            return
        count, waiting, total = group.count, group.waiting, group.total
        group.total, group.count, group.waiting = None, 0, []
        group.contributors = set()
        assert total is not None
        self.stats.applied += count
        self.stats.counts.append(count)
        self._apply(group, total, 1.0 / count)
        values = self._values(group)
        for w in waiting:
            w.set_result(values)

    def _needed(self) -> int:
        assert self.rule is not None
        return max(1, min(self.rule.replicas_to_aggregate, self._active()))

    def _push_async(
        self,
        group: _Group,
        worker: int,
        version: int,
        grads: Sequence[torch.Tensor],
        reply: Future,
    ) -> None:
        assert self.rule is not None
        rule = self.rule
        staleness = group.version - version
        bound = rule.max_gradient_staleness
        if rule.staleness_policy == "drop" and bound is not None and staleness > bound:
            self.stats.dropped += 1
        else:
            scale = 1.0 / (1 + staleness) if rule.staleness_policy == "scale" else 1.0
            self._apply(group, [g.clone() if scale != 1.0 else g for g in grads], scale)
            self.stats.applied += 1
        group.clocks[worker] = group.clocks.get(worker, 0) + 1
        if self._too_far_ahead(group, worker):
            self.stats.waits += 1
            group.parked.append((worker, reply))
        else:
            reply.set_result(self._values_for(group, worker))
        self._release(group)

    def _too_far_ahead(self, group: _Group, worker: int) -> bool:
        assert self.rule is not None
        s = self.rule.max_staleness
        if s is None:
            return False
        training = [c for w, c in group.clocks.items() if w not in self._left]
        if len(training) < self._active():
            training.append(0)  # a worker still training that has not pushed yet
        return group.clocks[worker] - min(training, default=0) > s

    def _active(self) -> int:
        """Workers still training: neither finished nor lost."""
        return self.num_workers - len(self._left)

    def _release(self, group: _Group) -> None:
        still = []
        for worker, reply in group.parked:
            if worker not in self._left and self._too_far_ahead(group, worker):
                still.append((worker, reply))
            else:
                reply.set_result(self._values_for(group, worker))
        group.parked = still

    def push_waits_for(self, keys: Sequence[ShardKey]) -> tuple[list[int], int]:
        """Whose push a parked reply for the shards ``keys`` waits for (worker indices), and
        the update it waits for: in sync mode the workers still training that have not pushed
        for this version; in async mode with bounded staleness the slowest workers."""
        with self._lock:
            group = self._groups.get(tuple(keys))
            left = set(self._left)
        if group is None:
            return [], 0
        with group.lock:
            training = [w for w in range(self.num_workers) if w not in left]
            if self.rule is not None and self.rule.mode == "sync":
                return [w for w in training if w not in group.contributors], group.version + 1
            clocks = {w: group.clocks.get(w, 0) for w in training}
            slowest = min(clocks.values(), default=0)
            return [w for w, c in clocks.items() if c == slowest], group.version + 1

    def still_training(self) -> list[int]:
        """The workers that have neither finished nor been lost."""
        with self._lock:
            return [w for w in range(self.num_workers) if w not in self._left]

    # --- checkpoints (the chief's) -----------------------------------------------------

    def optimizer_state(self, keys: Sequence[ShardKey]) -> dict[ShardKey, dict[str, Any]]:
        """The optimizer state of these shards (copies), for a checkpoint."""
        wanted = set(keys)
        out: dict[ShardKey, dict[str, Any]] = {}
        with self._lock:
            groups = list(self._groups.values())
            out.update({k: dict(v) for k, v in self._pending_state.items() if k in wanted})
        for group in groups:
            with group.lock:
                for k in group.keys:
                    state = group.optimizer.state.get(self._shards[k])
                    if k in wanted and state:
                        out[k] = {n: _copy(v) for n, v in state.items()}
        return out

    def loaded(self, count: int) -> Future:
        """Set once ``count`` restores have been loaded (other workers wait for the chief's)."""
        done: Future = Future()
        with self._lock:
            if self._loads >= count:
                done.set_result(None)
            else:
                self._load_waiters.append((count, done))
        return done

    def load(
        self, values: dict[ShardKey, torch.Tensor], states: dict[ShardKey, dict[str, Any]]
    ) -> None:
        """Overwrite shards and their optimizer state with a restored checkpoint's."""
        self._load(values, states)
        with self._lock:
            self._loads += 1
            ready = [f for n, f in self._load_waiters if n <= self._loads]
            self._load_waiters = [(n, f) for n, f in self._load_waiters if n > self._loads]
        for f in ready:
            f.set_result(None)

    def _load(
        self, values: dict[ShardKey, torch.Tensor], states: dict[ShardKey, dict[str, Any]]
    ) -> None:
        self._check_keys(list(values) + list(states))
        with self._lock:
            groups = {k: g for g in self._groups.values() for k in g.keys}
            for k, state in states.items():
                if k not in groups:
                    self._pending_state[k] = {n: _copy(v) for n, v in state.items()}
        for k in set(values) | set(states):
            group = groups.get(k)
            with group.lock if group is not None else contextlib.nullcontext(), torch.no_grad():
                if k in values:
                    self._shards[k].copy_(values[k])
                if group is not None and k in states:
                    group.optimizer.state[self._shards[k]] = {
                        n: _copy(v) for n, v in states[k].items()
                    }

    # --- workers leaving --------------------------------------------------------------

    def has_left(self, worker: int) -> bool:
        with self._lock:
            return worker in self._left

    def workers_done(self) -> bool:
        with self._lock:
            return len(self._left) == self.num_workers

    def leave(self, worker: int, *, lost: bool = False) -> Future:
        """A worker finished (or was lost): it no longer holds back the others. The future is
        set, to whether any worker was lost, once every worker has finished or been lost.
        ``worker`` -1 is an evaluator: it only waits for the workers."""
        goodbye: Future = Future()
        with self._lock:
            if worker >= 0:
                self._left.add(worker)
                if lost:
                    self._lost.add(worker)
            self._lost_any = self._lost_any or lost
            self._goodbyes.append(goodbye)
            groups = list(self._groups.values())
            everyone = len(self._left) == self.num_workers
            goodbyes = self._goodbyes if everyone else []
            if everyone:
                self._goodbyes = []
        for group in groups:
            with group.lock:
                self._release(group)
                self._step_if_complete(group)  # a sync step no longer waits for it
        for g in goodbyes:
            g.set_result(self._lost_any)
        return goodbye


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _import(path: tuple[str, str]) -> type:
    module, qualname = path
    if module == "__main__":
        raise TypeError(
            f"the optimizer class {qualname} is defined in the script itself (__main__); a ps "
            "task builds the optimizer before the script defines it. Use a torch.optim "
            "optimizer or define the class in a module the script imports"
        )
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


# --- what workers may ask a ps: the fixed table, over plain data ---------------------------


def _key(raw: Any) -> ShardKey:
    if not (isinstance(raw, list | tuple) and len(raw) == 2 and all(type(n) is int for n in raw)):
        raise PeerDataError(f"a shard key is [variable, shard], two ints; got {raw!r}")
    return (raw[0], raw[1])


def _keys(raw: Any) -> list[ShardKey]:
    if not isinstance(raw, list):
        raise PeerDataError(f"shard keys come as a list; got {type(raw).__name__}")
    return [_key(k) for k in raw]


def _pairs(raw: Any) -> dict[ShardKey, Any]:
    """A ``{shard key: value}`` dict, sent as a list of ``[key, value]`` pairs (plain data's
    dicts have str keys)."""
    if not isinstance(raw, list) or not all(isinstance(p, list) and len(p) == 2 for p in raw):
        raise PeerDataError("shard values come as a list of [key, value] pairs")
    return {_key(k): v for k, v in raw}


def pairs(values: dict[ShardKey, Any]) -> list[list[Any]]:
    """``_pairs``'s inverse: what a worker sends for a dict keyed by shard."""
    return [[list(k), v] for k, v in values.items()]


def _rule(raw: Any) -> UpdateRule:
    fields = set(UpdateRule.__dataclass_fields__)
    if not isinstance(raw, dict) or set(raw) != fields:
        raise PeerDataError(f"an update rule has the fields {sorted(fields)}; got {raw!r}")
    return UpdateRule(**raw)


def methods(store: ShardStore, worker_names: list[str]) -> dict[str, Callable[..., Any]]:
    """What workers may ask ``store``'s ps, by name (``comm.messages`` refuses anything else).
    ``worker_names[i]`` names the task of worker index i (``"worker:1"``), the chief first."""

    def human(name: str) -> str:
        task_type, _, index = name.partition(":")
        return task_type if task_type == "chief" else f"{task_type} {index}"

    chief = worker_names[0]

    def waits_for_chief(why: str) -> Callable[[], tuple[str, list[str]]]:
        return lambda: (f"{why} ({human(chief)})", [chief])

    def create(rule: Any, first: int, shards: Any) -> None:
        store.create(_rule(rule), int(first), _pairs(shards))

    def fetch(first: int, keys: Any) -> Later:
        wanted = _keys(keys)
        return Later(
            store.when_created(int(first)),
            waits_for_chief("the fetch waits for the chief's creation of the variables"),
            lambda _: store.read(wanted),
        )

    def push(worker: int, optimizer_class: Any, groups: Any, version: int, grads: Any) -> Later:
        if not (isinstance(optimizer_class, list) and len(optimizer_class) == 2):
            raise PeerDataError(f"an optimizer class is [module, name]; got {optimizer_class!r}")
        parsed = [(dict(hyper), _keys(keys)) for hyper, keys in groups]
        all_keys = [k for _, keys in parsed for k in keys]
        reply = store.push(int(worker), tuple(optimizer_class), parsed, int(version), grads)

        def waiting() -> tuple[str, list[str]]:
            workers, update = store.push_waits_for(all_keys)
            names = [worker_names[w] for w in workers]
            whose = " and ".join(f"{human(n)}'s" for n in names) or "another worker's"
            return f"the push waits for {whose} gradient for update {update}", names

        return Later(reply, waiting)

    def still_training(why: str) -> Callable[[], tuple[str, list[str]]]:
        def waiting() -> tuple[str, list[str]]:
            names = [worker_names[w] for w in store.still_training()]
            return f"{why} ({', '.join(human(n) for n in names)})", names

        return waiting

    def leave(worker: int) -> Later:
        return Later(
            store.leave(int(worker)),
            still_training("the goodbye waits for the workers still training to finish"),
        )

    def depart(worker: int) -> None:
        # A coordinating chief leaves without waiting: its workers stop when it has ended.
        store.leave(int(worker))

    def loaded(count: int) -> Later:
        return Later(
            store.loaded(int(count)),
            waits_for_chief("this worker waits for the chief's restored values"),
        )

    def stats() -> dict[str, Any]:
        s = store.stats
        return {
            "applied": s.applied,
            "dropped": s.dropped,
            "steps": s.steps,
            "waits": s.waits,
            "shards": store.num_shards,
            "counts": list(s.counts),
            "training": len(store.still_training()),
        }

    return {
        "create": create,
        "depart": depart,
        "fetch": fetch,
        "push": push,
        "read": lambda keys: store.read(_keys(keys)),
        "assign_add": lambda keys, deltas: store.assign_add(_keys(keys), list(deltas)),
        "optimizer_state": lambda keys: pairs(store.optimizer_state(_keys(keys))),
        "load": lambda values, states: store.load(_pairs(values), _pairs(states)),
        "loaded": loaded,
        "leave": leave,
        "stats": stats,
        "workers_done": store.workers_done,
    }
