"""TF's documented coordinator behaviour, each part ported from TF's own tests
(``cluster_coordinator_test.py``): `stratagem run --chief -n 2 --ps 1 THIS OUT`.

- datasets: ``Model.fit`` takes a dataset (TF's tutorial), ``create_per_worker_dataset`` takes
  a dataset (``testPassDatasetToCreatePerWorker
  Dataset``, ``testInputFunctionWithMap``), a distributed dataset made on the chief
  (``testPassDistributedDatasetToCreatePerWorkerDataset``), and each worker shuffles its copy
  its own way (``testDatasetsShuffledDifferently``); ``iter()`` of a distributed dataset on the
  coordinator is a ``ValueError`` (TF's ``DistributedDataset.__iter__`` when not built);
- a non-float variable made in the scope lives on the ps (``testInputFunction``: an int64
  ``tf.Variable`` that workers ``assign_add`` to and the coordinator reads);
- what a function reads: the variables as of its start, with every write that ended before it
  was scheduled (TF's worker reads the ps), yet no pull where the worker's copy came back with
  its last push after those writes (a function queued behind a running one); a copy changed
  on the worker is pulled again;
- what a function captures is what the chief held when it was scheduled, also where a worker
  keeps the last table of plain data it was sent (a value of another type is another table; a
  tensor's table is sent each time);
- a worker calls the objects it built for the last call again when the chief sends the same
  table, function and arguments, unless that call changed them (a list, a module's attribute,
  its hooks, its training flag, an optimizer's learning rate, a global, a closure's cell);
- the chief describes a function scheduled again with the same arguments once, yet each call
  sees what the chief changed before it was scheduled (the same kinds of change, a dict's
  item, an argument's attribute, and whether a variable is trainable);
- a ``RemoteValue`` argument is its value; one whose function failed fails the function it
  is passed to with ``ClosureInputError`` (TF's ``maybe_get_remote_value`` and
  ``ClosureInputError``);
- cancellation (``testCancellation``): a function still running when another fails is
  cancelled (its ``fetch`` raises ``CancelledError``; it stopped on its worker), ``join`` raises
  the failure once, and the coordinator is used again after.

Each part's outcome (or the error it ended with) goes to OUT/result.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

import stratagem as sg
from stratagem.keras.optimizer_recipes import BoundOptimizer

OUT = Path(sys.argv[1])

resolver = sg.distribute.cluster_resolver.TFConfigClusterResolver()
if resolver.task_type in ("worker", "ps"):
    # As in TF scripts: no else, no exit. join() never returns (TF's blocks for ever; ours
    # ends the process when the job is done), so the chief's code below runs on the chief only.
    sg.distribute.Server(resolver).join()

strategy = sg.distribute.ParameterServerStrategy(resolver)
coordinator = sg.distribute.coordinator.ClusterCoordinator(strategy)
with strategy.scope():
    # TF's tf.Variable(initial_value=0, dtype=tf.int64), made in the scope: a ps variable.
    counter = torch.nn.Parameter(torch.tensor(0, dtype=torch.int64), requires_grad=False)
    scalar = torch.nn.Linear(1, 1, bias=False)  # each step below takes 1 from its weight
    torch.nn.init.constant_(scalar.weight, 0.5)  # exact in float32, as is each value after
    norm = torch.nn.BatchNorm1d(2)  # its moving statistics: ps variables that do not train
descent = torch.optim.SGD(scalar.parameters(), lr=1.0)


def one_one():
    return sg.data.Dataset.range(1, 2)


def endless():
    return sg.data.Dataset.range(10).repeat()


def first(iterator):
    return next(iterator)


def add_ten(x):
    return x + 10


def range_fn(input_context):
    return sg.data.Dataset.range(1, 11).batch(4)


def both_read(iterator, barrier: str):
    """Each worker's first batch, read while the other worker holds one too (one each)."""
    me = sg.distribute.coordinator.experimental_get_current_worker_index()
    batch = next(iterator)
    Path(barrier, f"worker-{me}").touch()
    deadline = time.monotonic() + 120
    while len(list(Path(barrier).glob("worker-*"))) < 2:
        if time.monotonic() > deadline:
            raise TimeoutError("the other worker never read its batch")
        time.sleep(0.02)
    return [me, batch.tolist()]


