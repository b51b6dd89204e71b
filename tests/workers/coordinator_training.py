"""Training through a ClusterCoordinator: `stratagem run --chief -n W --ps 1 THIS OUT MODE`.

MODE ``same`` (one worker): a model of this program's own class (with BatchNorm buffers), an
SGD optimizer with momentum and two metrics, built in the chief's scope, trained by scheduled
functions on fixed batches, in order; then ``Model.fit`` on arrays, also of a model with
BatchNorm, whose statistics the chief then reads from the ps. The chief trains a plain copy of
each the same way in its own process and writes both, to compare.

MODE ``faults`` (three workers): in the middle of its 5th step worker 1 kills itself (-9) and
worker 2 stops itself (SIGSTOP; the chief gives up on it after the operation timeout); worker 0,
held in its first step until both have, runs each of those steps again, every scheduled step
completes once, and the test accuracy is reached. After the join, and past the ps's patience
with a silent worker, the chief lets worker 2 go on (SIGCONT).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

import stratagem as sg
from stratagem import shipping

OUT = Path(sys.argv[1])
MODE = sys.argv[2]

resolver = sg.distribute.cluster_resolver.TFConfigClusterResolver()
if resolver.task_type in ("worker", "ps"):
    sg.distribute.Server(resolver).join()
    sys.exit(0)


class Net(torch.nn.Module):
    """This program's own class: a worker makes it from its copy of this file."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(64, hidden), torch.nn.BatchNorm1d(hidden), torch.nn.ReLU()
        )
        self.head = torch.nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def digits() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    (x, y), (xt, yt) = sg.data.datasets.load_digits(image_size=8)
    flat = lambda a: torch.from_numpy((a.reshape(len(a), -1) / np.float32(255)).astype(np.float32))  # noqa: E731
    return (flat(x), torch.from_numpy(y)), (flat(xt), torch.from_numpy(yt))


(x_train, y_train), (x_test, y_test) = digits()
strategy = sg.distribute.experimental.ParameterServerStrategy(resolver)
coordinator = sg.distribute.coordinator.ClusterCoordinator(strategy)
torch.manual_seed(0)
with strategy.scope():
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    accuracy = sg.keras.metrics.SparseCategoricalAccuracy()
    mean_loss = sg.keras.metrics.Mean()
loss_fn = sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def train_on(net, opt, acc, mean, x, y):
    """One step; the same code on a worker (scheduled) and on the chief (the reference)."""
    pred = net(x)
    loss = loss_fn(y, pred)
    opt.zero_grad()
    loss.backward()
    opt.step()
    acc.update_state(y, pred)
    mean.update_state(loss.detach())
    return loss.detach()


def step(x, y):
    return strategy.run(train_on, args=(model, optimizer, accuracy, mean_loss, x, y))


def worker_buffers():
    return {name: b.clone() for name, b in model.named_buffers()}


def evaluate(x, y, metric):
    model.eval()
    with torch.no_grad():
        metric.update_state(y, model(x))


def step_or_die(iterator, calls_dir):
    """A step; halfway through its 5th (after the forward pass) worker 1 kills itself (-9)
    and worker 2 stops itself (SIGSTOP). Worker 0 waits in its first until both have: which
    worker takes which function is the schedule's, and a worker slow to start (a loaded
    machine) could otherwise see workers 0 and 1 run all 90 before it reached its 5th."""
    me = sg.distribute.coordinator.experimental_get_current_worker_index()
    if me == 0:
        faults = (Path(calls_dir, "worker-1", "call-4"), Path(calls_dir, "worker-2", "pid.txt"))
        deadline = time.monotonic() + 120
        while not all(f.exists() for f in faults):
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker 0: workers 1 and 2 not at their faults: {faults}")
            time.sleep(0.01)
    x, y = next(iterator)
    pred = model(x)
    loss = loss_fn(y, pred)
    if me in (1, 2):
        mine = Path(calls_dir, f"worker-{me}")
        mark = mine / f"call-{len(list(mine.glob('call-*')))}"
        mark.touch()
        if mark.name == "call-4":
            (mine / "pid.txt").write_text(str(os.getpid()))
            # This thread's own signal: it stops (or dies) before it returns to Python. A stop
            # sent to the process is taken by whichever thread the kernel wakes for it, and
            # this one could finish the function first (its value would be taken).
            fault = signal.SIGKILL if me == 1 else signal.SIGSTOP
            signal.pthread_kill(threading.get_ident(), fault)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return me


