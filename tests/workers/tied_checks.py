"""Tied parameters (GPT-2's ``lm_head.weight is transformer.wte.weight``) on real jobs; see
tests/real_models/test_tied.py, which starts them and checks what they write.

argv: MODE OUT.

- ``collective`` (2 processes, TF_CONFIG): GPT-2 trained under MultiWorkerMirroredStrategy and
  under FullyShardedStrategy (default wrap); an explicit ``wrap=`` that splits the tie; a
  sharded checkpoint of the FSDP model restored into a fresh one; ``sg.saved_model.save`` of it.
- ``ps`` (``stratagem run -n 2 --ps 1``): GPT-2 under sync ParameterServerStrategy, each worker
  on its half of every global batch; a checkpoint the chief writes.
- ``coordinator`` (``stratagem run --chief -n 1 --ps 1``): GPT-2 trained by scheduled
  functions (its worker rebuilds the model, its ``config`` and ``generation_config`` included,
  each call), then by ``Model.fit`` on its own loss.

Workers are seeded differently: the chief's initial values must win. The chief writes tensors
(``torch.save``, read back with ``weights_only=True``) and a JSON of facts under OUT.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch

import stratagem as sg
from real_models import hf_models

# Every task imports the model's module, as a program using GPT-2 does: a coordinator's worker
# rebuilds the chief's model from classes of modules it has imported (transformers imports its
# models lazily, on first use, which a worker serving the chief never reaches).
GPT2LMHeadModel = hf_models.transformers.GPT2LMHeadModel

MODE, OUT = sys.argv[1], Path(sys.argv[2])
STEPS, GLOBAL_BATCH, LR = 3, 8, 0.5


def batches() -> list[torch.Tensor]:
    """The global batches: token ids, which are also the labels."""
    return [hf_models.tokens(GLOBAL_BATCH, seed=10 + i) for i in range(STEPS)]


def tied(model: torch.nn.Module) -> bool:
    return model.lm_head.weight is model.transformer.wte.weight


def whole(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a tensor (gathered from its shards: every process calls it)."""
    t = t.detach()
    return t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t.clone()


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: whole(t) for name, t in model.state_dict().items()}


