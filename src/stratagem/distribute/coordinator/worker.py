"""A worker task of a cluster with a chief: it serves the chief's ``ClusterCoordinator``.

``sg.distribute.Server(...)`` on a ``worker`` task builds a ``WorkerServer``: it listens on the
task's address (``comm.messages``; the chief is its only client), joins the job's world, and
``join()`` serves until the chief says goodbye or ends, then tells each ps it is done. Its fixed
table: ``hello`` (the chief's program must hash as this task's), ``make_dataset``,
``make_iterator``, ``run``, ``cancel`` (the function stops with ``CancelledError`` at its next
iterator ``next()`` or optimizer step) and ``goodbye``. A function arrives by reference and is
rebuilt from this task's copy of the program, or its last objects are called again when the
table is the same and the last call left them as built (``shipping.unchanged``). It runs on the
connection's thread, returns plain data, and an error comes back as type, message and traceback.
Variables are the ps's: a step pushes gradients and gets new values, a copy is pulled before a
call unless it holds every write the call must see, and what a call changes of one that does
not train (a counter, BatchNorm's statistics) goes back as an addition.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.futures import Future

from stratagem import data as sg_data
from stratagem import shipping
from stratagem.cluster import ClusterResolver
from stratagem.comm import plain_data
from stratagem.comm.messages import Here, Later
from stratagem.comm.process_group import Timeouts
from stratagem.comm.rpc_world import rpc_name, serve_and_join
from stratagem.distribute.coordinator.remote_values import CancelledError
from stratagem.distribute.machinery.input import InputOptions
from stratagem.distribute.partitioners import Shard

_current_worker_index: int | None = None
# The scheduled function the current thread runs (its closure id), for cancellation.
_running = threading.local()


def experimental_get_current_worker_index() -> int:
    """The index of the worker running the current scheduled function (TF's
    ``tf.distribute.coordinator.experimental_get_current_worker_index``)."""
    if _current_worker_index is None:
        raise RuntimeError(
            "experimental_get_current_worker_index() is for a function scheduled by a "
            "ClusterCoordinator, running on a worker task; this process is not serving one"
        )
    return _current_worker_index


def check_same_program(program: Any, sha: Any, *, me: str, root: Path) -> None:
    """Refuse a chief whose program (its path under the program root, its sha256) is not this
    task's: a function reference means the same code only in the same program."""
    if program is None:
        return  # the chief has no program file (a notebook): each reference's file is checked
    mine = shipping.program_file()
    name = mine.relative_to(root).as_posix() if mine is not None else None
    if name != program:
        raise ValueError(
            f"the chief runs {program!r} and {me} runs {name or 'no program file'!r}: every "
            "task of a job runs one program"
        )
    if shipping.file_hash(mine) != sha:
        raise ValueError(
            f"{me}'s copy of {program} differs from the chief's: every task must run the same "
            "program"
        )


class CoordinatorOnWorker:
    """What a function that captured the coordinator finds on a worker: scheduling is the
    chief's alone (TF's coordinator runs only on the chief)."""

    def __init__(self, where: str) -> None:
        self._where = where

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(
            f"ClusterCoordinator.{name} was called from a function running on {self._where}: "
            "only the chief (the coordinator) schedules, joins and fetches"
        )