def meet(barrier: str, me: int) -> None:
    """Wait until both workers reached ``barrier`` (each function of a pair holds a worker)."""
    Path(barrier, f"worker-{me}").touch()
    deadline = time.monotonic() + 120
    while len(list(Path(barrier).glob("worker-*"))) < 2:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other worker never reached {barrier}")
        time.sleep(0.02)


def normalise(role: str, marks: str) -> int:
    """One of four functions scheduled at once, each role pinned to a worker by marks, none by
    timing. ``first`` and ``second`` (a pair: one per worker) each make a train-mode forward of
    the BatchNorm from the same read; ``first`` then holds its worker until ``signal``, the
    other worker's next function, says ``second``'s update is on the ps; ``last`` (on the first
    worker: the other is held by ``signal`` until it ends) makes one more forward."""
    me = sg.distribute.coordinator.experimental_get_current_worker_index()
    batch = torch.tensor([[1.0, 2.0], [3.0, 6.0]])
    norm.train()
    if role in ("first", "second"):
        meet(str(Path(marks, "pair")), me)
        norm(batch)
    if role == "first":
        wait_for(str(Path(marks, "second-added")))
    if role == "signal":  # second's worker runs this after second's update reached the ps
        Path(marks, "second-added").touch()
        wait_for(str(Path(marks, "last-ran")))
    if role == "last":
        norm(batch)
        Path(marks, "last-ran").touch()
    return me


def wait_for(path: str) -> None:
    deadline = time.monotonic() + 120
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never came")
        time.sleep(0.02)


def descend(barrier: str, go: str | None = None, scribble: bool = False):
    """One step (the gradient of the weight's sum is 1: the ps takes 1 from it); then, once
    both workers stepped and ``go`` exists, maybe a change of this worker's copy alone."""
    me = sg.distribute.coordinator.experimental_get_current_worker_index()
    descent.zero_grad()
    scalar.weight.sum().backward()
    descent.step()
    meet(barrier, me)
    if go is not None:
        wait_for(go)
    if scribble:
        with torch.no_grad():
            scalar.weight.add_(100.0)  # not pushed: the ps never sees it
    return [me, strategy.extended.client.pulls]


def look(barrier: str):
    """The weight this function reads, and how many pulls its worker has made."""
    me = sg.distribute.coordinator.experimental_get_current_worker_index()
    value = float(scalar.weight.detach())
    meet(barrier, me)
    return [me, value, strategy.extended.client.pulls]


FACTOR: object = 1
BUMPED = torch.zeros(2)


def scale(x):
    return [x * FACTOR, type(FACTOR).__name__]


def bump():
    BUMPED.add_(1.0)  # this worker's copy: the chief's never changes
    return float(BUMPED.sum())


def count(iterator):
    x = next(iterator)
    counter.add_(x)  # TF's v.assign_add(x)
    return int(x)


def read_until_cancelled(iterator, started: str, seen: str):
    """Reads its worker's dataset until cancelled (at most 60 s); writes what stopped it."""
    Path(started).touch()
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            next(iterator)
            time.sleep(0.02)
    except BaseException as e:
        Path(seen).write_text(type(e).__name__)
        raise
    Path(seen).write_text("ran to its end")
    return "not cancelled"


def fail_once_started(started: str):
    deadline = time.monotonic() + 60
    while not Path(started).exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the other function never started")
        time.sleep(0.02)
    raise ValueError("the failure that cancels the rest")


def double(x):
    return 2 * x


def outcome(part):
    """``part()``'s value, or the error it raised (type, message), for the test to judge."""
    try:
        return {"value": part()}
    except Exception as e:  # the test says which part failed, and how
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


def raised(error_type, call):
    try:
        call()
    except error_type as e:
        return f"{type(e).__name__}: {e}"
    return None


def datasets():
    result = {}
    dataset = sg.data.Dataset.range(1, 11).batch(4)
    per_worker = coordinator.create_per_worker_dataset(dataset)
    result["dataset"] = coordinator.schedule(first, args=(iter(per_worker),)).fetch().tolist()
    mapped = coordinator.create_per_worker_dataset(sg.data.Dataset.range(0, 10).map(add_ten))
    result["mapped"] = int(coordinator.schedule(first, args=(iter(mapped),)).fetch())
    distributed = strategy.experimental_distribute_dataset(dataset)
    from_function = strategy.distribute_datasets_from_function(range_fn)
    for name, made in (("distributed", distributed), ("from_function", from_function)):
        per_worker = coordinator.create_per_worker_dataset(made)
        result[name] = coordinator.schedule(first, args=(iter(per_worker),)).fetch().tolist()
    shuffled = sg.data.Dataset.range(0, 100).shuffle(100).batch(100)
    iterator = iter(coordinator.create_per_worker_dataset(shuffled))
    barrier = OUT / "barrier"
    barrier.mkdir()
    reads = [coordinator.schedule(both_read, args=(iterator, str(barrier))) for _ in range(2)]
    result["shuffled"] = sorted(coordinator.fetch(reads))
    return result


