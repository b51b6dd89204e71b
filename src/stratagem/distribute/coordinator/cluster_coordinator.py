"""``sg.distribute.coordinator.ClusterCoordinator``: the chief schedules functions on workers.

TF2's parameter-server training: the chief runs the loop and schedules functions; the worker
tasks (``sg.distribute.Server(...).join()``) run them. One connection per worker
(``comm.messages``; ``hello`` checks it runs the same program) and one dispatch thread each,
taking the next function from a shared queue: one function in flight per worker. ``schedule``
describes the function and its arguments by reference (``stratagem.shipping``; what cannot be
sent is a ``TypeError`` in the caller) and returns a ``RemoteValue`` at once. Per-worker datasets
and iterators are a log every worker replays, in order, before its next function; a dataset
travels by its recipe and each worker makes its own copy. Errors follow TF's ``ClosureQueue``:
the first is kept, the functions queued or running are cancelled, and ``join``, ``done`` or the
next ``schedule`` raise it once; ``fetch`` of a cancelled function raises ``CancelledError``. A
lost worker's function runs again on another worker; a worker the launcher restarts
(``--restart-workers``) signs in again, replays the log and is dispatched to again.
"""

from __future__ import annotations

import atexit
import collections
import copy
import operator
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from stratagem import data as sg_data
from stratagem import shipping
from stratagem.cluster import is_coordinated
from stratagem.cluster.tasks import restart_workers_of
from stratagem.comm.messages import Connection
from stratagem.comm.process_group import Timeouts
from stratagem.distribute.coordinator.values import (
    CancelledError,
    FunctionError,
    PerWorkerDataset,
    PerWorkerIterator,
    RemoteValue,
)
from stratagem.distribute.machinery import scope_hooks
from stratagem.distribute.machinery.input import (
    PerWorkerDistributedDataset,
    PerWorkerDistributedDatasetsFromFunction,
)
from stratagem.errors import CollectiveTimeoutError, PeerLostError

# How often the coordinator looks for a lost worker's next incarnation (a store read and a
# liveness probe, both on this machine's chief: cheap).
_REJOIN_POLL_S = 0.25


class _Closure:
    def __init__(
        self,
        cid: int,
        name: str,
        call: list[Any],
        accumulators: dict[str, Any],
        on_fetch: Callable[[], None],
    ) -> None:
        self.cid = cid
        self.name = name
        self.call = call  # the "run" request's arguments: [id, table, ref, args, kwargs]
        # The table's number when a worker may keep it (plain data alone, no tensor), the same
        # for every function whose table is the same (``_table_id``); else None.
        self.table_id: int | None = None
        self.entries: dict[str, bytes] | None = None  # each table entry's fingerprint
        self.accumulators = accumulators  # the metrics it sent: their totals come back
        self.value = RemoteValue(name, on_fetch)
        # The writes it must see (``ClusterCoordinator._writes_ended``) when it was scheduled.
        self.must_see = 0
        # Set when an earlier function failed while this one ran: its outcome is not taken.
        self.cancelled: CancelledError | None = None


class _Described:
    """A schedule's description (its table, the function's reference, its arguments' entries,
    its accumulators and fingerprint), kept for the next ``schedule`` of the same function and
    arguments (by identity) while a snapshot of everything the describe read is unchanged
    (``shipping.Reads``): describing again would make the same.

    The values of volatile attributes (``Portable._sg_volatile``: fit's step counter) are not
    watched but read again at each call and put in the table (``refreshed``). Recording the
    reads and taking the snapshot cost about half a describe more. A description that cannot be
    kept (a tensor by value in it) or whose reads changed at two calls in a row (a loop that
    changes what its function captures at every call) is not watched for the next
    ``_UNWATCHED`` calls of its function (``ClusterCoordinator._unwatched``); then it is tried
    again."""

    def __init__(
        self,
        fn: Any,
        args: tuple,
        kwargs: dict[str, Any],
        name: str,
        describer: shipping.Describer,
        call: tuple[Any, list[Any], dict[str, Any]],
        fingerprint: dict[str, bytes] | None,
        snapshot: shipping.Snapshot | None,
        volatile: list[tuple[str, Any, str]],
    ) -> None:
        self.fn = fn
        self.args = tuple(args)  # copies: a caller may change the list or dict it passed
        self.kwargs = dict(kwargs)
        self.name = name
        self.table = describer.functions
        self.accumulators = describer.accumulators
        self.ref, self.call_args, self.call_kwargs = call
        self.fingerprint = fingerprint  # None: a tensor in the table
        self.snapshot = snapshot  # None: not to be kept
        self.volatile = volatile  # (table key, object, attribute): read again at each call
        self.changed = 0  # calls in a row, with the same arguments, that found it changed

    def refreshed(self) -> _Described | None:
        """This description with the values its volatile attributes have now (a step
        counter's); None where one is no longer a number, a string or None."""
        patches: dict[str, dict[str, Any]] = {}
        for key, obj, attribute in self.volatile:
            now = vars(obj).get(attribute, _ABSENT)
            if type(now) not in shipping.VOLATILE_TYPES:
                return None
            entry = patches.get(key) or self.table[key]
            was = entry["state"].get(attribute)
            if was is None:
                continue  # local to each process: not described
            if was.get("k") != "value":
                return None  # it held something else when described
            if was["v"] is now:
                continue
            state = {**entry["state"], attribute: {"k": "value", "v": now}}
            patches[key] = {**entry, "state": state}
        if not patches:
            return self
        fresh = copy.copy(self)
        fresh.table = {**self.table, **patches}
        fresh.fingerprint = {
            **(self.fingerprint or {}),
            **(_fingerprint(patches) or {}),  # (plain: a kept table's entries, a number)
        }
        return fresh

    def same_call(self, fn: Any, args: tuple, kwargs: dict[str, Any]) -> bool:
        return (
            fn is self.fn
            and len(args) == len(self.args)
            and all(map(operator.is_, args, self.args))
            and kwargs.keys() == self.kwargs.keys()
            and all(kwargs[k] is v for k, v in self.kwargs.items())
        )