def worker_dataset():
    context = strategy.extended
    data = sg.data.Dataset.from_tensor_slices((x_train, y_train))
    data = data.shard(context.num_workers, context.worker_index)
    return data.shuffle(2048).batch(32).repeat()


def ended(values: list) -> None:
    """Wait until these functions ended, without fetch or join (which refresh the chief)."""
    deadline = time.monotonic() + 120
    while any("pending" in repr(v) for v in values):
        if time.monotonic() > deadline:
            raise TimeoutError(f"functions still pending after 120 s: {values}")
        time.sleep(0.005)


def chief_reads_see_the_ps(batches: list) -> dict:
    """A model trained only by scheduled functions, read on the chief four ways, each right
    after functions ended: a forward, a state_dict, the parameters after join(), and after
    fetch() of the last value. Each against a reference trained here on the same batches."""
    torch.manual_seed(7)
    with strategy.scope():
        tiny = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.ReLU(), torch.nn.Linear(8, 10))
        tiny_optimizer = torch.optim.SGD(tiny.parameters(), lr=0.1)
    reference = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.ReLU(), torch.nn.Linear(8, 10))
    reference.load_state_dict(tiny.state_dict())
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)

    def tiny_step(x, y):
        tiny_optimizer.zero_grad()
        loss_fn(y, tiny(x)).backward()
        tiny_optimizer.step()

    def train(chunk):
        values = [coordinator.schedule(tiny_step, args=(x_train[b], y_train[b])) for b in chunk]
        for b in chunk:
            ref_optimizer.zero_grad()
            loss_fn(y_train[b], reference(x_train[b])).backward()
            ref_optimizer.step()
        return values

    probe = x_test[:16]
    reads = {}
    ended(train(batches[0:2]))
    with torch.no_grad():
        reads["forward"] = [tiny(probe).tolist(), reference(probe).tolist()]
    ended(train(batches[2:4]))
    reads["state_dict"] = [
        [v.tolist() for v in tiny.state_dict().values()],
        [v.tolist() for v in reference.state_dict().values()],
    ]
    train(batches[4:6])
    coordinator.join()
    reads["join"] = [
        [p.tolist() for p in tiny.parameters()],
        [p.tolist() for p in reference.parameters()],
    ]
    train(batches[6:8])[-1].fetch()
    reads["fetch"] = [
        [p.tolist() for p in tiny.parameters()],
        [p.tolist() for p in reference.parameters()],
    ]
    return reads


def bn_model(strategy_scope) -> sg.keras.Model:
    """TF's parameter-server tutorial's model with a BatchNorm layer."""
    torch.manual_seed(5)
    with strategy_scope:
        net = sg.keras.Model(
            torch.nn.Sequential(
                torch.nn.Linear(64, 16),
                torch.nn.BatchNorm1d(16),
                torch.nn.ReLU(),
                torch.nn.Linear(16, 10),
            )
        )
        net.compile(sg.keras.optimizers.SGD(0.1), loss=loss_fn, steps_per_execution=2)
    return net


def bn_statistics():
    """On a worker: the BatchNorm statistics as this call pulled them from the ps."""
    return {n: b.clone() for n, b in bn.module.named_buffers()}


def batchnorm_on_the_ps() -> dict:
    """fit through the coordinator; then the chief's model predicts with the statistics the
    workers trained on the ps (TF's moving statistics are ps variables), as a local fit's."""
    global bn
    bn = bn_model(strategy.scope())
    untrained = {n: b.clone() for n, b in bn.module.named_buffers()}
    fit = dict(batch_size=40, epochs=1, steps_per_epoch=6, shuffle=False, verbose=0)
    bn.fit(x_train, y_train, **fit)
    on_ps = coordinator.schedule(bn_statistics).fetch()
    chief_predicted = bn.predict(x_test, batch_size=50)
    local = bn_model(sg.distribute.get_strategy().scope())
    local.fit(x_train, y_train, **fit)
    # The trained weights with the untrained statistics: what a chief whose statistics stayed
    # its own would predict.
    stale = bn_model(sg.distribute.get_strategy().scope())
    stale.module.load_state_dict({**local.module.state_dict(), **untrained})
    return {
        "on_ps": {n: [b.tolist(), local.module.state_dict()[n].tolist()] for n, b in on_ps.items()},
        "chief": {n: b.tolist() for n, b in bn.module.named_buffers()},
        "predict": [
            chief_predicted.tolist(),
            local.predict(x_test, batch_size=50).tolist(),
            stale.predict(x_test, batch_size=50).tolist(),
        ],
        "evaluate": [
            bn.evaluate(x_test, y_test, batch_size=50, verbose=0),
            local.evaluate(x_test, y_test, batch_size=50, verbose=0),
        ],
    }