def iter_on_the_coordinator():
    dataset = sg.data.Dataset.range(1, 11).batch(4)
    return {
        "distributed": raised(
            ValueError, lambda: iter(strategy.experimental_distribute_dataset(dataset))
        ),
        "from_function": raised(
            ValueError, lambda: iter(strategy.distribute_datasets_from_function(range_fn))
        ),
    }


def int64_variable():
    per_worker = coordinator.create_per_worker_dataset(one_one)
    values = [coordinator.schedule(count, args=(iter(per_worker),)).fetch() for _ in range(2)]
    return {
        "values": values,
        "chief_reads": int(counter),
        "dtype": str(counter.dtype),
        "in_scope": strategy.extended.variable_created_in_scope(counter),
    }


def batchnorm_updates():
    marks = OUT / "bn-marks"
    (marks / "pair").mkdir(parents=True)
    roles = ("first", "second", "signal", "last")
    ran = coordinator.fetch(
        [coordinator.schedule(normalise, args=(role, str(marks))) for role in roles]
    )
    coordinator.join()  # the chief's reads are the ps's from here
    return {
        "ran_on": ran,
        "mean": norm.running_mean.tolist(),
        "var": norm.running_var.tolist(),
        "batches": int(norm.num_batches_tracked),
    }


def freshness():
    w0 = float(scalar.weight.detach())

    def pair(fn, *args):
        barrier = OUT / f"barrier-{len(list(OUT.glob('barrier-*')))}"
        barrier.mkdir()
        return [coordinator.schedule(fn, args=(str(barrier), *args)) for _ in range(2)]

    def by_worker(values):
        return {v[0]: v[1:] for v in coordinator.fetch(values)}

    result = {"w0": w0}
    # Both workers step; the first one's copy came back from the ps before the second step.
    pair(descend)
    coordinator.join()
    result["after_join"] = by_worker(pair(look))  # each reads w0 - 2
    # Steps held running while two looks are scheduled behind them: each look runs on a copy
    # its worker's push brought back after every write it must see (no pull).
    go = OUT / "go"
    steps = pair(descend, str(go))
    looks = pair(look)
    go.touch()
    result["queued"] = {"steps": by_worker(steps), "looks": by_worker(looks)}
    # The same, each step then changing its worker's copy alone: the looks pull.
    go = OUT / "go-scribble"
    steps = pair(descend, str(go), True)
    looks = pair(look)
    go.touch()
    result["changed"] = {"steps": by_worker(steps), "looks": by_worker(looks)}
    coordinator.join()
    result["chief"] = float(scalar.weight.detach())
    return result


def tables():
    global FACTOR
    by_number = coordinator.tables_sent_by_number
    same = [coordinator.schedule(scale, args=(3,)).fetch() for _ in range(6)]
    result = {"same": same, "by_number": coordinator.tables_sent_by_number - by_number}
    changed = []
    as_changes = coordinator.tables_sent_as_changes
    for factor in (True, 1.0, 2, 1):
        FACTOR = factor
        changed.append(coordinator.schedule(scale, args=(3,)).fetch())
    result["changed"] = changed
    result["as_changes"] = coordinator.tables_sent_as_changes - as_changes
    result["bumped"] = [coordinator.schedule(bump).fetch() for _ in range(3)]
    return result


with strategy.scope():
    probe = torch.nn.Linear(1, 1)  # its parameters are ps variables: its table can be kept
probe_optimizer = torch.optim.SGD(probe.parameters(), lr=0.5)
NOTES = [1]
COUNT = 0


def seen_again(obj, name):
    """Whether this worker's function ran on this very ``obj`` before (``sys`` is the worker's
    own module: what is kept in it outlives the call, and keeps the objects' ids theirs)."""
    seen = sys.__dict__.setdefault(f"_coordinator_fidelity_{name}", [])
    again = any(o is obj for o in seen)
    seen.append(obj)
    return again


