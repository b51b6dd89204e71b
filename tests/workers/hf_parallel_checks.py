"""Hugging Face models under the data-parallel strategies and the mixed layouts; see
tests/real_models/test_parallel_layouts.py, which starts the jobs and checks what they write.

argv: MODE OUT.

- ``two`` (2 processes): HF's ResNet (BatchNorm) a few SGD steps under
  MultiWorkerMirroredStrategy, each worker on its half of every global batch, and through
  ``sg.keras.Model.fit`` on its own loss; ResNet, BERT and the Llama-style decoder under
  FullyShardedStrategy the same way, and ResNet on a data-parallel MeshStrategy; GPT-2's
  ``fit`` on its own loss (no compiled loss, ``y`` reaching ``forward`` as ``labels=``) under
  FullyShardedStrategy and under a data-parallel MeshStrategy, and the named error of a last
  batch that mesh cuts unevenly.
- ``four`` (4 processes): GPT-2 traced and cut at a module path on a pipeline of 2 stages x 2
  data-parallel replicas (``train_step`` and ``fit``); GPT-2 on a ``(batch=2, model=2)``
  mesh, data- and tensor-parallel at once.

- ``ps`` (``stratagem run -n 2 --ps 1``): ResNet under sync ParameterServerStrategy, each
  worker on its half of every global batch.
- ``coordinator`` (``stratagem run --chief -n 1 --ps 1``): ResNet trained by functions a
  ClusterCoordinator schedules on its one worker.

Workers are seeded differently where the strategy must make them start alike. Each rank writes
``OUT/<check>-rank<r>.pt`` (tensors and numbers, read back with ``weights_only=True``); the
test computes the one-process references.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import stratagem as sg
from real_models import hf_models
from real_models.hf_models import (
    SHARDED_BATCH,
    SHARDED_LR,
    bert_batches,
    llama_batches,
)
from real_models.lm_pipeline import fit_gpt2, lm_batches, lm_loss, make_optimizer

# Every task imports the model's module, as a program using ResNet does: a coordinator's worker
# rebuilds the chief's model from classes of modules it has imported (transformers imports its
# models lazily, on first use, which a worker serving the chief never reaches).
ResNetForImageClassification = hf_models.transformers.ResNetForImageClassification

MODE, OUT = sys.argv[1], Path(sys.argv[2])

# ResNet: as tests/real_models/test_parallel_layouts.py.
RESNET_STEPS, RESNET_BATCH, RESNET_LR = 3, 8, 0.1
# GPT-2's fit: sequences in global batches of 4; under FSDP 11 of them, so that the last batch
# (3) splits 2 + 1; a mesh cannot run GPT-2 on such a batch (the test says why): 12 there.
GPT2_BATCH, GPT2_EPOCHS, GPT2_LR = 4, 2, 0.5


def resnet_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (
            hf_models.images(RESNET_BATCH, seed=20 + i),
            hf_models.labels(RESNET_BATCH, 4, seed=30 + i),
        )
        for i in range(RESNET_STEPS)
    ]


def whole(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a tensor (gathered from its shards: every process calls it)."""
    t = t.detach()
    return t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t.clone()


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: whole(t) for name, t in model.state_dict().items()}


def save(check: str, rank: int, value: dict) -> None:
    torch.save(value, OUT / f"{check}-rank{rank}.pt")


# ---------------------------------------------------------------- two processes


def resnet_loop(mwms, rank: int, check: str = "resnet-mwms") -> None:
    """A custom loop: each worker's loss is its mean over its half, over the replicas."""
    with mwms.scope():
        model = hf_models.resnet(seed=100 + rank).train()  # the chief's (100) must win
        optimizer = torch.optim.SGD(model.parameters(), lr=RESNET_LR)

    def my_half(ctx: sg.distribute.InputContext) -> list[tuple[torch.Tensor, torch.Tensor]]:
        size = ctx.get_per_replica_batch_size(RESNET_BATCH)
        lo = ctx.input_pipeline_id * size
        return [(x[lo : lo + size], y[lo : lo + size]) for x, y in resnet_batches()]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        loss = model(pixel_values=x, labels=y).loss / mwms.num_replicas_in_sync
        loss.backward()
        optimizer.step()

    for x, y in mwms.distribute_datasets_from_function(my_half):
        mwms.run(step, args=(x, y))
    save(check, rank, {"state": state(model), "sharded": sharded(model)})


