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
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from stratagem import data as sg_data
from stratagem import shipping
from stratagem.cluster import is_coordinated
from stratagem.distribute.coordinator.dispatch import Dispatch
from stratagem.distribute.coordinator.remote_values import (
    CancelledError,
    ClosureInputError,
    PerWorkerDataset,
    PerWorkerIterator,
    RemoteValue,
)
from stratagem.distribute.coordinator.transport import WorkerLinks
from stratagem.distribute.coordinator.work_queue import Closure, WorkQueue
from stratagem.distribute.coordinator.worker_loss import WorkerLoss
from stratagem.distribute.machinery import scope_hooks
from stratagem.distribute.machinery.input import (
    PerWorkerDistributedDataset,
    PerWorkerDistributedDatasetsFromFunction,
)
from stratagem.errors import PeerLostError

# What ``ClusterCoordinator._special`` describes, besides its strategy and itself.
_SPECIAL_TYPES = (
    torch.Tensor,
    sg_data.Dataset,
    PerWorkerDistributedDataset,
    PerWorkerDistributedDatasetsFromFunction,
    PerWorkerIterator,
    PerWorkerDataset,
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
        self._links = WorkerLinks(world, self._seam.compression)
        self._work = WorkQueue(
            world.describe, lambda: self._seam.writes, self._links.tell_to_cancel
        )
        self._dispatch = Dispatch(
            self._work, self._links, world.describe, lambda rank, e: self._loss.lost(rank, e)
        )
        self._loss = WorkerLoss(self._work, self._links, world, self._dispatch.start)
        self._buffer_keys: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # How many runs had ended when the chief last pulled.
        self._fresh = 0
        self._pull_lock = threading.Lock()
        self._tables = shipping.TableNumbers()
        self._descriptions = shipping.KeptDescriptions(self._describer)
        workers = self._work.workers
        try:
            for rank in world.ranks("worker"):
                connection = self._links.connect(rank)
                workers.append((rank, connection))
                self._links.hello(rank, connection)
        except BaseException:
            for _, connection in workers:
                connection.close()
            raise
        for rank, connection in workers:
            self._dispatch.start(rank, connection)
        atexit.register(self.shutdown)
        strategy.cluster_coordinator = self

    @property
    def completed(self) -> int:
        """Functions whose value was set (each counted once)."""
        return self._dispatch.completed

    @property
    def tables_sent_by_number(self) -> int:
        """Runs whose worker had their table (``shipping.SentTables``)."""
        return self._dispatch.tables_sent_by_number

    @property
    def tables_sent_as_changes(self) -> int:
        """Runs sent as the entries that changed since their worker's last table."""
        return self._dispatch.tables_sent_as_changes

    @property
    def descriptions_kept(self) -> int:
        """Schedules that used the last one's description (``shipping.KeptDescriptions``)."""
        return self._descriptions.used

    # ----------------------------------------------------------------------- scheduling

    def schedule(
        self, fn: Callable[..., Any], args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> RemoteValue:
        """Queue ``fn(*args, **kwargs)`` for a free worker; its ``RemoteValue``, at once.

        A ``RemoteValue`` among the arguments (in lists, tuples, dicts) is passed as its value,
        as TF's worker passes it: its function finished first (``schedule`` waits for it here,
        where TF's worker raises if it has not run yet); if that function failed, this one
        does not run and fails with ``ClosureInputError`` (``join`` raises it)."""
        self._work.raise_if_error()
        inputs: list[RemoteValue] = []
        args, kwargs = _inputs_resolved((args, kwargs), inputs)
        failed = next((e for e in (v.settled()[1] for v in inputs) if e is not None), None)
        # Variables created in a scope still open are made on the ps before a function uses them.
        self.strategy.extended.adopt_pending()
        described = self._descriptions.describe(fn, args, kwargs or {})
        name, fingerprint = described.name, described.fingerprint
        work = self._work
        with work.lock:
            if work.closing:
                raise RuntimeError(f"schedule({name}) after the coordinator shut down")
            cid = work.new_id()
            closure = Closure(
                cid,
                name,
                [
                    cid,
                    described.table,
                    described.ref,
                    described.call_args,
                    described.call_kwargs,
                ],
                described.accumulators,
                self._refresh_when_idle,
            )
            closure.must_see = work.writes_ended()
            closure.table_id = self._tables.number(fingerprint, work.new_id)
            closure.entries = fingerprint
            if failed is not None:
                # TF's worker raises ClosureInputError before running it: the function fails.
                error = ClosureInputError(failed)
                closure.value.settle(error=error)
                work.fail(error)
            elif work.error is not None:
                # A function failed while this one was being described (after the check
                # above): it is cancelled as the ones queued then were. Queued behind a pending
                # error, no worker would take it and nothing would cancel it: fetch() would hang.
                closure.value.settle(error=work.cancelled(closure, work.error))
            else:
                work.queue.append(closure)
            work.lock.notify_all()
        # Let a dispatch thread that waits for the GIL have it now (a syscall that releases
        # it): a loop scheduling many functions at once (fit schedules an epoch) otherwise
        # holds it for the switch interval, 5 ms, while a worker waits for its next function.
        time.sleep(0)
        return closure.value

    def join(self) -> None:
        """Wait until every scheduled function has finished; raise the first error one raised
        (then it is cleared, and the functions still queued were cancelled)."""
        work = self._work
        with work.lock:
            work.lock.wait_for(lambda: work.error is not None or work.idle())
            work.lock.wait_for(lambda: work.inflight == 0)
        work.raise_if_error()
        self.refresh()  # the chief's model after join() is the trained one

    def done(self) -> bool:
        """Whether every scheduled function has finished (raises the first error, as ``join``)."""
        self._work.raise_if_error()
        with self._work.lock:
            idle = self._work.idle()
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
        with self._work.lock:
            dataset_id = self._work.new_id()
            args = [dataset_id, describer.functions, ref, call, seed]
            what = f"dataset_fn {name}" if call else f"the dataset {name}"
            self._work.resources.append(("make_dataset", args, what))
            self._work.lock.notify_all()
        return PerWorkerDataset(self, dataset_id)

    def make_iterator(self, dataset: PerWorkerDataset) -> PerWorkerIterator:
        """``iter(per_worker_dataset)``: each worker makes its own iterator of its dataset."""
        with self._work.lock:
            iterator_id = self._work.new_id()
            what = f"iter() of the dataset {dataset.dataset_id}"
            self._work.resources.append(("make_iterator", [iterator_id, dataset.dataset_id], what))
            self._work.lock.notify_all()
            return PerWorkerIterator(iterator_id)

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
        return None

    def _tensor(self, value: torch.Tensor) -> dict[str, Any] | None:
        """A variable on the ps (a parameter, or a state buffer such as BatchNorm's statistics)
        goes as its shards (the worker binds its copy to them); another buffer of a module
        built in the scope as a key and its value (the worker's own from then on); any other
        tensor by value (None: the describer's default)."""
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

    # ------------------------------------------------------------------ the chief's reads

    def refresh(self) -> None:
        """Bring the chief's copies of the ps's variables up to date when a function ended
        since they were last pulled (TF's chief reads its variables from the ps).

        Called by ``join``, by ``fetch`` once nothing is queued or running, and by a hook
        before each forward and ``state_dict`` of a module built in the chief's scope
        (``ps.chief_reads``): the chief never computes on or saves parameters older than the
        functions that ended before the read. Cheap (a comparison) when nothing ended.
        """
        with self._work.lock:
            finished = self._work.finished
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
        with self._work.lock:
            idle = not self._work.queue and self._work.inflight == 0
        if idle:
            self.refresh()

    # -------------------------------------------------------------------------- the end

    def shutdown(self) -> None:
        """At exit (or when called): cancel what is queued, let what runs finish, and tell each
        worker it may stop serving."""
        work = self._work
        with work.lock:
            if work.closing:
                return
            work.closing = True
            pending = list(work.queue)
            work.queue.clear()
            for closure in pending:
                closure.value.settle(
                    error=CancelledError(f"{closure.name}: the coordinator shut down")
                )
            work.lock.notify_all()
        for thread in self._dispatch.threads:
            thread.join()
        for rank, connection in work.workers:
            try:
                self._links.ask(rank, connection, "goodbye", [], "the coordinator's goodbye")
            except PeerLostError:
                pass
            finally:
                connection.close()
        self._links.close_control()


def _inputs_resolved(value: Any, inputs: list[RemoteValue]) -> Any:
    """``value`` with each ``RemoteValue`` in it (lists, tuples, dicts) replaced by its value,
    once its function has finished (None where it failed); those are appended to ``inputs``.
    A container holding none is returned itself (the kept descriptions go by identity)."""
    if isinstance(value, RemoteValue):
        inputs.append(value)
        return value.settled()[0]
    before = len(inputs)
    if type(value) in (list, tuple):
        items = [_inputs_resolved(v, inputs) for v in value]
        return value if len(inputs) == before else type(value)(items)
    if type(value) is dict:
        resolved = {k: _inputs_resolved(v, inputs) for k, v in value.items()}
        return value if len(inputs) == before else resolved
    return value


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