_UNWATCHED = 64  # see _Described
_ABSENT = object()
_KEPT_FUNCTIONS = 8  # descriptions kept: the last of each of the last functions scheduled


# What ``ClusterCoordinator._special`` describes, besides its strategy and itself.
_SPECIAL_TYPES = (
    torch.Tensor,
    sg_data.Dataset,
    PerWorkerDistributedDataset,
    PerWorkerDistributedDatasetsFromFunction,
    PerWorkerIterator,
    PerWorkerDataset,
    RemoteValue,
)


def _fingerprint(table: dict[str, Any]) -> dict[str, bytes] | None:
    """Per entry of a table, its ``shipping.plain_bytes``; None for a table a worker may not
    keep from call to call (a tensor in it: a captured one, a buffer's value, a dataset's
    data, which a call may change)."""
    fingerprint: dict[str, bytes] = {}
    for key, entry in table.items():
        data = shipping.plain_bytes(entry)
        if data is None:
            return None
        fingerprint[key] = data
    return fingerprint


def _raised_on_worker(error: Any, headline: Callable[[str, str], str]) -> FunctionError:
    """A worker's error reply (``[type name, message, traceback text]``) as a
    ``FunctionError``: ``headline(type name, message)``, then the worker's traceback."""
    type_name, message, text = error
    return FunctionError(
        f"{headline(type_name, message)}\nThe worker's traceback:\n{text}", type_name
    )


def check_coordinator_cluster(resolver: Any) -> None:
    """Raise unless ``resolver`` is the chief of a cluster with a chief and workers."""
    spec = resolver.cluster_spec()
    if not is_coordinated(spec):
        raise ValueError(
            "ClusterCoordinator needs a cluster with a chief (the coordinator) and workers "
            f"that serve it; this cluster has {sorted(spec.jobs)}. Launch with `stratagem "
            "run --chief -n W --ps K`; without a chief every worker runs the loop itself "
            "(between-graph training: no coordinator)"
        )
    if resolver.task_type != "chief":
        raise ValueError(
            f"ClusterCoordinator runs on the chief; this process is {resolver.describe()}: "
            "a worker task runs sg.distribute.Server(...).join() instead"
        )