def same_objects():
    """Whether this worker ran a function on this very model before."""
    return seen_again(probe, "seen")


def grow():
    NOTES.append(len(NOTES))
    return list(NOTES)


def decay():
    probe_optimizer.param_groups[0]["lr"] *= 0.5
    return probe_optimizer.param_groups[0]["lr"]


def mark():
    probe.calls = getattr(probe, "calls", 0) + 1
    return probe.calls


def hook():
    probe.register_forward_hook(lambda *_: None)
    return len(probe._forward_hooks)


def evaluate():
    training = probe.training
    probe.eval()
    return training


def rebind():
    global COUNT
    COUNT += 1
    return COUNT


def make_counter():
    count = 0

    def counter():
        nonlocal count
        count += 1
        return count

    return counter


count_up = make_counter()
tally = sg.keras.metrics.Sum()  # an accumulator: starts empty on the worker at each call
# A Keras optimizer's step counter (a volatile attribute: not watched, set at each call; what a
# call adds comes back to the chief's, as to TF's ps variable).
stepping = BoundOptimizer(torch.optim.SGD(probe.parameters(), lr=0.5))


def add_one():
    tally.update_state(torch.tensor(1.0))
    return seen_again(tally, "tally")


def count_on():
    before = stepping.iterations
    stepping.iterations = before + 1  # on this worker's copy; the step comes back to the chief
    return [before, seen_again(stepping, "stepping")]


def warn():
    # Python records the warning in this function's globals (``__warningregistry__``).
    warnings.warn("a warning of the function's own", UserWarning, stacklevel=1)
    return seen_again(probe, "warned")


def reuse():
    """A worker sent the same table, function and arguments again calls the objects it built
    for the last call, unless that call changed them: each call sees what the chief holds."""
    result = {"same_objects": [coordinator.schedule(same_objects).fetch() for _ in range(8)]}
    for fn in (grow, decay, mark, hook, evaluate, rebind, count_up, add_one, count_on, warn):
        result[fn.__qualname__] = [coordinator.schedule(fn).fetch() for _ in range(8)]
    result["tally"] = float(tally.result())
    return result


with strategy.scope():
    # ps variables: tables the chief may keep. One object per reader below, so that a change
    # made for one reader is not what makes another's description new.
    noted, switched, frozen, hooked, tuned = (torch.nn.Linear(1, 1) for _ in range(5))
tuned_optimizer = torch.optim.SGD(tuned.parameters(), lr=0.5)
# A Keras optimizer as compile makes it: its step counter changes at every call of fit (a
# volatile attribute: the chief reads it again for a description it keeps).
counted = BoundOptimizer(torch.optim.SGD(tuned.parameters(), lr=0.5))
SETTING = 0
ITEMS = [0]
TABLE = {"k": 0}


def read_setting():
    return SETTING


def read_items():
    return list(ITEMS)


def read_table():
    return TABLE["k"]


def read_note():
    return getattr(noted, "note", None)


def read_training():
    return switched.training


def read_lr():
    return tuned_optimizer.param_groups[0]["lr"]


def read_trainable():
    return frozen.weight.requires_grad


def read_hooks():
    return len(hooked._forward_hooks)


def read_option(options):
    return options.level


def read_passed(level):
    return level


def read_iterations():
    return counted.iterations


def no_op_hook(module, inputs, output):
    return None


def make_level():
    level = 0

    def read():
        return level

    def set_to(value):
        nonlocal level
        level = value

    return read, set_to


read_level, set_level = make_level()


