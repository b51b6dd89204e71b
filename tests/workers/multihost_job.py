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
"""

from __future__ import annotations

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
        total = strategy.reduce(sg.distribute.ReduceOp.SUM, strategy.run(lambda: mine), axis=None)
        if not loop:
            cluster = json.loads(os.environ["TF_CONFIG"])["cluster"]
            print("cluster", json.dumps(cluster), "sum", total.item(), flush=True)
            return
        step += 1
        print(f"step {step} sum {total.item()}", flush=True)
        time.sleep(0.05)  # a few lines a second, not thousands


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
    before = [p.detach().clone().tolist() for p in layer.parameters()]
    x = torch.ones(8, 4)

    def train_step() -> float:
        optimizer.zero_grad()
        loss = (layer(x) - 1.0).pow(2).mean()
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    Path("marks").mkdir()
    both = [coordinator.schedule(ran_on_both, args=("marks",)) for _ in range(2)]
    losses = [coordinator.schedule(train_step) for _ in range(4)]
    coordinator.join()
    result = {
        "workers": sorted(v.fetch() for v in both),
        "losses": [v.fetch() for v in losses],
        "before": before,
        "after": [p.detach().clone().tolist() for p in layer.parameters()],
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


if MODE in ("mwms", "loop"):
    mwms(loop=MODE == "loop")
elif resolver.task_type == "evaluator":
    evaluate()
elif resolver.task_type in ("worker", "ps"):
    serve()
else:
    coordinate()