def resnet_fit(mwms, rank: int) -> None:
    """fit on ResNet's own loss: the labels reach forward as labels=."""
    with mwms.scope():
        model = sg.keras.Model(hf_models.resnet(seed=100 + rank))
        model.compile(sg.keras.optimizers.SGD(RESNET_LR))
    x = torch.cat([b[0] for b in resnet_batches()])
    y = torch.cat([b[1] for b in resnet_batches()])
    history = model.fit(x, y, batch_size=RESNET_BATCH, epochs=1, shuffle=False, verbose=0)
    save("resnet-fit-mwms", rank, {"state": state(model.module), "loss": history.history["loss"]})


def sharded(model: torch.nn.Module) -> list[str]:
    """The parameters a strategy made DTensors (FSDP's shards, a mesh's layouts)."""
    return sorted(
        n for n, p in model.named_parameters() if isinstance(p, torch.distributed.tensor.DTensor)
    )


def transformer_loop(strategy, check: str, rank: int, build, batches) -> None:
    """A custom loop over dict batches, each worker on its half of every global batch: the
    model's own loss (a mean over its half: every half has as many examples and tokens), over
    the replicas. ``build(seed)`` makes the model."""
    with strategy.scope():
        model = build(seed=100 + rank)  # the chief's (100) must win
        optimizer = torch.optim.SGD(model.parameters(), lr=SHARDED_LR)

    def my_half(ctx: sg.distribute.InputContext) -> list[dict[str, torch.Tensor]]:
        size = ctx.get_per_replica_batch_size(SHARDED_BATCH)
        lo = ctx.input_pipeline_id * size
        return [{k: v[lo : lo + size] for k, v in b.items()} for b in batches]

    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(**batch).loss / strategy.num_replicas_in_sync
        loss.backward()
        optimizer.step()
        return loss.detach()

    losses = [
        float(strategy.reduce("SUM", strategy.run(step, args=(batch,)), axis=None))
        for batch in strategy.distribute_datasets_from_function(my_half)
    ]
    save(check, rank, {"state": state(model), "losses": losses, "sharded": sharded(model)})


def gpt2_fit(strategy, check: str, rank: int, examples: int) -> None:
    """GPT-2's fit with no compiled loss: its own, from the labels fit passes it."""
    tokens = hf_models.tokens(examples)
    with strategy.scope():
        model = sg.keras.Model(hf_models.gpt2(seed=100 + rank))
        model.compile(optimizer=sg.keras.optimizers.SGD(GPT2_LR))
    history = model.fit(
        tokens, tokens, batch_size=GPT2_BATCH, epochs=GPT2_EPOCHS, shuffle=False, verbose=0
    )
    module = model.module
    save(
        check,
        rank,
        {
            "state": state(module),
            "loss": history.history["loss"],
            "tied": module.lm_head.weight is module.transformer.wte.weight,
        },
    )


def resnet_mesh(rank: int) -> None:
    """ResNet on a data-parallel (batch=2) mesh: each global batch one DTensor split along
    ``batch``; the step computes on the global batch (its loss the global mean)."""
    strategy = sg.distribute.experimental.MeshStrategy(sg.dtensor.create_mesh([("batch", 2)]))
    with strategy.scope():
        model = hf_models.resnet(seed=100).train()
        optimizer = torch.optim.SGD(model.parameters(), lr=RESNET_LR)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(pixel_values=x, labels=y).loss
        loss.backward()
        optimizer.step()
        return loss.detach()

    losses = [
        float(strategy.reduce("MEAN", strategy.run(step, args=batch), axis=None))
        for batch in strategy.experimental_distribute_dataset(resnet_batches())
    ]
    save("resnet-mesh", rank, {"state": state(model), "losses": losses, "sharded": sharded(model)})