class ClusterCoordinator:
    """``sg.distribute.coordinator.ClusterCoordinator(strategy)``: on the chief of a cluster
    with a chief, workers and ps tasks; ``strategy`` is its ``ParameterServerStrategy``."""

    def __new__(cls, strategy: Any) -> ClusterCoordinator:
        # One coordinator per strategy, as TF's: fit finds the one the script made.
        existing = getattr(strategy, "cluster_coordinator", None)
        if isinstance(existing, cls):
            return existing
        return super().__new__(cls)

    def __init__(self, strategy: Any) -> None:
        if getattr(self, "strategy", None) is strategy:
            return  # the strategy's coordinator, made before
        from stratagem.distribute.parameter_server_strategy import ParameterServerStrategy

        if not isinstance(strategy, ParameterServerStrategy):
            raise TypeError(
                "ClusterCoordinator(strategy) takes a ParameterServerStrategy; got "
                f"{type(strategy).__name__}"
            )
        check_coordinator_cluster(strategy.cluster_resolver)
        if strategy.mode != "async":
            raise ValueError(
                f"ClusterCoordinator trains asynchronously (as TF's); the strategy has "
                f"mode={strategy.mode!r}: create ParameterServerStrategy(resolver) with the "
                "default mode='async'"
            )
        self.strategy = strategy
        self._seam = strategy.extended.coordinator_seam
        world = self._seam.world
        self._world = world
        self._lock = threading.Condition()
        self._queue: collections.deque[_Closure] = collections.deque()
        self._inflight = 0
        self._running: dict[int, tuple[_Closure, int]] = {}  # closure id -> (it, worker rank)
        self._control: dict[int, Connection] = {}  # per worker rank: where cancels are said
        self._control_lock = threading.Lock()
        self._error: BaseException | None = None
        self._resources: list[tuple[str, list[Any], str]] = []  # the per-worker log
        self._replayed: dict[int, int] = {}  # per worker rank: how much of the log it made
        self._next_id = 0
        self._closing = False
        self._buffer_keys: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.completed = 0  # functions whose value was set (each counted once)
        self.tables_sent_by_number = 0  # runs whose worker had their table (``_fingerprint``)
        self.tables_sent_as_changes = 0  # runs sent as the entries that changed since its last
        # Runs ended (each may have pushed), and how many had when the chief last pulled.
        self._finished = 0
        self._fresh = 0
        self._pull_lock = threading.Lock()
        self._calls = 0  # runs sent to the workers: each is numbered (its worker's pulls)
        # The last table's fingerprints and its number.
        self._last_table: tuple[dict[str, bytes], int] | None = None
        self._kept: dict[int, _Described] = {}  # id(function) -> its last description
        self._unwatched: dict[int, int] = {}  # id(function) -> calls still to describe afresh
        self._kept_lock = threading.Lock()  # schedule may be called from several threads
        self.descriptions_kept = 0  # schedules that used the last one's description
        # A check for tests: describe every function again where the last description is kept,
        # and raise if the two differ.
        self._check_kept = os.environ.get("STRATAGEM_CHECK_KEPT_DESCRIPTIONS") == "1"
        program = shipping.program_file()
        root = shipping.program_root()
        hello: list[Any] = [None, None]
        if program is not None:
            hello = [program.relative_to(root).as_posix(), shipping.file_hash(program)]
        hello.append(self._seam.compression)
        self._hello = hello  # said again to a worker that rejoins
        self._incarnations = dict(world.incarnations)  # of the workers connected to
        # The launcher restarts lost workers (--restart-workers): losing all is not the end.
        self._expect_rejoin = restart_workers_of(os.environ) > 0
        self._all_lost_at: float | None = None
        self._workers: list[tuple[int, Connection]] = []
        try:
            for rank in world.ranks("worker"):
                connection = self._connect(rank)
                self._workers.append((rank, connection))
                self._ask(rank, connection, "hello", hello, "the coordinator's hello")
        except BaseException:
            for _, connection in self._workers:
                connection.close()
            raise
        self._threads: list[threading.Thread] = []
        for rank, connection in self._workers:
            self._start_dispatch(rank, connection)
        atexit.register(self.shutdown)
        strategy.cluster_coordinator = self

    # ----------------------------------------------------------------------- scheduling

    def schedule(
        self, fn: Callable[..., Any], args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> RemoteValue:
        """Queue ``fn(*args, **kwargs)`` for a free worker; its ``RemoteValue``, at once."""
        self._raise_if_error()
        # Variables created in a scope still open are made on the ps before a function uses them.
        self.strategy.extended.adopt_pending()
        described = self._description(fn, args, kwargs or {})
        name, fingerprint = described.name, described.fingerprint
        with self._lock:
            if self._closing:
                raise RuntimeError(f"schedule({name}) after the coordinator shut down")
            self._next_id += 1
            closure = _Closure(
                self._next_id,
                name,
                [
                    self._next_id,
                    described.table,
                    described.ref,
                    described.call_args,
                    described.call_kwargs,
                ],
                described.accumulators,
                self._refresh_when_idle,
            )
            closure.must_see = self._writes_ended()
            closure.table_id = self._table_id(fingerprint)
            closure.entries = fingerprint
            if self._error is not None:
                # A function failed while this one was being described (after the check
                # above): it is cancelled as the ones queued then were. Queued behind a pending
                # error, no worker would take it and nothing would cancel it: fetch() would hang.
                closure.value.settle(error=self._cancelled(closure, self._error))
            else:
                self._queue.append(closure)
            self._lock.notify_all()
        # Let a dispatch thread that waits for the GIL have it now (a syscall that releases
        # it): a loop scheduling many functions at once (fit schedules an epoch) otherwise
        # holds it for the switch interval, 5 ms, while a worker waits for its next function.
        time.sleep(0)
        return closure.value

    def join(self) -> None:
        """Wait until every scheduled function has finished; raise the first error one raised
        (then it is cleared, and the functions still queued were cancelled)."""
        with self._lock:
            self._lock.wait_for(lambda: self._error is not None or self._idle())
            self._lock.wait_for(lambda: self._inflight == 0)
        self._raise_if_error()
        self.refresh()  # the chief's model after join() is the trained one

    def done(self) -> bool:
        """Whether every scheduled function has finished (raises the first error, as ``join``)."""
        self._raise_if_error()
        with self._lock:
            idle = self._idle()
        if idle:
            self.refresh()
        return idle

    def fetch(self, val: Any) -> Any:
        """``val`` with each ``RemoteValue`` in it (lists, tuples, dicts) replaced by its value."""
        if isinstance(val, RemoteValue):
            return val.fetch()
        if isinstance(val, list | tuple):
            return type(val)(self.fetch(v) for v in val)
        if isinstance(val, dict):
            return {k: self.fetch(v) for k, v in val.items()}
        return val

    def create_per_worker_dataset(self, dataset_fn: Any) -> PerWorkerDataset:
        """Have every worker build its dataset: ``dataset_fn()`` (sent by reference, run on each
        worker), or, as TF's, a dataset (each worker makes its own copy from its recipe) or a
        distributed dataset made on the chief (each worker builds it with its own strategy)."""
        describer = self._describer()
        if isinstance(
            dataset_fn,
            sg_data.Dataset
            | PerWorkerDistributedDataset
            | PerWorkerDistributedDatasetsFromFunction,
        ):
            name = repr(dataset_fn)
            ref = describer.value(dataset_fn, owner="create_per_worker_dataset", name="dataset")
            call = False
        elif callable(dataset_fn):
            name = shipping.source_line(dataset_fn)
            ref = describer.function(dataset_fn, what=name)
            call = True
        else:
            raise TypeError(
                "create_per_worker_dataset takes a dataset function, an sg.data.Dataset or a "
                "distributed dataset (strategy.experimental_distribute_dataset / "
                f"distribute_datasets_from_function); got {type(dataset_fn).__name__}"
            )
        # One draw for this dataset: each worker's unseeded shuffles derive theirs from it and
        # its index, so they differ between workers (as TF's) and repeat after manual_seed.
        seed = int(torch.randint(0, 1 << 62, (), dtype=torch.int64))
        with self._lock:
            self._next_id += 1
            dataset_id = self._next_id
            args = [dataset_id, describer.functions, ref, call, seed]
            what = f"dataset_fn {name}" if call else f"the dataset {name}"
            self._resources.append(("make_dataset", args, what))
            self._lock.notify_all()
        return PerWorkerDataset(self, dataset_id)

    def make_iterator(self, dataset: PerWorkerDataset) -> PerWorkerIterator:
        """``iter(per_worker_dataset)``: each worker makes its own iterator of its dataset."""
        with self._lock:
            self._next_id += 1
            what = f"iter() of the dataset {dataset.dataset_id}"
            self._resources.append(("make_iterator", [self._next_id, dataset.dataset_id], what))
            self._lock.notify_all()
            return PerWorkerIterator(self._next_id)

    def _description(
        self, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]
    ) -> _Described:
        """``fn(*args, **kwargs)`` described: the last description of ``fn`` where it is the
        same call and nothing it read has changed, else a new one (kept, and watched, as
        ``_Described`` says)."""
        key = id(fn)  # (a kept description holds its function: the id stays its own)
        with self._kept_lock:
            skip = self._unwatched.pop(key, 0)
            if skip > 1:
                self._unwatched[key] = skip - 1
            if skip:
                return self._describe(fn, args, kwargs, watch=False)
            kept = self._kept.pop(key, None)
            changed = 0
            if kept is not None and kept.snapshot is not None and kept.same_call(fn, args, kwargs):
                current = kept.refreshed() if kept.snapshot.unchanged() else None
                if current is not None:
                    self._kept[key] = current  # the most recent again
                    self.descriptions_kept += 1
                    if self._check_kept:
                        self._check_kept_description(current)
                    return current
                changed = kept.changed + 1
            described = self._describe(fn, args, kwargs, watch=changed < 2)
            if described.snapshot is None:
                if len(self._unwatched) >= 4 * _KEPT_FUNCTIONS:
                    self._unwatched.clear()  # (ids of functions long gone, perhaps)
                self._unwatched[key] = _UNWATCHED
                return described
            described.changed = changed
            if len(self._kept) >= _KEPT_FUNCTIONS:
                del self._kept[next(iter(self._kept))]  # the function scheduled longest ago
            self._kept[key] = described
            return described

    def _describe(
        self, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], *, watch: bool
    ) -> _Described:
        """Describe ``fn(*args, **kwargs)``; with ``watch``, with a snapshot of what was read
        where the description may be kept (no tensor by value in it, every read recorded)."""
        name = shipping.source_line(fn)
        reads = shipping.Reads() if watch else None
        describer = self._describer(reads)
        ref = describer.function(fn, what=name)
        call_args = [
            describer.value(a, owner=name, name=f"argument {i}") for i, a in enumerate(args)
        ]
        call_kwargs = {
            k: describer.value(v, owner=name, name=f"argument {k!r}") for k, v in kwargs.items()
        }
        call = (ref, call_args, call_kwargs)
        fingerprint = _fingerprint(describer.functions)
        snapshot = None
        if reads is not None and fingerprint is not None and shipping.plain_bytes(call) is not None:
            snapshot = reads.snapshot()
        volatile = reads.volatile if reads is not None else []
        return _Described(fn, args, kwargs, name, describer, call, fingerprint, snapshot, volatile)

    def _check_kept_description(self, kept: _Described) -> None:
        """``STRATAGEM_CHECK_KEPT_DESCRIPTIONS=1``: the kept description is what a new one
        would be, or an ``AssertionError`` names the first difference."""
        fresh = self._describe(kept.fn, kept.args, kept.kwargs, watch=False)
        then, now = kept.fingerprint or {}, fresh.fingerprint or {}
        differences = [
            f"table entry {k}: kept {kept.table.get(k)!r}, new {fresh.table.get(k)!r}"
            for k in sorted({*then, *now})
            if then.get(k) != now.get(k)
        ]
        calls = [(kept.ref, kept.call_args, kept.call_kwargs), (fresh.ref, fresh.call_args,
                 fresh.call_kwargs)]  # fmt: skip
        if shipping.plain_bytes(calls[0]) != shipping.plain_bytes(calls[1]):
            differences.append(f"the function and arguments: kept {calls[0]!r}, new {calls[1]!r}")
        if kept.accumulators.keys() != fresh.accumulators.keys() or any(
            fresh.accumulators[k] is not v for k, v in kept.accumulators.items()
        ):
            differences.append("the accumulators")
        if differences:
            raise AssertionError(
                f"schedule({kept.name}) kept the last description, but a new one differs: "
                + "; ".join(differences)
            )

    def _describer(self, reads: shipping.Reads | None = None) -> shipping.Describer:
        """A describer whose specials (``_special``) may describe what they hold with it."""
        describer: shipping.Describer

        def special(value: Any) -> dict[str, Any] | None:
            return self._special(value, describer)

        describer = shipping.Describer(
            special=special,
            special_types=_SPECIAL_TYPES,
            special_objects=(self.strategy, self),
            reads=reads,
        )
        return describer

    def _special(self, value: Any, describer: shipping.Describer) -> dict[str, Any] | None:
        if isinstance(value, torch.Tensor):
            return self._tensor(value)
        if isinstance(value, sg_data.Dataset):
            return {"recipe": _recipe(value, describer)}
        if isinstance(value, PerWorkerDistributedDataset):
            dataset = describer.value(value.dataset, owner=repr(value), name="its dataset")
            return {"distribute": dataset, "fetch": _fetch_option(value.options)}
        if isinstance(value, PerWorkerDistributedDatasetsFromFunction):
            fn = describer.function(value.dataset_fn, what=shipping.source_line(value.dataset_fn))
            return {"from_function": fn, "fetch": _fetch_option(value.options)}
        if isinstance(value, PerWorkerIterator):
            return {"iterator": value.iterator_id}
        if isinstance(value, PerWorkerDataset):
            return {"dataset": value.dataset_id}
        if value is self.strategy:
            return {"strategy": True}
        if value is self:
            return {"coordinator": True}
        if isinstance(value, RemoteValue):
            raise TypeError(
                f"{value!r} is passed to schedule: fetch it first (coordinator.fetch); a "
                "RemoteValue does not travel to another worker here yet"
            )
        return None

    def _tensor(self, value: torch.Tensor) -> dict[str, Any] | None:
        """A variable on the ps goes as its shards (the worker binds its copy to them); a
        buffer of a module built in the scope as a key and its value (the worker's own from
        then on); any other tensor by value (None: the describer's default)."""
        shards = self._seam.shards_of(value)
        if shards is not None:
            return {
                "variable": [
                    [s.variable, s.index, s.start, s.rows, s.nbytes, s.ps] for s in shards
                ],
                "shape": list(value.shape),
                "dtype": str(value.dtype).removeprefix("torch."),
                "trainable": bool(value.requires_grad),
            }
        if scope_hooks.owner_of(value) is self.strategy:
            key = self._buffer_keys.get(value)
            if key is None:
                key = self._buffer_keys[value] = len(self._buffer_keys)
            return {"buffer": key, "value": value.detach()}
        if isinstance(value, torch.nn.Parameter):
            raise TypeError(
                f"a parameter of shape {tuple(value.shape)} was created outside "
                "ParameterServerStrategy.scope(): it has no variable on the ps for a worker to "
                "update. Build the model inside strategy.scope()"
            )
        return None

    # ------------------------------------------------------------ the dispatch threads

    def _idle(self) -> bool:
        made = all(self._replayed.get(r, 0) == len(self._resources) for r, _ in self._workers)
        return not self._queue and self._inflight == 0 and made

    def _writes_ended(self) -> int:
        """How many writes to the ps have ended (the lock is held): the runs of functions
        (each may have pushed) and the chief's own requests that changed the ps."""
        return self._finished + self._seam.writes

    def _table_id(self, fingerprint: dict[str, bytes] | None) -> int | None:
        """The number of a function's table (the lock is held): the last one's when the two
        are the same, a new one else; None for a table a worker may not keep."""
        if fingerprint is None:
            return None
        last = self._last_table
        if last is not None and (last[0] is fingerprint or last[0] == fingerprint):
            return last[1]
        self._next_id += 1
        self._last_table = (fingerprint, self._next_id)
        return self._next_id

    def _call_numbers(
        self, closure: _Closure, sent: collections.deque[tuple[int, int]]
    ) -> list[int]:
        """Number a run of ``closure`` on a worker (the lock is held): ``[call, since]``.

        ``sent`` holds that worker's recent runs (on this connection) as ``(call, writes
        ended when it was sent)``. A copy the worker wrote from the ps during call n holds
        every write that had ended when n was sent; so ``since``, the first such call after
        which the writes ``closure`` must see (those ended when it was scheduled) had all
        ended, tells the worker which copies it need not pull again. Functions scheduled ahead
        of the one running (a loop that keeps several in flight) pull nothing as a rule; one
        scheduled after ``join`` pulls what was pushed since."""
        self._calls += 1
        call = self._calls
        sent.append((call, self._writes_ended()))
        since = next(n for n, ended in sent if ended >= closure.must_see)
        return [call, since]

    def _run_ended(self, closure: _Closure) -> None:
        """A function's run on a worker ended, however (the lock is held): what it pushed is
        on the ps, so the chief's copies of the variables are behind until the next pull."""
        self._inflight -= 1
        self._finished += 1
        self._running.pop(closure.cid, None)

    def refresh(self) -> None:
        """Bring the chief's copies of the ps's variables up to date when a function ended
        since they were last pulled (TF's chief reads its variables from the ps).

        Called by ``join``, by ``fetch`` once nothing is queued or running, and by a hook
        before each forward and ``state_dict`` of a module built in the chief's scope
        (``ps.chief_reads``): the chief never computes on or saves parameters older than the
        functions that ended before the read. Cheap (a comparison) when nothing ended.
        """
        with self._lock:
            finished = self._finished
        if finished == self._fresh:
            return
        with self._pull_lock:  # one pull at a time; a read that waited finds it done
            if finished > self._fresh:
                self._seam.pull()
                self._fresh = finished

    def _refresh_when_idle(self) -> None:
        """``fetch``'s: refresh once every scheduled function has ended (the value fetched
        last is the program's next read of the model); while others run, reads refresh
        themselves (the hooks), and a fetch costs no pull."""
        with self._lock:
            idle = not self._queue and self._inflight == 0
        if idle:
            self.refresh()

    def _raise_if_error(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    @staticmethod
    def _cancelled(closure: _Closure, error: BaseException) -> CancelledError:
        return CancelledError(
            f"{closure.name} was cancelled: an earlier function failed ({error}). Schedule it again"
        )

    def _fail(self, error: BaseException) -> None:
        """Keep the first error; cancel what is still queued, and what still runs (the lock
        is held)."""
        if self._error is None:
            self._error = error
        while self._queue:
            closure = self._queue.popleft()
            closure.value.settle(error=self._cancelled(closure, error))
        stop: dict[int, list[int]] = {}  # worker rank -> the closures it is to stop
        for cid, (closure, rank) in self._running.items():
            if closure.cancelled is None:
                closure.cancelled = CancelledError(
                    f"{closure.name} was cancelled while it ran on {self._world.describe(rank)}: "
                    f"an earlier function failed ({error}). Schedule it again"
                )
                stop.setdefault(rank, []).append(cid)
        for rank, cids in stop.items():
            threading.Thread(
                target=self._tell_to_cancel,
                args=(rank, cids),
                name=f"stratagem-cancel-{rank}",
                daemon=True,
            ).start()
        self._lock.notify_all()

    def _tell_to_cancel(self, rank: int, cids: list[int]) -> None:
        """Tell worker ``rank`` to stop these functions (TF's cancellation of in-flight
        functions), on a connection of its own: the dispatch thread's waits for the run's
        reply. A worker that is gone, or cannot be reached, has nothing left to stop."""
        try:
            with self._control_lock:  # one connection per worker, one cancellation at a time
                connection = self._control.get(rank)
                if connection is None or connection.closed:
                    connection = self._control[rank] = self._connect(rank)
                self._ask(rank, connection, "cancel", [cids], "a cancellation")
        except Exception as e:  # the functions' values are cancelled all the same
            print(
                f"could not tell {self._world.describe(rank)} to stop the cancelled functions "
                f"{cids} ({type(e).__name__}: {e}); their outcome is not taken",
                file=sys.stderr,
            )

    def _start_dispatch(self, rank: int, connection: Connection) -> None:
        """Start worker ``rank``'s dispatch thread (at the start, and when it rejoins)."""
        thread = threading.Thread(target=self._dispatch, args=(rank, connection), daemon=True)
        self._threads.append(thread)
        thread.start()

    def _dispatch(self, rank: int, connection: Connection) -> None:
        replayed = 0  # the per-worker resources this worker has made
        sent: collections.deque[tuple[int, int]] = collections.deque(maxlen=64)
        # The table this worker keeps (the last one it was sent): its number, its entries'
        # fingerprints.
        kept: list[Any] = [None, None]
        while True:
            with self._lock:
                self._lock.wait_for(
                    lambda replayed=replayed: (
                        self._closing
                        or replayed < len(self._resources)
                        or (self._queue and self._error is None)
                    )
                )
                if replayed < len(self._resources):
                    method, args, what = self._resources[replayed]
                    closure = None
                elif self._queue and self._error is None:
                    closure = self._queue.popleft()
                    self._inflight += 1
                    self._running[closure.cid] = (closure, rank)
                    calls = self._call_numbers(closure, sent)
                else:
                    return  # closing, nothing left for this worker
            if closure is None:
                if not self._make_resource(rank, connection, method, args, what):
                    return
                replayed += 1
                with self._lock:
                    self._replayed[rank] = replayed
                    self._lock.notify_all()
                continue
            if not self._run(rank, connection, closure, calls, kept):
                return

    def _make_resource(
        self, rank: int, connection: Connection, method: str, args: list[Any], what: str
    ) -> bool:
        try:
            outcome = self._ask(rank, connection, method, args, what)
        except PeerLostError as e:
            self._lost(rank, e)
            return False
        except Exception as e:  # stuck (timed out), or it answered outside the protocol
            connection.close()
            with self._lock:
                self._fail(RuntimeError(f"{what} on {self._world.describe(rank)} failed: {e}"))
            self._lost(rank, e)
            return False
        if "error" in outcome:
            with self._lock:
                self._fail(
                    _raised_on_worker(
                        outcome["error"],
                        lambda t, m: f"{what} failed on {self._world.describe(rank)}: {t}: {m}",
                    )
                )
        return True

    def _run(
        self,
        rank: int,
        connection: Connection,
        closure: _Closure,
        calls: list[int],
        kept: list[Any],
    ) -> bool:
        call = [*closure.call, calls, closure.table_id]
        entries, kept_id, kept_entries = closure.entries, kept[0], kept[1]
        if closure.table_id is not None and kept_id == closure.table_id:
            call[1] = None  # the worker has this table: its number says which
            self.tables_sent_by_number += 1
        elif (
            entries is not None
            and kept_entries is not None
            and entries.keys() == kept_entries.keys()
        ):
            # The same entries as the table the worker keeps, some changed (a step counter of
            # fit's): those alone, and the number of the table they change.
            table = closure.call[1]
            call[1] = {k: table[k] for k, f in entries.items() if kept_entries[k] != f}
            call.append(kept_id)
            self.tables_sent_as_changes += 1
        kept[:] = [closure.table_id, entries]
        try:
            outcome = self._ask(rank, connection, "run", call, f"the function {closure.name}")
        except (PeerLostError, CollectiveTimeoutError) as e:
            # Ended, or stopped answering (stopped or stuck: no note for the operation
            # timeout): as TF's, another worker runs the function (unless it was cancelled).
            # A stuck worker that comes back may still push what it computed, as in TF; its
            # value is not taken (the connection is closed), and the function's value is set
            # once.
            connection.close()
            with self._lock:
                self._run_ended(closure)
                if closure.cancelled is not None:
                    closure.value.settle(error=closure.cancelled)
                else:
                    self._queue.appendleft(closure)
                self._lock.notify_all()
            self._lost(rank, e)
            return False
        except Exception as e:  # it answered outside the protocol
            connection.close()
            error = RuntimeError(f"{closure.name} on {self._world.describe(rank)} failed: {e}")
            with self._lock:
                self._run_ended(closure)
                closure.value.settle(error=error)
                self._fail(error)
            self._lost(rank, e)
            return False
        with self._lock:
            self._run_ended(closure)
            if closure.cancelled is not None:
                # Cancelled while it ran (an earlier function failed): whatever it ended with,
                # its value is the cancellation, and its error (the cancellation itself, as a
                # rule) is not a new one for join to raise; its metric totals are not taken.
                closure.value.settle(error=closure.cancelled)
            elif "error" in outcome:
                error = _raised_on_worker(
                    outcome["error"],
                    lambda t, m: f"{closure.name} raised {t} on {self._world.describe(rank)}: {m}",
                )
                closure.value.settle(error=error)
                self._fail(error)
            else:
                totals = outcome.get("totals", {})

                def merge() -> None:
                    # Once per function (a rerun's totals never count twice), and before the
                    # value is seen: a metric read after fetch() includes this function.
                    shipping.add_totals(closure.accumulators, totals)
                    self.completed += 1

                closure.value.settle(outcome["value"], merge=merge)
            # An ended run changes only what join waits for (an error, nothing in flight):
            # waking it (and every waiting dispatch thread) at each of a fit epoch's functions
            # had the chief's main thread take the GIL from the dispatch thread about to send
            # the next function (reply to next send: 360 us in fit, 75-135 in a custom loop).
            if self._error is not None or self._inflight == 0:
                self._lock.notify_all()
        return True

    def _lost(self, rank: int, error: BaseException) -> None:
        with self._control_lock:  # a rejoined incarnation gets a connection of its own
            control = self._control.pop(rank, None)
        if control is not None:
            control.close()
        with self._lock:
            self._workers = [(r, c) for r, c in self._workers if r != rank]
            if not self._workers and not self._closing:
                if self._expect_rejoin:
                    self._all_lost_at = time.monotonic()
                else:
                    self._fail(RuntimeError(f"every worker was lost; the last: {error}"))
            self._lock.notify_all()
            if self._closing:
                return
            waiting = self._all_lost_at is not None and not self._workers
        who = self._world.describe(rank)
        if waiting:
            patience = Timeouts.from_env().rendezvous
            print(
                f"{error}; every worker is lost: waiting up to {patience:g} s for a restarted one "
                "to rejoin (--restart-workers; STRATAGEM_RENDEZVOUS_TIMEOUT)",
                file=sys.stderr,
            )
        elif self._expect_rejoin:
            print(f"{error}; the other workers take its work until {who} rejoins", file=sys.stderr)
        else:  # a worker restarted by hand (STRATAGEM_TASK_INCARNATION) may still rejoin
            print(f"{error}; the other workers take its work", file=sys.stderr)
        threading.Thread(
            target=self._await_rejoin,
            args=(rank,),
            name=f"stratagem-rejoin-{rank}",
            daemon=True,
        ).start()

    def _await_rejoin(self, rank: int) -> None:
        """Wait for a newer incarnation of lost worker ``rank`` (restarted by the launcher);
        connect to it, and give it a dispatch thread that replays the per-worker resources
        from the start of the log before its first function. Ends at shutdown."""
        world = self._world
        known = self._incarnations.get(rank, 1)
        while True:
            with self._lock:
                if self._lock.wait_for(lambda: self._closing, timeout=_REJOIN_POLL_S):
                    return
                self._give_up_when_none_rejoins()
            # ``state`` looks the rank up again once its known process has ended.
            if world.state(rank) != "alive" or world.incarnations[rank] <= known:
                continue
            incarnation = world.incarnations[rank]
            try:
                connection = self._connect(rank)
            except PeerLostError:
                known = incarnation  # it ended again before we met: wait for the next one
                continue
            try:
                self._ask(rank, connection, "hello", self._hello, "the coordinator's hello")
            except PeerLostError:
                connection.close()
                known = incarnation
                continue
            except Exception as e:  # another program, or it answered outside the protocol
                connection.close()
                with self._lock:
                    self._fail(
                        RuntimeError(
                            f"{world.describe(rank)} rejoined (incarnation {incarnation}) but "
                            f"cannot serve this coordinator: {e}"
                        )
                    )
                return
            with self._lock:
                if self._closing:
                    connection.close()
                    return
                self._incarnations[rank] = incarnation
                self._replayed[rank] = 0
                self._all_lost_at = None
                self._workers.append((rank, connection))
                self._start_dispatch(rank, connection)
                resources = len(self._resources)
                self._lock.notify_all()
            print(
                f"{world.describe(rank)} restarted (incarnation {incarnation}); rejoined the "
                f"coordinator (it remakes {resources} per-worker resources, then takes work)",
                file=sys.stderr,
                flush=True,
            )
            return

    def _give_up_when_none_rejoins(self) -> None:
        """Every worker lost, none back within the rendezvous timeout: fail what is queued, as
        without restarts (the lock is held)."""
        patience = Timeouts.from_env().rendezvous
        lost_at = self._all_lost_at
        if lost_at is None or self._workers or time.monotonic() - lost_at <= patience:
            return
        self._all_lost_at = None
        self._fail(
            RuntimeError(
                f"every worker was lost and none rejoined within {patience:g} s "
                "(STRATAGEM_RENDEZVOUS_TIMEOUT): the launcher's --restart-workers ran out, or "
                "the restarted workers could not start"
            )
        )

    def _connect(self, rank: int) -> Connection:
        """A connection to worker ``rank`` (proving the job's secret)."""
        world = self._world
        return Connection(
            world.address(rank),
            me=world.name,
            peer=world.describe(rank),
            secret=world.secret,
            timeout=Timeouts.from_env().operation,
        )

    def _ask(
        self, rank: int, connection: Connection, method: str, args: list[Any], what: str
    ) -> Any:
        world = self._world
        return connection.call(
            method,
            args,
            what=what,
            silent=world.silent,
            peer_ended=lambda: world.has_ended(rank),
        )

    # -------------------------------------------------------------------------- the end

    def shutdown(self) -> None:
        """At exit (or when called): cancel what is queued, let what runs finish, and tell each
        worker it may stop serving."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            pending = list(self._queue)
            self._queue.clear()
            for closure in pending:
                closure.value.settle(
                    error=CancelledError(f"{closure.name}: the coordinator shut down")
                )
            self._lock.notify_all()
        for thread in self._threads:
            thread.join()
        for rank, connection in self._workers:
            try:
                self._ask(rank, connection, "goodbye", [], "the coordinator's goodbye")
            except PeerLostError:
                pass
            finally:
                connection.close()
        with self._control_lock:
            control, self._control = list(self._control.values()), {}
        for connection in control:
            connection.close()


def _recipe(dataset: sg_data.Dataset, describer: shipping.Describer) -> list[Any]:
    """``dataset``'s recipe as plain data: each step's method and its arguments described
    (tensors by value, functions by reference)."""
    steps = dataset.recipe()
    if steps is None:
        raise TypeError(
            f"{dataset!r} cannot be sent to the workers: a stage of it was not made by "
            "sg.data.Dataset's own methods (prefetch_to_device, say), so no worker can make it "
            "again; build it inside a dataset_fn instead"
        )
    return [
        [method, [describer.value(a, owner=f"dataset.{method}", name=f"argument {i}")
                  for i, a in enumerate(args)]]
        for method, args in steps
    ]  # fmt: skip


def _fetch_option(options: Any) -> bool | None:
    """A distributed dataset's ``InputOptions``, as the one field that travels."""
    return None if options is None else bool(options.experimental_fetch_to_device)
