"""Exact resume on another shape, under MeshStrategy and PipelineStrategy.

Usage: resume_shapes.py TASK [TASK ...], a TASK being ``KIND:PHASE:A:B``; every process writes
``KIND-PHASE-A-B-<rank>.pt`` for each (one job runs several: starting processes is the cost).

``mesh:first:B:M``: a custom loop on a (batch=B, model=M) mesh, the MLP of ``resume_data``
laid out Megatron-like (its first layer split by rows, its second by columns along ``model``),
trains STOP steps and writes a checkpoint of model, optimizer, distributed iterator and step.
``mesh:second:B:M`` restores it on that mesh and trains to the end; ``mesh:wider:B:M`` restores
it into a model with wider hidden layers (the saved shapes do not fit) and records the error.
Each process's ledger: the ids of the rows it held (its replica's part of each batch).

``pipe:first:S:R`` / ``pipe:second:S:R``: ``Model.fit`` on S stages x R replicas (GPipe, 2
micro-batches) with ``BackupAndRestore(save_freq=STOP)``, stopped after STOP batches, then
resumed; the ledger is the first layer's (stage 0's), the ids of each micro-batch it ran. The
first also writes the pipeline's own stage files, which the second restores or refuses.
"""

import sys

import torch
from torch.distributed.tensor import DTensor

import stratagem as sg
from stratagem import dtensor
from workers.common import build_model
from workers.resume_data import STOP, Ledgered, dataset, train_steps

U = dtensor.UNSHARDED


class MeshLedgered(Ledgered):
    """The ledger of a mesh: the ids of the rows this process holds (its replica's part)."""

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if self.training:
            local = features.to_local() if isinstance(features, DTensor) else features
            self.seen.append(local[:, -1].long().tolist())
        return self.net(features[:, :-1])


def megatron(mesh) -> dtensor.LayoutMap:
    layout_map = dtensor.LayoutMap(mesh)
    layout_map["net.0.weight"] = dtensor.Layout(["model", U], mesh)
    layout_map["net.0.bias"] = dtensor.Layout(["model"], mesh)
    layout_map["net.2.weight"] = dtensor.Layout([U, "model"], mesh)
    return layout_map


def mesh_loop(phase: str, batch: int, model_dim: int) -> dict:
    mesh = dtensor.create_mesh([("batch", batch), ("model", model_dim)])
    strategy = sg.distribute.experimental.MeshStrategy(mesh, megatron(mesh))
    torch.manual_seed(0)
    with strategy.scope():
        model = MeshLedgered()
        if phase == "wider":  # the checkpoint's 16 hidden units do not fit 32
            model.net[0] = torch.nn.Linear(5, 32)
            model.net[2] = torch.nn.Linear(32, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    iterator = iter(strategy.experimental_distribute_dataset(dataset()))
    step = torch.zeros((), dtype=torch.int64)
    checkpoint = sg.train.Checkpoint(model=model, optimizer=optimizer, iterator=iterator, step=step)
    path = "mesh/ckpt"
    if phase == "wider":
        try:
            checkpoint.restore(path)
        except Exception as e:  # recorded: the test reads its type and words
            return {"error": f"{type(e).__name__}: {e}"}
        return {"error": None}
    if phase == "second":
        checkpoint.restore(path)
    train_steps(strategy, model, optimizer, iterator, step, checkpoint, phase, path)
    final = {k: v.full_tensor() for k, v in model.net.state_dict().items()}
    local = {k: list(v.to_local().shape) for k, v in model.net.state_dict().items()}
    return {
        "seen": model.seen,
        "step": int(step),
        "final": final,
        "local_shapes": local,
        "rank": torch.distributed.get_rank(),
        "coords": mesh.device_mesh.get_coordinate(),
    }


class IdLedger(torch.nn.Module):
    """A pipeline's first layer: records the ids of each micro-batch it runs, drops them."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[int]] = []

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen.append(features[:, -1].long().tolist())
        return features[:, :-1]


class Interrupted(Exception):
    pass


class StopAfter(sg.keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 == STOP:
            raise Interrupted  # every process at the same batch: as a job stopped there


def pipe_fit(phase: str, stages: int, replicas: int) -> dict:
    strategy = sg.distribute.experimental.PipelineStrategy(
        stages, num_replicas=replicas, schedule="GPipe", num_microbatches=2
    )
    torch.manual_seed(0)
    ledger = IdLedger()
    with strategy.scope():
        keras_model = sg.keras.Model(torch.nn.Sequential(ledger, *build_model()))
    keras_model.compile(
        sg.keras.optimizers.SGD(0.1, momentum=0.9),
        sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    callbacks = [sg.keras.callbacks.BackupAndRestore("pipe-backup", save_freq=STOP)]
    if phase == "first":
        callbacks.append(StopAfter())
    error = None
    try:
        keras_model.fit(dataset(), epochs=1, verbose=0, callbacks=callbacks)
    except Interrupted:
        pass
    except Exception as e:  # recorded: the test reads its type and words
        error = f"{type(e).__name__}: {e}"
    module = keras_model.module
    pipe = strategy.extended.pipeline_of(module)
    pipe.gather_module(module)  # every stage's weights, on every process
    final = {k: v.detach().clone() for k, v in module.state_dict().items()}
    # The pipeline's own checkpoint (stage files): restored on as many stages, refused on others.
    if phase == "first":
        pipe.save("pipe-stages", keras_model.optimizer.torch_optimizer)
        stage_files = None
    else:
        try:
            pipe.restore("pipe-stages")
            stage_files = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
        except sg.errors.CheckpointError as e:
            stage_files = f"{type(e).__name__}: {e}"
    return {
        "seen": ledger.seen,
        "final": final,
        "error": error,
        "stage_files": stage_files,
        "stage": strategy.stage_index,
        "replica": strategy.replica_index,
    }


for task in sys.argv[1:]:
    kind, phase, a, b = task.split(":")
    result = {"mesh": mesh_loop, "pipe": pipe_fit}[kind](phase, int(a), int(b))
    torch.save(result, f"{task.replace(':', '-')}-{torch.distributed.get_rank()}.pt")