def two() -> None:
    mwms = sg.distribute.MultiWorkerMirroredStrategy()
    rank = mwms.cluster_resolver.task_id
    resnet_loop(mwms, rank)
    resnet_fit(mwms, rank)
    fsdp = sg.distribute.experimental.FullyShardedStrategy
    resnet_loop(fsdp(), rank, "resnet-fsdp")
    transformer_loop(fsdp(), "bert-fsdp", rank, hf_models.bert, bert_batches())
    transformer_loop(fsdp(), "llama-fsdp", rank, hf_models.llama, llama_batches())
    resnet_mesh(rank)
    gpt2_fit(sg.distribute.experimental.FullyShardedStrategy(), "gpt2-fit-fsdp", rank, 11)
    mesh = sg.dtensor.create_mesh([("batch", 2)])
    gpt2_fit(sg.distribute.experimental.MeshStrategy(mesh), "gpt2-fit-mesh", rank, 12)
    try:  # 11: the last batch (3) cut 2 + 1, which GPT-2's Conv1D cannot flatten on a mesh
        gpt2_fit(sg.distribute.experimental.MeshStrategy(mesh), "unused", rank, 11)
        error = "no error"
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    save("gpt2-fit-mesh-uneven", rank, {"error": error})


# ---------------------------------------------------------------- four processes


PIPELINE = {"num_microbatches": 2, "num_replicas": 2, "split_points": ["transformer.h.1"]}


def pipeline_train_step() -> None:
    """2 stages x 2 replicas: each replica runs its half of every global batch of 8 in 2
    micro-batches of 2; the tie (embedding on stage 0, head on stage 1) stays one parameter."""
    strategy = sg.distribute.experimental.PipelineStrategy(**PIPELINE)
    batches = lm_batches()
    pipe = strategy.pipeline(hf_models.gpt2(), lm_loss, sample_input=batches[0][0][:2])
    optimizer = make_optimizer(pipe.parameters())
    losses = [pipe.train_step(x, y, optimizer) for x, y in batches]
    save(
        "pipeline-dp",
        strategy.rank,
        {
            "losses": losses,
            "weights": {
                n: whole(p) for n, p in pipe.module.named_parameters(remove_duplicate=False)
            },
            "stage": pipe.stage,
            "replica": pipe.replica,
        },
    )


def pipeline_fit() -> None:
    strategy = sg.distribute.experimental.PipelineStrategy(**PIPELINE)
    history, model = fit_gpt2(strategy)
    pipe = strategy.extended.pipeline_of(model.module)
    save(
        "pipeline-dp-fit",
        strategy.rank,
        {
            "loss": history.history["loss"],
            "weights": {
                n: whole(p) for n, p in pipe.module.named_parameters(remove_duplicate=False)
            },
        },
    )


MESH_STEPS, MESH_BATCH, MESH_LR = 3, 4, 0.1


def mesh_batches() -> list[dict[str, torch.Tensor]]:
    """Causal LM batches: GPT-2 shifts ``labels`` itself."""
    return [
        {"input_ids": ids, "labels": ids}
        for ids in (hf_models.tokens(MESH_BATCH, seed=40 + i) for i in range(MESH_STEPS))
    ]