def count_one(metric):
    metric.update_state(torch.tensor(1.0))


def metric_totals_before_fetch() -> tuple[float, list[int]]:
    """A Sum read right after fetch() of the second of two updates is 2.0: a function's metric
    totals are merged before its value can be fetched. Also how many of the two values were
    ready when each one's totals were merged (one worker: in order; 0 and 1 when the merge
    comes before the value)."""
    with strategy.scope():
        total = sg.keras.metrics.Sum()
    counted: list = []
    ready_at_merge: list[int] = []
    merge = shipping.add_totals

    def watched_merge(accumulators, totals):
        ready_at_merge.append(sum("pending" not in repr(v) for v in counted))
        merge(accumulators, totals)

    shipping.add_totals = watched_merge
    try:
        for _ in range(2):
            counted.append(coordinator.schedule(count_one, args=(total,)))
        counted[1].fetch()
        after_fetch = float(total.result())
        coordinator.join()
    finally:
        shipping.add_totals = merge
    return after_fetch, ready_at_merge


result: dict = {}
if MODE == "lostps":
    # The chief checkpoints at step 10 and, in the launcher's first attempt, kills the ps: the
    # next step fails naming it, the job restarts, and the chief resumes from the checkpoint
    # (the ps gets the values and the momentum back) to step 20.
    torch.manual_seed(5)
    with strategy.scope():
        small = torch.nn.Sequential(
            torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10)
        )
        small_optimizer = torch.optim.SGD(small.parameters(), lr=0.1, momentum=0.9)
    reference = torch.nn.Sequential(
        torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10)
    )
    reference.load_state_dict(small.state_dict())
    step_count = torch.tensor(0)
    checkpoint = sg.train.Checkpoint(model=small, optimizer=small_optimizer, step=step_count)
    manager = sg.train.CheckpointManager(checkpoint, OUT / "ckpt", max_to_keep=1)
    if manager.latest_checkpoint:
        checkpoint.restore(manager.latest_checkpoint)
        print(f"restored step {int(step_count)}", flush=True)
    order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(2))
    batches = [order[i * 32 : (i + 1) * 32] for i in range(20)]

    def small_step(x, y):
        small_optimizer.zero_grad()
        loss_fn(y, small(x)).backward()
        small_optimizer.step()

    first_attempt = os.environ.get("STRATAGEM_RESTART_COUNT") == "0"
    while int(step_count) < 20:
        coordinator.schedule(
            small_step, args=(x_train[batches[int(step_count)]], y_train[batches[int(step_count)]])
        )
        coordinator.join()
        step_count += 1
        if int(step_count) == 10 and first_attempt:
            manager.save()
            os.kill(strategy.extended.world.pid("ps", 0), signal.SIGKILL)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for b in batches:
        ref_optimizer.zero_grad()
        loss_fn(y_train[b], reference(x_train[b])).backward()
        ref_optimizer.step()
    strategy.pull()
    result["weights"] = [
        [p.tolist(), q.tolist()] for p, q in zip(small.parameters(), reference.parameters())
    ]
