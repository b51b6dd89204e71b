"""Every task of a job over several machines (tests/test_multihost_netns.py): one node's
``stratagem run --nnodes ...`` per network namespace, each task with the whole job's TF_CONFIG.

argv: MODE, with the shared folder (the namespaces share the file system) as the working dir.

- ``mwms``: MultiWorkerMirroredStrategy; each worker contributes ``index + 1`` to an all-reduce
  and prints the job-wide sum with the cluster it was given.
- ``loop``: MultiWorkerMirroredStrategy all-reducing until stopped; prints ``step N`` after
  each (a node is killed or its link cut mid-training).
- ``ps``: a chief's job under ParameterServerStrategy (its workers and ps tasks serve). The
  chief schedules functions through a ClusterCoordinator: one on each worker (each waits until
  both ran, so both take work), then training steps on variables that live on the ps tasks,
  and prints what it saw as ``RESULT {json}``; then ``Model.fit``, writing ``ckpt/ckpt-1``.
  The evaluator runs ``SidecarEvaluator`` on that checkpoint and prints what it evaluated.
- ``resume``: MultiWorkerMirroredStrategy training a weight vector for 6 steps (all-reduced
  gradients), checkpointed by a ``CheckpointManager`` in ``ckpt`` after steps 2 and 4, resumed
  from it after a restart (``restored step N``). In the first attempt, the worker on node 1
  (the last) ends after step 3 (``FAULT=exit``: exit code 3), or holds there until its node is
  killed (``FAULT=hold``: prints ``holding at step 3``). At the end each worker prints
  ``WEIGHTS <sha256>`` and ``REFERENCE <sha256>``: the weights, and those of the same 6 steps
  computed alone, without the job.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

import stratagem as sg

MODE = sys.argv[1]
resolver = sg.distribute.cluster_resolver.TFConfigClusterResolver()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=generator)
    return x, (x.sum(dim=1) > 0).long()


def regression_data() -> tuple[torch.Tensor, torch.Tensor]:
    """The coordinated training steps' inputs and targets (as tests/test_multihost_netns.py's
    one-process reference)."""
    generator = torch.Generator().manual_seed(1)
    return torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)


def keras_model() -> sg.keras.Model:
    model = sg.keras.Model(torch.nn.Linear(4, 2))
    model.compile(
        sg.keras.optimizers.SGD(0.1),
        sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        ["accuracy"],
    )
    return model


def mwms(loop: bool) -> None:
    strategy = sg.distribute.MultiWorkerMirroredStrategy()
    mine = torch.tensor([float(resolver.task_id + 1)])
    step = 0
    while True:
        total = strategy.reduce(
            sg.distribute.ReduceOp.SUM, strategy.run(lambda g=mine: g), axis=None
        )
        if not loop:
            cluster = json.loads(os.environ["TF_CONFIG"])["cluster"]
            print("cluster", json.dumps(cluster), "sum", total.item(), flush=True)
            return
        step += 1
        print(f"step {step} sum {total.item()}", flush=True)
        time.sleep(0.05)  # a few lines a second, not thousands


def resume() -> None:
    strategy = sg.distribute.MultiWorkerMirroredStrategy()
    workers = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
    me = resolver.task_id

    def gradient(w: torch.Tensor, step: int, worker: int) -> torch.Tensor:
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1000 * step + worker))
        return x.T @ (x @ w - x.sum(dim=1) * 0.5) / 4

    def update(w: torch.Tensor, total: torch.Tensor) -> None:
        w -= 0.1 * total / workers

    w = torch.zeros(4)
    step = torch.tensor(0)
    checkpoint = sg.train.Checkpoint(w=w, step=step)
    manager = sg.train.CheckpointManager(checkpoint, "ckpt", max_to_keep=1)
    if manager.latest_checkpoint:
        checkpoint.restore(manager.latest_checkpoint)
        print(f"restored step {int(step)}", flush=True)
    first_attempt = os.environ["STRATAGEM_RESTART_COUNT"] == "0"
    while int(step) < 6:
        s = int(step) + 1
        mine = gradient(w, s, me)
        total = strategy.reduce(
            sg.distribute.ReduceOp.SUM, strategy.run(lambda g=mine: g), axis=None
        )
        update(w, total)
        step += 1
        print(f"step {s}", flush=True)
        if s in (2, 4):
            manager.save()
        if s == 3 and first_attempt and me == workers - 1:
            if os.environ["FAULT"] == "exit":
                sys.exit(3)
            print("holding at step 3", flush=True)
            while True:  # until the test kills this node
                time.sleep(1)
    reference = torch.zeros(4)
    for s in range(1, 7):
        update(reference, sum(gradient(reference, s, i) for i in range(workers)))
    for name, t in (("WEIGHTS", w), ("REFERENCE", reference)):
        print(name, hashlib.sha256(t.numpy().tobytes()).hexdigest(), flush=True)


def serve() -> None:
    """A worker or ps task of a chief's job: serve until the chief is done."""
    sg.distribute.Server(resolver).join()