def mesh_2x2(rank: int) -> None:
    """GPT-2 on a (batch=2, model=2) mesh: Megatron's split of its projections along
    ``model``, each half of every global batch on one ``batch`` row."""
    mesh = sg.dtensor.create_mesh([("batch", 2), ("model", 2)])
    layout_map = sg.dtensor.megatron_layout_map(mesh, hf_models.gpt2())
    strategy = sg.distribute.experimental.MeshStrategy(mesh, layout_map)
    with strategy.scope():
        model = hf_models.gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=MESH_LR)

    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    losses = []
    for batch in strategy.experimental_distribute_dataset(mesh_batches()):
        share = strategy.run(step, args=(batch,))
        losses.append(float(strategy.reduce("MEAN", share, axis=None)))
    weights = dict(model.named_parameters(remove_duplicate=False))
    save(
        "mesh-2x2",
        rank,
        {
            "losses": losses,
            "weights": {n: whole(p) for n, p in weights.items()},
            "local_shapes": {
                n: list(p.to_local().shape)
                for n, p in weights.items()
                if isinstance(p, sg.dtensor.DTensor)
            },
            "placements": {
                n: str(p.placements)
                for n, p in weights.items()
                if isinstance(p, sg.dtensor.DTensor)
            },
            "plain": sorted(n for n, p in weights.items() if not isinstance(p, sg.dtensor.DTensor)),
            "tied": model.lm_head.weight is model.transformer.wte.weight,
        },
    )


def four() -> None:
    pipeline_train_step()
    pipeline_fit()
    mesh_2x2(torch.distributed.get_rank())


# ---------------------------------------------------------------- parameter servers


def ps() -> None:
    """``stratagem run -n 2 --ps 1``: ResNet under sync ParameterServerStrategy, each worker on
    its half of every global batch (sync mode applies the mean of the workers' gradients: each
    loss is its own mean). Parameters on the ps; buffers, the BatchNorm statistics, local."""
    strategy = sg.distribute.ParameterServerStrategy(mode="sync")
    # Only workers get here: on the ps task the constructor served the job and exited.
    rank = strategy.cluster_resolver.task_id
    with strategy.scope():
        model = hf_models.resnet(seed=100 + rank).train()  # the chief's (100) must win
        optimizer = torch.optim.SGD(model.parameters(), lr=RESNET_LR)

    def my_half(ctx: sg.distribute.InputContext) -> list[tuple[torch.Tensor, torch.Tensor]]:
        size = RESNET_BATCH // ctx.num_input_pipelines
        lo = ctx.input_pipeline_id * size
        return [(x[lo : lo + size], y[lo : lo + size]) for x, y in resnet_batches()]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        model(pixel_values=x, labels=y).loss.backward()
        optimizer.step()

    for x, y in strategy.distribute_datasets_from_function(my_half):
        strategy.run(step, args=(x, y))
    strategy.pull()
    save("resnet-ps", rank, {"state": state(model)})


def coordinator() -> None:
    """``stratagem run --chief -n 1 --ps 1``: ResNet trained by functions the chief schedules
    on its one worker, in order, on the whole global batches; then the BatchNorm statistics as
    the worker sees them (fetched by one more function) and as the chief's model holds them."""
    resolver = sg.distribute.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type in ("worker", "ps"):
        sg.distribute.Server(resolver).join()
        return
    strategy = sg.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = sg.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model = hf_models.resnet(seed=100).train()
        optimizer = torch.optim.SGD(model.parameters(), lr=RESNET_LR)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        optimizer.zero_grad()
        loss = model(pixel_values=x, labels=y).loss
        loss.backward()
        optimizer.step()
        return loss.item()

    def statistics() -> dict[str, torch.Tensor]:
        return {n: b.clone() for n, b in model.named_buffers()}

    values = [coordinator.schedule(step, args=batch) for batch in resnet_batches()]
    coordinator.join()
    worker_statistics = coordinator.schedule(statistics).fetch()
    parameters = {n: whole(p) for n, p in model.named_parameters()}  # the ps's values
    save(
        "resnet-coordinator",
        0,
        {
            "losses": [v.fetch() for v in values],
            "parameters": parameters,
            "worker_statistics": worker_statistics,
            "chief_statistics": {n: b.clone() for n, b in model.named_buffers()},
        },
    )


{"two": two, "four": four, "ps": ps, "coordinator": coordinator}[MODE]()
print(f"hf parallel checks {MODE} done", flush=True)