def chief_changes():
    """The chief changes what a function captures between two schedules, in each way it can:
    each call sees what the chief held when it was scheduled, also where the chief keeps the
    last description of a function scheduled again with the same arguments."""
    options = argparse.Namespace(level=0)
    passed_args, passed_kwargs = [0], {"level": 0}  # the same list and dict, changed
    kept = coordinator.descriptions_kept
    result = {"again": [coordinator.schedule(read_setting).fetch() for _ in range(4)]}
    result["kept"] = coordinator.descriptions_kept - kept

    def set_setting(k):
        global SETTING
        SETTING = k

    readers = {
        "setting": (read_setting, (), set_setting),
        "items": (read_items, (), ITEMS.append),
        "table": (read_table, (), lambda k: TABLE.update(k=k)),
        "note": (read_note, (), lambda k: setattr(noted, "note", k)),
        "training": (read_training, (), lambda k: switched.train(k % 2 == 0)),
        "lr": (read_lr, (), lambda k: tuned_optimizer.param_groups[0].update(lr=k / 4)),
        "trainable": (read_trainable, (), lambda k: frozen.weight.requires_grad_(k % 2 == 0)),
        "hooks": (read_hooks, (), lambda k: hooked.register_forward_hook(no_op_hook)),
        "option": (read_option, (options,), lambda k: setattr(options, "level", k)),
        "level": (read_level, (), set_level),
        "args": (read_passed, passed_args, lambda k: passed_args.__setitem__(0, k)),
        "kwargs": (read_passed, (), lambda k: passed_kwargs.update(level=k)),
        "iterations": (read_iterations, (), lambda k: counted.count_step()),
    }
    for name, (fn, args, change) in readers.items():
        # A pair of schedules as first described, then after each change: the second of a
        # pair, and the first after a change, find the last description (kept: it must be
        # the chief's view).
        result[name] = []
        for k in range(5):
            if k:
                change(k)
            kwargs = passed_kwargs if name == "kwargs" else None
            pair = [coordinator.schedule(fn, args=args, kwargs=kwargs) for _ in range(2)]
            result[name].append([value.fetch() for value in pair])
    return result


STALE = 0


def read_stale():
    return STALE


class _Blind:
    """A snapshot that never sees a change."""

    def unchanged(self):
        return True


def stale_check():
    """The suite's check of kept descriptions (``STRATAGEM_CHECK_KEPT_DESCRIPTIONS=1``)
    catches a description kept where a new one differs: here its snapshot is made blind."""
    global STALE
    coordinator.schedule(read_stale).fetch()
    coordinator._descriptions.kept_of(read_stale).snapshot = _Blind()
    STALE = 1
    return raised(AssertionError, lambda: coordinator.schedule(read_stale))


def cancellation():
    started, seen = OUT / "started", OUT / "seen"
    iterator = iter(coordinator.create_per_worker_dataset(endless))
    running = coordinator.schedule(read_until_cancelled, args=(iterator, str(started), str(seen)))
    failing = coordinator.schedule(fail_once_started, args=(str(started),))
    result = {
        "join": raised(sg.distribute.coordinator.FunctionError, coordinator.join),
        "failed": raised(sg.distribute.coordinator.FunctionError, failing.fetch),
        "running": raised(sg.distribute.coordinator.CancelledError, running.fetch),
        # join waited for the cancelled function to end: what stopped it on its worker.
        "stopped_by": seen.read_text() if seen.exists() else None,
    }
    coordinator.join()  # the error was raised once, and the cancelled function's is no new one
    result["done"] = coordinator.done()
    result["after"] = [coordinator.schedule(double, args=(i,)).fetch() for i in range(3)]
    return result


def add(pair, extra=None):
    return pair[0] + pair[1] + (extra["more"] if extra else 0)


def fail_now():
    raise ValueError("the input's own failure")


with strategy.scope():
    looped = torch.nn.Linear(1, 1)
looped_optimizer = BoundOptimizer(torch.optim.SGD(looped.parameters(), lr=0.1))


def loop_step():
    looped_optimizer.zero_grad()
    looped(torch.ones(1, 1)).sum().backward()
    looped_optimizer.step()


def custom_loop_iterations():
    """A custom loop's optimizer steps, taken on the workers, count in the chief's
    ``optimizer.iterations`` (TF's is a ps variable that ``apply_gradients`` adds to)."""
    for _ in range(6):
        coordinator.schedule(loop_step)
    coordinator.join()
    return looped_optimizer.iterations


def remote_inputs():
    """A RemoteValue passed to schedule is its value on the worker (TF's
    ``maybe_get_remote_value``), in a list and a dict too; one whose function failed fails
    the function it is passed to with ``ClosureInputError`` (TF's), which ``join`` raises."""
    first = coordinator.schedule(double, args=(torch.tensor(3.0),))
    second = coordinator.schedule(double, args=(first,))
    both = coordinator.schedule(add, args=([first, second],), kwargs={"extra": {"more": first}})
    result = {"second": float(second.fetch()), "both": float(both.fetch())}
    failing = coordinator.schedule(fail_now)
    result["failed"] = raised(sg.distribute.coordinator.FunctionError, coordinator.join)
    dependent = coordinator.schedule(double, args=(failing,))
    error = sg.distribute.coordinator.ClosureInputError
    result["join"] = raised(error, coordinator.join)
    result["fetch"] = raised(error, dependent.fetch)
    result["after"] = float(coordinator.schedule(double, args=(second,)).fetch())
    return result