elif MODE == "same":
    reference = Net()
    reference.load_state_dict(model.state_dict())
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    ref_accuracy = sg.keras.metrics.SparseCategoricalAccuracy()
    ref_mean = sg.keras.metrics.Mean()
    order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(1))
    batches = [order[i : i + 48] for i in range(0, 48 * 12, 48)]
    losses = [coordinator.schedule(step, args=(x_train[b], y_train[b])) for b in batches]
    coordinator.join()
    ref_losses = [
        train_on(reference, ref_optimizer, ref_accuracy, ref_mean, x_train[b], y_train[b])
        for b in batches
    ]
    # No strategy.pull(): after join() the chief's model is the ps's (TF's chief reads there).
    result["weights"] = {
        n: [p.tolist(), reference.state_dict()[n].tolist()] for n, p in model.named_parameters()
    }
    buffers = coordinator.schedule(worker_buffers).fetch()
    result["buffers"] = {
        n: [b.tolist(), reference.state_dict()[n].tolist()] for n, b in buffers.items()
    }
    result["losses"] = [[float(v.fetch()), float(r)] for v, r in zip(losses, ref_losses)]
    result["accuracy"] = [float(accuracy.result()), float(ref_accuracy.result())]
    result["mean_loss"] = [float(mean_loss.result()), float(ref_mean.result())]

    # Model.fit on arrays, one worker: its dataset is the arrays in order, repeated.
    def keras_model(strategy_scope):
        torch.manual_seed(3)
        with strategy_scope:
            net = sg.keras.Model(
                torch.nn.Sequential(
                    torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10)
                )
            )
            net.compile(
                sg.keras.optimizers.SGD(0.1),
                loss=loss_fn,
                metrics=["accuracy"],
                steps_per_execution=3,
            )
        return net

    fitted = keras_model(strategy.scope())
    history = fitted.fit(
        x_train, y_train, batch_size=40, epochs=2, steps_per_epoch=6, shuffle=False, verbose=0
    )
    local = keras_model(sg.distribute.get_strategy().scope())
    local_history = local.fit(
        x_train, y_train, batch_size=40, epochs=2, steps_per_epoch=6, shuffle=False, verbose=0
    )
    result["fit_weights"] = [
        [p.tolist(), q.tolist()]
        for p, q in zip(fitted.module.parameters(), local.module.parameters())
    ]
    result["fit_history"] = [history.history, local_history.history]
    result["fit_iterations"] = fitted.optimizer.iterations
    result["evaluate"] = [
        fitted.evaluate(x_test, y_test, batch_size=50, verbose=0),
        local.evaluate(x_test, y_test, batch_size=50, verbose=0),
    ]

    # TF's parameter-server tutorial: Dense(10) compiled with loss="mse" on labels of shape
    # (N,), fit through the coordinator; its losses are compared with a local fit's.
    def tutorial_model(strategy_scope):
        torch.manual_seed(4)
        with strategy_scope:
            net = sg.keras.Model(torch.nn.Linear(64, 10))
            net.compile(sg.keras.optimizers.SGD(0.05), loss="mse", steps_per_execution=2)
        return net

    targets = y_train.float() / 10  # (N,)
    result["tutorial_mse"] = [
        tutorial_model(scope)
        .fit(x_train, targets, batch_size=40, epochs=2, steps_per_epoch=2, shuffle=False, verbose=0)
        .history["loss"]
        for scope in (strategy.scope(), sg.distribute.get_strategy().scope())
    ]
    result["batchnorm"] = batchnorm_on_the_ps()
    result["reads"] = chief_reads_see_the_ps(batches)
    result["sum_after_fetch"], result["ready_at_merge"] = metric_totals_before_fetch()
else:
    calls = OUT / "calls"
    for index in (1, 2):
        (calls / f"worker-{index}").mkdir(parents=True)
    iterator = iter(coordinator.create_per_worker_dataset(worker_dataset))
    scheduled = [coordinator.schedule(step_or_die, args=(iterator, str(calls))) for _ in range(90)]
    coordinator.join()
    ran_on = [v.fetch() for v in scheduled]
    result["faulted"] = [len(list((calls / f"worker-{i}").glob("call-*"))) for i in (1, 2)]
    # Worker 2 was given up on and its function ran again elsewhere. It stays stopped past the
    # ps's patience with a silent worker (twice the operation timeout, once it is seen silent):
    # while a coordinating chief goes on, the ps waits on it and does not end the job.
    time.sleep(2 * float(os.environ["STRATAGEM_OP_TIMEOUT"]) + 1)
    # Then it goes on.
    os.kill(int((calls / "worker-2" / "pid.txt").read_text()), signal.SIGCONT)
    result["completed"] = coordinator.completed
    result["ran_on"] = ran_on
    test_accuracy = sg.keras.metrics.SparseCategoricalAccuracy()
    for i in range(0, len(x_test), 60):
        coordinator.schedule(evaluate, args=(x_test[i : i + 60], y_test[i : i + 60], test_accuracy))
    coordinator.join()
    result["test_accuracy"] = float(test_accuracy.result())
    result["test_count"] = float(test_accuracy.state_dict()["count"])

(OUT / "result.json").write_text(json.dumps(result))
print(f"coordinator training {MODE} done", flush=True)