def lm_step(strategy, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """One step of GPT-2's own loss; each replica's loss is its share of the global mean."""

    def step(ids: torch.Tensor) -> None:
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss / strategy.num_replicas_in_sync
        loss.backward()
        optimizer.step()

    return step


def train_on_global_batches(strategy, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    with strategy.scope():
        model = hf_models.gpt2(seed=seed)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = sg.data.Dataset.from_tensor_slices(torch.cat(batches())).batch(GLOBAL_BATCH)
    step = lm_step(strategy, model, optimizer)
    for ids in strategy.experimental_distribute_dataset(data):
        strategy.run(step, args=(ids,))
    return model, optimizer


def collective() -> None:
    from torch.distributed.fsdp import FSDPModule

    fsdp = sg.distribute.experimental.FullyShardedStrategy
    mwms = sg.distribute.MultiWorkerMirroredStrategy()
    rank = mwms.cluster_resolver.task_id
    seed = 100 + rank  # the chief's (100) must win
    facts: dict = {}
    tensors: dict = {}

    model, _ = train_on_global_batches(mwms, seed)
    facts["mwms_tied"] = tied(model)
    tensors["mwms"] = weights(model)

    strategy = fsdp()
    model, optimizer = train_on_global_batches(strategy, seed)
    facts["fsdp_tied"] = tied(model)
    facts["fsdp_units"] = [p for p, m in model.named_modules() if isinstance(m, FSDPModule)]
    tensors["fsdp"] = weights(model)

    # A sharded (DCP) checkpoint, restored into a fresh sharded model seeded otherwise.
    checkpoint = sg.train.Checkpoint(model=model, optimizer=optimizer)
    facts["sharded_path"] = checkpoint.save(OUT / "sharded" / "ckpt")
    with strategy.scope():
        fresh = hf_models.gpt2(seed=7)
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=LR)  # over the shards
    sg.train.Checkpoint(model=fresh, optimizer=fresh_optimizer).restore(facts["sharded_path"])
    facts["restored_tied"] = tied(fresh)
    tensors["restored"] = weights(fresh)

    with warnings.catch_warnings():  # no program without an example input: weights only
        warnings.simplefilter("ignore")
        sg.saved_model.save(model, str(OUT / "saved_fsdp"))

    try:
        with fsdp(wrap="transformer").scope():
            hf_models.gpt2(seed=seed)
        facts["split_wrap"] = "no error"
    except sg.errors.SharedParameterError as e:
        facts["split_wrap"] = f"{type(e).__name__}: {e}"
    write(rank == 0, facts, tensors)


def ps() -> None:
    strategy = sg.distribute.ParameterServerStrategy(mode="sync")
    # Only workers get here: on the ps task the constructor served the job and exited.
    rank = strategy.cluster_resolver.task_id
    with strategy.scope():
        model = hf_models.gpt2(seed=100 + rank)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def my_half(ctx: sg.distribute.InputContext) -> list[torch.Tensor]:
        size = GLOBAL_BATCH // ctx.num_input_pipelines
        start = ctx.input_pipeline_id * size
        return [ids[start : start + size] for ids in batches()]

    def step(ids: torch.Tensor) -> None:
        # Sync mode applies the mean of the workers' gradients: each loss is its own mean.
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()

    for ids in strategy.distribute_datasets_from_function(my_half):
        strategy.run(step, args=(ids,))
    strategy.pull()
    facts = {"ps_tied": tied(model), "ps_variables": _ps_variables(strategy)}
    # The chief brings the ps's values home and writes; the others return at once.
    sg.train.Checkpoint(model=model).save(OUT / "ps_ckpt" / "ckpt")
    write(strategy.extended.should_checkpoint, facts, {"ps": weights(model)})


def _ps_variables(strategy) -> int:
    """How many variables the ps holds (one ps, no partitioner: a shard each)."""
    return sum(s["shards"] for s in strategy.ps_stats())


def coordinator() -> None:
    resolver = sg.distribute.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type in ("worker", "ps"):
        sg.distribute.Server(resolver).join()
        return
    strategy = sg.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = sg.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model = hf_models.gpt2(seed=100)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def step(ids: torch.Tensor) -> bool:
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        return tied(model)  # on the worker: its copies

    values = [coordinator.schedule(step, args=(ids,)) for ids in batches()]
    coordinator.join()
    facts = {
        "worker_tied": [v.fetch() for v in values],
        "chief_tied": tied(model),
        "ps_variables": _ps_variables(strategy),
    }
    # Model.fit through the coordinator on GPT-2's own loss (no compiled loss): the same
    # global batches, in order (one worker), as steps of one function each.
    with strategy.scope():
        fitted = sg.keras.Model(hf_models.gpt2(seed=100))
        fitted.compile(optimizer=sg.keras.optimizers.SGD(LR))
    ids = torch.cat(batches())
    history = fitted.fit(
        ids, ids, batch_size=GLOBAL_BATCH, epochs=1, steps_per_epoch=STEPS, shuffle=False
    )
    facts["fit_loss"] = history.history["loss"]
    facts["fit_tied"] = tied(fitted.module)
    write(True, facts, {"coordinator": weights(model), "coordinator_fit": weights(fitted.module)})


def write(chief: bool, facts: dict, tensors: dict) -> None:
    if chief:
        for name, value in tensors.items():
            torch.save(value, OUT / f"{name}.pt")
        (OUT / f"{MODE}.json").write_text(json.dumps(facts, indent=1))
    print(f"tied checks {MODE} done", flush=True)


{"collective": collective, "ps": ps, "coordinator": coordinator}[MODE]()