def fit_data(input_context=None):
    x = torch.linspace(-1, 1, 64).reshape(32, 2)
    y = (x.sum(dim=1) > 0).long()
    return sg.data.Dataset.from_tensor_slices((x, y)).shuffle(32).repeat().batch(8)


def applied() -> int:
    """Gradients the ps applied so far (async: one per worker's optimizer step)."""
    return sum(s["applied"] for s in strategy.ps_stats())


def fit_model() -> sg.keras.Model:
    """The coordinated fits' model, seeded and compiled in the strategy's scope."""
    torch.manual_seed(0)
    with strategy.scope():
        model = sg.keras.Model(torch.nn.Linear(2, 2))
        model.compile(
            sg.keras.optimizers.SGD(0.1),
            loss=sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=2,
        )
    return model


def keras_fit():
    """Model.fit under the coordinator on a dataset, as TF's tutorial passes it (and on a
    DatasetCreator, as its older version did): how many epochs and steps, how many gradients
    reached the ps, and the weights (as the chief reads them from the ps) before and after."""
    result = {}
    creator = sg.keras.utils.experimental.DatasetCreator(fit_data)
    for name, data in (("dataset", fit_data().prefetch(2)), ("creator", creator)):
        model = fit_model()
        before = {k: v.tolist() for k, v in model.module.state_dict().items()}
        applied_before = applied()
        history = model.fit(data, epochs=2, steps_per_epoch=4, verbose=0)
        result[name] = {
            "epochs": len(history.history["loss"]),
            "steps": model.optimizer.iterations,
            "applied": applied() - applied_before,
            "before": before,
            "after": {k: v.tolist() for k, v in model.module.state_dict().items()},
        }
    return result


def backup_and_restore():
    """TF's tutorial passes BackupAndRestore to a coordinated fit: a fit interrupted after its
    second epoch's backup, then run again, goes on from the third epoch (the epoch, the
    optimizer's step count and the weights from the backup), and the backup goes at its end."""
    model = fit_model()
    epochs: list[int] = []

    class Watch(sg.keras.callbacks.Callback):
        def __init__(self, stop_after: int | None = None) -> None:
            super().__init__()
            self.stop_after = stop_after

        def on_epoch_begin(self, epoch, logs=None):
            epochs.append(epoch)

        def on_epoch_end(self, epoch, logs=None):
            if epoch == self.stop_after:
                raise RuntimeError("interrupted")

    backup_dir = OUT / "backup"
    fit = dict(epochs=4, steps_per_epoch=2, verbose=0)
    backup = sg.keras.callbacks.BackupAndRestore(backup_dir=str(backup_dir))
    try:
        model.fit(fit_data(), callbacks=[backup, Watch(stop_after=1)], **fit)
    except RuntimeError as e:
        interrupted = str(e)
    steps = [model.optimizer.iterations]
    backup = sg.keras.callbacks.BackupAndRestore(backup_dir=str(backup_dir))
    model.fit(fit_data(), callbacks=[backup, Watch()], **fit)
    steps.append(model.optimizer.iterations)
    left = sorted(p.name for p in backup_dir.rglob("*")) if backup_dir.exists() else []
    return {"interrupted": interrupted, "epochs": epochs, "steps": steps, "left": left}


result = {
    "keras": outcome(keras_fit),
    "backup": outcome(backup_and_restore),
    "iter": outcome(iter_on_the_coordinator),
    "datasets": outcome(datasets),
    "int64": outcome(int64_variable),
    "batchnorm": outcome(batchnorm_updates),
    "freshness": outcome(freshness),
    "tables": outcome(tables),
    "reuse": outcome(reuse),
    "chief_changes": outcome(chief_changes),
    "stale_check": outcome(stale_check),
    "remote_inputs": outcome(remote_inputs),
    "loop_iterations": outcome(custom_loop_iterations),
    "cancel": outcome(cancellation),
}
(OUT / "result.json").write_text(json.dumps(result))
print("coordinator fidelity done", flush=True)