class WorkerServer:
    """This worker task, serving the chief's scheduled functions until the chief is done."""

    def __init__(self, resolver: ClusterResolver) -> None:
        global _current_worker_index
        spec = resolver.cluster_spec()
        task_id = resolver.task_id or 0
        timeouts = Timeouts.from_env()
        self.address = spec.task_address("worker", task_id)
        self.me = f"worker {task_id} ({self.address})"
        self.root = shipping.program_root()
        self._datasets: dict[int, Any] = {}
        self._iterators: dict[int, Iterator[Any]] = {}
        self._classes: dict[tuple, type] = {}  # the program's classes made here, per worker
        self._local_buffers: dict[int, torch.Tensor] = {}  # the chief's buffer key -> this worker's
        self._ready: Future = Future()  # set once the strategy below exists
        self._cancelled: set[int] = set()  # closure ids the chief cancelled while they ran
        self._cancel_lock = threading.Lock()
        self._goodbye = threading.Event()
        self.functions_run = 0
        self._kept_table = shipping.KeptTable(self.me)  # the last numbered table sent
        self._kept_call: _KeptCall | None = None  # the last call's objects, while unchanged
        self.server, self.world = serve_and_join(
            resolver,
            me=self.me,
            address=self.address,
            clients=[rpc_name("chief", 0)],
            methods=self._methods(),
            operation_timeout=timeouts.operation,
            rendezvous_timeout=timeouts.rendezvous,
        )
        from stratagem.distribute.parameter_server_strategy import CoordinatorSeam

        # The strategy scheduled functions see (``strategy`` captured on the chief): one
        # replica, the chief's variables on the ps, pushes applied there.
        self._seam = CoordinatorSeam.for_worker_task(resolver, self.world)
        # A cancelled function stops at its next optimizer step (a push to the ps).
        self._seam.guard_steps(self._raise_if_cancelled)
        # Its index among the W workers (its input pipeline), as the strategy reads it.
        self.worker_index = self._seam.worker_index
        _current_worker_index = self.worker_index
        self._ready.set_result(None)

    # --------------------------------------------------------------------- the method table

    def _methods(self) -> dict[str, Callable[..., Any]]:
        return {
            "hello": self._hello,
            "make_dataset": self._make_dataset,
            "make_iterator": self._make_iterator,
            "run": self._run,
            "cancel": self._cancel,
            "goodbye": self._goodbye.set,
        }

    def _cancel(self, closure_ids: Any) -> None:
        """The chief cancelled these functions (an earlier one failed): each stops at its next
        ``next()`` of a per-worker iterator or optimizer step, if it still runs here."""
        if not isinstance(closure_ids, list) or not all(type(c) is int for c in closure_ids):
            raise ValueError(f"cancel takes a list of closure ids; got {closure_ids!r}")
        with self._cancel_lock:
            self._cancelled.update(closure_ids)

    def _raise_if_cancelled(self) -> None:
        """In a scheduled function's thread: raise ``CancelledError`` if the chief cancelled it."""
        cid = getattr(_running, "closure_id", None)
        if cid is None:
            return
        with self._cancel_lock:
            cancelled = cid in self._cancelled
        if cancelled:
            raise CancelledError(
                f"the scheduled function {cid} was cancelled on {self.me}: an earlier function "
                "failed"
            )

    def _hello(self, program: Any, sha: Any, compression: Any = None) -> Later:
        # The chief may greet this server before its strategy is made (the server listens
        # from before the roll call): the answer waits for it.
        return Later(
            self._ready,
            lambda: (f"{self.me} is still joining the job", []),
            lambda _: self._greet(program, sha, compression),
        )

    def _greet(self, program: Any, sha: Any, compression: Any) -> dict[str, Any]:
        check_same_program(program, sha, me=self.me, root=self.root)
        self._seam.use_compression(compression)
        self._seam.forget_calls()  # a chief (a new one, maybe) numbers its calls from 1
        self._kept_table = shipping.KeptTable(self.me)  # and its tables
        self._kept_call = None
        return {"worker_index": self.worker_index}

    def _resolve(
        self, entry: dict[str, Any], pull: list[torch.Tensor], rebuilder: shipping.Rebuilder
    ) -> Any:
        if "variable" in entry:
            shards = [Shard(*(int(x) for x in s)) for s in entry["variable"]]
            p = self._seam.bind_variable(
                shards,
                tuple(int(n) for n in entry["shape"]),
                shipping.dtype_named(str(entry["dtype"])),
                bool(entry["trainable"]),
            )
            pull.append(p)
            return p
        if "buffer" in entry:
            value = entry["value"]
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"a buffer is a tensor; got {type(value).__name__}")
            # This worker's own from the first call on (TF's local variables).
            return self._local_buffers.setdefault(int(entry["buffer"]), value.clone())
        if "iterator" in entry:
            return _CancellableIterator(
                self._iterators[int(entry["iterator"])], self._raise_if_cancelled
            )
        if "dataset" in entry:
            return self._datasets[int(entry["dataset"])]
        if "recipe" in entry:  # an sg.data.Dataset: this worker's own copy
            steps = entry["recipe"]
            if not isinstance(steps, list) or not all(
                isinstance(step, list) and len(step) == 2 and isinstance(step[1], list)
                for step in steps
            ):
                raise ValueError(f"a dataset recipe is a list of [method, args]; got {steps!r}")
            return sg_data.Dataset.from_recipe(
                [[method, [rebuilder.value(a) for a in args]] for method, args in steps]
            )
        if "distribute" in entry:  # experimental_distribute_dataset, built by this worker
            return self._seam.strategy.experimental_distribute_dataset(
                rebuilder.value(entry["distribute"]), _input_options(entry)
            )
        if "from_function" in entry:  # distribute_datasets_from_function, likewise
            return self._seam.strategy.distribute_datasets_from_function(
                rebuilder.value(entry["from_function"]), _input_options(entry)
            )
        if "strategy" in entry:
            return self._seam.strategy
        if "coordinator" in entry:
            return CoordinatorOnWorker(self.me)
        raise ValueError(f"unknown reference {entry!r}")

    def _rebuilder(self, table: Any, pull: list[torch.Tensor]) -> shipping.Rebuilder:
        rebuilder: shipping.Rebuilder

        def resolve(entry: dict[str, Any]) -> Any:
            return self._resolve(entry, pull, rebuilder)

        rebuilder = shipping.Rebuilder(
            table, root=self.root, resolve_special=resolve, classes=self._classes
        )
        return rebuilder

    def _guarded(self, body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        try:
            outcome = body()  # {"value": ..., and what else the chief gets back}
            plain_data.check(outcome["value"], what="the function's return value")
            return outcome
        except BaseException as e:
            # The worker's own frames (this module) are not the user's story: start at theirs.
            tb = e.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
                tb = tb.tb_next
            text = "".join(traceback.format_exception(type(e), e, tb))
            return {"error": [type(e).__name__, str(e), text]}

    def _here(self, body: Callable[[], dict[str, Any]], what: str) -> Here:
        """Run ``body`` on the connection's thread; the reply is its outcome, and until then
        the chief hears that it runs here (a long function is not a silence)."""

        def work() -> dict[str, Any]:
            # As a fresh thread starts: an earlier call may have switched gradients off with
            # torch.set_grad_enabled(False) (not a context manager) and left them so.
            torch.set_grad_enabled(True)
            return self._guarded(body)

        return Here(work, lambda: (f"{what} runs on {self.me}", [self.world.name]))

    def _make_dataset(
        self, ds_id: int, table: Any, key: Any, call: Any = True, seed: Any = None
    ) -> Here:
        """This worker's per-worker dataset: ``dataset_fn()`` (``call``), or the dataset sent
        (made here from its recipe). Unseeded shuffles made meanwhile take their seeds from the
        chief's ``seed`` and this worker's index: each worker its own order, as in TF."""
        if seed is not None and type(seed) is not int:
            raise ValueError(f"make_dataset's seed is an int or None; got {seed!r}")

        def make() -> dict[str, Any]:
            scope = (
                contextlib.nullcontext()
                if seed is None
                else sg_data.seed_scope(sg_data.derive_seed(seed, self.worker_index))
            )
            with scope:
                rebuilder = self._rebuilder(table, [])
                if call:
                    made = rebuilder.entry_point(key, "create_per_worker_dataset's dataset_fn")()
                else:
                    made = rebuilder.value(key)
                self._datasets[int(ds_id)] = made
            return {"value": None}

        return self._here(make, "dataset_fn")

    def _make_iterator(self, it_id: int, ds_id: int) -> Here:
        def make() -> dict[str, Any]:
            self._iterators[int(it_id)] = iter(self._datasets[int(ds_id)])
            return {"value": None}

        return self._here(make, "iter() of a per-worker dataset")

    def _run(
        self,
        closure_id: int,
        table: Any,
        key: Any,
        args: Any,
        kwargs: Any,
        calls: Any,
        table_id: Any,
        changes_to: Any = None,
    ) -> Here:
        table, by_number, sent_changes = self._kept_table.receive(table, table_id, changes_to)
        call, since = _call_numbers(calls)

        def body() -> dict[str, Any]:
            self._seam.begin_call(call)
            kept, self._kept_call = self._kept_call, None
            # A table the worker keeps, after the first of its loop (sent by number, or as a
            # few changed entries: fit's step counter): worth watching.
            same = (
                _same_call(key, args, kwargs)
                if table_id is not None and (by_number or sent_changes is not None)
                else None
            )
            if (
                kept is not None
                and same is not None
                and kept.same == same
                and kept.table_id == (table_id if by_number else changes_to)
                and kept.call[0].restarted(table, sent_changes or {})
            ):
                # The table the last call ran on (or it with new values of volatile
                # attributes), the same function and arguments, and the last call left its
                # objects as they were built: restarted, they are what a rebuild would make
                # (TF's worker runs the function it was sent once).
                rebuilder, fn, call_args, call_kwargs, pull = kept.call
                kept.table_id = table_id
            else:
                pull = []
                rebuilder = self._rebuilder(table, pull)
                fn = rebuilder.entry_point(key, "the scheduled function")
                call_args = [rebuilder.value(a) for a in args]
                call_kwargs = {k: rebuilder.value(v) for k, v in kwargs.items()}
                snapshot = (
                    None
                    if same is None
                    else shipping.watch(rebuilder.built, [fn, call_args, call_kwargs])
                )
                kept = (
                    None
                    if snapshot is None
                    else _KeptCall(
                        same, table_id, snapshot, (rebuilder, fn, call_args, call_kwargs, pull)
                    )
                )
            if pull:
                # The variables' values as of this call's start, unless this copy has them:
                # written from the ps during call `since` or later, after every write the
                # function must see (the chief's, and those of functions that ended before
                # it was scheduled), and not changed here since.
                self._seam.pull_unless_fresh(list({id(p): p for p in pull}.values()), since)
            self.functions_run += 1
            # The variables it does not train (a step counter): what it changes of them goes
            # to the ps as an addition (TF's assign_add runs on the ps).
            fixed = {id(p): (p, p.detach().clone()) for p in pull if not p.requires_grad}
            _running.closure_id = int(closure_id)
            try:
                value = fn(*call_args, **call_kwargs)
            finally:
                _running.closure_id = None
                with self._cancel_lock:
                    self._cancelled.discard(int(closure_id))
                changes = [(p, p.detach() - before) for p, before in fixed.values()
                           if not torch.equal(p.detach(), before)]  # fmt: skip
                if changes:
                    self._seam.assign_add(changes)
            if kept is not None and kept.snapshot.unchanged():
                self._kept_call = kept  # (not after a call that raised: kept stays None)
            return {"value": value, "totals": shipping.totals_of(rebuilder.accumulators)}

        return self._here(body, f"the scheduled function {closure_id}")

    # --------------------------------------------------------------------------- serving

    def join(self) -> None:
        """Serve until the chief says goodbye (or ends), then tell each ps this worker is done."""
        world = self.world
        chief = world.ranks("chief")[0]
        try:
            while not self._goodbye.wait(0.25):
                if world.has_ended(chief):
                    print(f"{self.me}: the chief ended; this worker stops", file=sys.stderr)
                    break
        finally:
            # Tell each ps this worker is done (a stuck ps is named after the operation
            # timeout), hang up, and leave the world.
            try:
                self._seam.finish()
            finally:
                self.server.close()


class _KeptCall:
    """A call's rebuilt function, arguments and objects, kept for the next call while the chief
    sends the same function and arguments (``same``) on the same table (``table_id``, or that
    table with new values of volatile attributes) and no call changed them."""

    def __init__(
        self, same: bytes, table_id: int, snapshot: shipping.Snapshot, call: tuple
    ) -> None:
        self.same = same
        self.table_id = table_id  # the number of the table its objects are as built from
        self.snapshot = snapshot
        self.call = call


def _same_call(key: Any, args: Any, kwargs: Any) -> bytes | None:
    """What makes two runs on one table the same call: the function's entry and the
    arguments' (``shipping.plain_bytes``: None where they hold a tensor)."""
    return shipping.plain_bytes([key, args, kwargs])


class _CancellableIterator:
    """A per-worker iterator as a scheduled function gets it: each ``next()`` first checks that
    the chief has not cancelled the function (its other attributes are the iterator's)."""

    def __init__(self, iterator: Iterator[Any], check: Callable[[], None]) -> None:
        self._iterator = iterator
        self._check = check

    def __iter__(self) -> _CancellableIterator:
        return self

    def __next__(self) -> Any:
        self._check()
        return next(self._iterator)

    def get_next(self) -> Any:
        """TF's ``iterator.get_next()``: ``next()``."""
        return self.__next__()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._iterator, name)


def _call_numbers(calls: Any) -> tuple[int, int]:
    """A run's ``[call, since]``: its number among the chief's calls, and the first call
    during which a copy written from the ps is recent enough for it (``since <= call``)."""
    if not (
        isinstance(calls, list)
        and len(calls) == 2
        and all(type(n) is int for n in calls)
        and 1 <= calls[1] <= calls[0]
    ):
        raise ValueError(
            f"a run's call numbers are [call, since] with 1 <= since <= call; got {calls!r}"
        )
    return calls[0], calls[1]


def _input_options(entry: dict[str, Any]) -> Any:
    """A distributed dataset's ``InputOptions`` as the chief sent it (its one field)."""
    fetch = entry.get("fetch")
    if fetch is None:
        return None
    if type(fetch) is not bool:
        raise ValueError(f"experimental_fetch_to_device is a bool; got {fetch!r}")
    return InputOptions(experimental_fetch_to_device=fetch)