def evaluate() -> None:
    model = keras_model()
    evaluator = sg.keras.utils.SidecarEvaluator(
        model, data(), "ckpt", max_evaluations=1, timeout=60
    )
    evaluator.poll_secs = 0.1
    evaluator.start()
    for e in evaluator.evaluations:
        print(f"evaluated {Path(e.path).name} step {e.step} logs {json.dumps(e.logs)}", flush=True)


def ran_on_both(folder: str) -> int:
    """Marks that this worker ran, then waits (at most 60 s) until both workers did."""
    me = sg.distribute.coordinator.experimental_get_current_worker_index()
    Path(folder, f"worker-{me}").touch()
    deadline = time.monotonic() + 60
    while len(list(Path(folder).glob("worker-*"))) < 2:
        if time.monotonic() > deadline:
            raise TimeoutError("the other worker never ran its function")
        time.sleep(0.05)
    return me


def coordinate() -> None:
    strategy = sg.distribute.ParameterServerStrategy(resolver)
    coordinator = sg.distribute.coordinator.ClusterCoordinator(strategy)
    torch.manual_seed(0)
    with strategy.scope():
        layer = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    x, target = regression_data()

    def train_step() -> float:
        optimizer.zero_grad()
        loss = (layer(x) - target).pow(2).mean()
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    Path("marks").mkdir()
    both = [coordinator.schedule(ran_on_both, args=("marks",)) for _ in range(2)]
    coordinator.join()
    # One step at a time (each fetched before the next is scheduled): each starts from the
    # values the last one left on the ps, so the steps are one process's, whichever worker ran.
    losses = [coordinator.schedule(train_step).fetch() for _ in range(4)]
    seam = strategy.extended.coordinator_seam
    result = {
        "workers": sorted(v.fetch() for v in both),
        "losses": losses,
        "placement": {n: [s.ps for s in seam.shards_of(p)] for n, p in layer.named_parameters()},
        "ps_stats": strategy.ps_stats(),
        "after": {n: p.detach().tolist() for n, p in layer.named_parameters()},
    }
    print("RESULT " + json.dumps(result), flush=True)

    # Model.fit on the chief schedules its steps on the workers too; its checkpoint is the
    # evaluator's to evaluate.
    with strategy.scope():
        model = keras_model()
    checkpoint = sg.keras.callbacks.ModelCheckpoint("ckpt/ckpt-{epoch}")
    history = model.fit(
        *data(), batch_size=16, epochs=1, steps_per_epoch=4, verbose=0, callbacks=[checkpoint]
    )
    print(f"fit done: loss {history.history['loss'][-1]:.4f}", flush=True)


if MODE == "resume":
    resume()
elif MODE in ("mwms", "loop"):
    mwms(loop=MODE == "loop")
elif resolver.task_type == "evaluator":
    evaluate()
elif resolver.task_type in ("worker", "ps"):
    serve()
else:
    coordinate()
