"""Hugging Face models under the layouts the other real-model tests leave out, each a few steps
against one process on the same global batches:

- HF's ResNet (BatchNorm) under MirroredStrategy and MultiWorkerMirroredStrategy, in a custom
  loop and through ``Model.fit`` on its own loss; under FullyShardedStrategy and a
  data-parallel MeshStrategy in a custom loop;
- BERT and the Llama-style decoder under FullyShardedStrategy;
- ResNet under sync ParameterServerStrategy and trained by a ClusterCoordinator's worker;
- GPT-2's ``fit`` on its own loss (``compile()`` with no loss) under FullyShardedStrategy and a
  data-parallel MeshStrategy;
- GPT-2 traced and cut at a module path on 2 pipeline stages x 2 data-parallel replicas;
- GPT-2 on a ``(batch=2, model=2)`` mesh, data- and tensor-parallel at once.

BatchNorm under data parallelism: stratagem has no synchronised BatchNorm, and TF's
MultiWorkerMirroredStrategy and MirroredStrategy without ``SyncBatchNormalization`` do the same
thing: each replica normalises with the statistics of its own part of the global batch. So the
one-process reference is not the model on the whole global batch (a BatchNorm over 8 images is
another function than two over 4): it runs each replica's slice on its own and averages the
slices' gradients (``resnet_reference``), and a negative control shows the difference shows.
Running statistics: each replica updates its own, as TF's replica-local moving statistics; the
model a process holds, checkpoints and evaluates with afterwards has the chief's (replica 0's,
Mirrored's primary's, DDP's convention). TF reads a synchronised-on-read mean over the replicas
there instead; the porting table (docs/porting.md) says so. FullyShardedStrategy shards the
parameters only: the statistics are each process's, as under MWMS. A mesh is the exception: its
step computes on global tensors, so BatchNorm normalises with the whole global batch's
statistics, and its reference is the model on the whole batch.

Two jobs, module-scoped, each running every check of its size once
(``tests/workers/hf_parallel_checks.py``): 2 processes and 4 processes; and one parameter
server job per test (``stratagem run``, a ps task beside the workers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import stratagem as sg
from cluster_utils import ONE_WORKER_COORDINATOR, WORKERS, launch_checks, run_cluster
from real_models import hf_models
from real_models.hf_models import (
    SHARDED_LR,
    bert_batches,
    llama_batches,
)
from real_models.lm_pipeline import every_name, lm_batches, lm_loss, train_unsplit

CHECKS = WORKERS / "hf_parallel_checks.py"
# As tests/workers/hf_parallel_checks.py.
RESNET_STEPS, RESNET_BATCH, RESNET_LR = 3, 8, 0.1
GPT2_BATCH, GPT2_EPOCHS, GPT2_LR = 4, 2, 0.5
MESH_STEPS, MESH_BATCH, MESH_LR = 3, 4, 0.1
CHIEF_SEED = 100
TIED = ("transformer.wte.weight", "lm_head.weight")


def assert_same(actual: dict, expected: dict, what: str, *, rtol=1e-4, atol=1e-5) -> None:
    assert actual.keys() == expected.keys(), what
    for k in expected:
        torch.testing.assert_close(actual[k], expected[k], rtol=rtol, atol=atol, msg=f"{what}: {k}")


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def split(d: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """(parameters, BatchNorm statistics) of a ResNet state."""
    stats = {k: v for k, v in d.items() if "running_" in k or "num_batches_tracked" in k}
    return {k: v for k, v in d.items() if k not in stats}, stats


# ---------------------------------------------------------------- ResNet: the reference


def resnet_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (
            hf_models.images(RESNET_BATCH, seed=20 + i),
            hf_models.labels(RESNET_BATCH, 4, seed=30 + i),
        )
        for i in range(RESNET_STEPS)
    ]


@contextlib.contextmanager
def statistics_kept(model: torch.nn.Module) -> Iterator[None]:
    """The BatchNorm statistics as they were on entry, whatever ran inside."""
    saved = {n: b.clone() for n, b in model.named_buffers()}
    yield
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(saved[n])


def resnet_reference(replicas: int, statistics_of: int = 0) -> tuple[dict, list[float]]:
    """The chief's ResNet trained in one process: each global batch cut in ``replicas`` slices
    (torch.chunk's cut, the strategies' for these even batches), each slice through the model
    on its own (its own batch statistics) and its mean loss over the replicas, the slices'
    gradients summed; the running statistics those of slice ``statistics_of`` alone.
    ``replicas=1`` is the model on the whole global batch. (state, global losses)."""
    model = hf_models.resnet(seed=CHIEF_SEED).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=RESNET_LR)
    losses = []
    for x, y in resnet_batches():
        optimizer.zero_grad()
        total = 0.0
        for r, (xr, yr) in enumerate(zip(x.chunk(replicas), y.chunk(replicas), strict=True)):
            keep = statistics_kept(model) if r != statistics_of else contextlib.nullcontext()
            with keep:  # (backward before the statistics are put back: it reads them)
                loss = model(pixel_values=xr, labels=yr).loss / replicas
                loss.backward()
            total += loss.item()
        optimizer.step()
        losses.append(total)
    return state(model), losses


@pytest.fixture(scope="module")
def per_replica() -> dict[int, tuple[dict, list[float]]]:
    """Two replicas' reference, with replica 0's and with replica 1's running statistics."""
    return {r: resnet_reference(2, statistics_of=r) for r in (0, 1)}


def test_per_replica_batch_statistics_are_another_function_than_the_whole_batch(per_replica):
    # The negative control: were the strategies' BatchNorm over the global batch (synchronised),
    # the checks below against the per-replica reference would fail, and conversely.
    whole, _ = resnet_reference(1)
    params, _ = split(per_replica[0][0])
    differs = [k for k, v in split(whole)[0].items() if not torch.allclose(v, params[k], atol=1e-4)]
    assert len(differs) > len(params) // 2, differs
    # And the two replicas' running statistics differ: which one a process keeps shows.
    first, second = split(per_replica[0][0])[1], split(per_replica[1][0])[1]
    assert not torch.allclose(
        first["resnet.embedder.embedder.normalization.running_mean"],
        second["resnet.embedder.embedder.normalization.running_mean"],
    )


# ---------------------------------------------------------------- ResNet: one process, threads


def test_resnet_on_two_mirrored_replicas_equals_one_process_of_per_replica_slices(per_replica):
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = hf_models.resnet(seed=CHIEF_SEED).train()
        optimizer = torch.optim.SGD(model.parameters(), lr=RESNET_LR)
    x = torch.cat([b[0] for b in resnet_batches()])
    y = torch.cat([b[1] for b in resnet_batches()])
    data = sg.data.Dataset.from_tensor_slices((x, y)).batch(RESNET_BATCH)

    def step(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(pixel_values=images, labels=labels).loss / strategy.num_replicas_in_sync
        loss.backward()
        optimizer.step()
        return loss.detach()

    losses = [
        float(strategy.reduce("SUM", strategy.run(step, args=batch), axis=None))
        for batch in strategy.experimental_distribute_dataset(data)
    ]
    expected, expected_losses = per_replica[0]
    assert losses == pytest.approx(expected_losses, abs=1e-5)
    # The parameters, and the primary's statistics: replica 0's.
    assert_same(state(model), expected, "Mirrored ResNet")


@pytest.mark.parametrize("loss", ["own", "compiled"])
def test_resnet_fit_on_two_mirrored_replicas_then_evaluate_with_the_kept_statistics(
    per_replica, loss
):
    """fit on the model's own loss (labels reach forward as labels=), or on a compiled Keras
    loss reading the output's .logits; then evaluate, in eval mode: BatchNorm normalises with
    the running statistics the model kept."""
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = sg.keras.Model(hf_models.resnet(seed=CHIEF_SEED))
        if loss == "own":
            model.compile(sg.keras.optimizers.SGD(RESNET_LR))
        else:
            model.compile(
                sg.keras.optimizers.SGD(RESNET_LR),
                sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
    x = torch.cat([b[0] for b in resnet_batches()])
    y = torch.cat([b[1] for b in resnet_batches()])
    history = model.fit(x, y, batch_size=RESNET_BATCH, epochs=1, shuffle=False, verbose=0)
    expected, losses = per_replica[0]
    assert history.history["loss"] == pytest.approx([sum(losses) / len(losses)], abs=1e-5)
    assert_same(state(model.module), expected, "Mirrored ResNet fit")
    reference = hf_models.resnet(seed=7)
    reference.load_state_dict(expected)
    with torch.no_grad():
        logits = reference.eval()(pixel_values=x).logits
    evaluated = model.evaluate(x, y, batch_size=RESNET_BATCH, verbose=0)
    want = torch.nn.functional.cross_entropy(logits, y).item()
    if loss == "compiled":
        accuracy = (logits.argmax(-1) == y).float().mean().item()
        assert evaluated[1] == pytest.approx(accuracy)
        evaluated = evaluated[0]
    assert evaluated == pytest.approx(want, rel=1e-5)


# ---------------------------------------------------------------- two processes


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf-parallel-two")
    results = run_cluster(CHECKS, 2, out, args=["two", str(out)], timeout=300)
    for i, r in enumerate(results):
        r.check(f"worker {i}")
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf-parallel-four")
    results = run_cluster(CHECKS, 4, out, args=["four", str(out)], timeout=420)
    for i, r in enumerate(results):
        r.check(f"worker {i}")
    return out


def saved(out: Path, check: str, ranks: int) -> list[dict]:
    return [torch.load(out / f"{check}-rank{r}.pt", weights_only=True) for r in range(ranks)]


@pytest.mark.multiprocess
def test_resnet_under_multi_worker_mirrored_equals_one_process_of_per_replica_slices(
    two, per_replica
):
    chief, worker = (s["state"] for s in saved(two, "resnet-mwms", 2))
    params, chief_stats = split(chief)
    expected_params, expected_stats = split(per_replica[0][0])
    assert_same(params, expected_params, "MWMS ResNet")
    assert_same(split(worker)[0], expected_params, "MWMS ResNet, worker 1")
    # Each worker's statistics are its own replica's (TF's replica-local moving statistics);
    # the chief's are what it checkpoints.
    assert_same(chief_stats, expected_stats, "the chief's statistics")
    assert_same(split(worker)[1], split(per_replica[1][0])[1], "worker 1's statistics")


@pytest.mark.multiprocess
def test_resnet_fit_on_its_own_loss_under_multi_worker_mirrored(two, per_replica):
    expected, losses = per_replica[0]
    for rank, s in enumerate(saved(two, "resnet-fit-mwms", 2)):
        assert s["loss"] == pytest.approx([sum(losses) / len(losses)], abs=1e-5), rank
        params, stats = split(s["state"])
        assert_same(params, split(expected)[0], f"MWMS ResNet fit, worker {rank}")
        assert_same(stats, split(per_replica[rank][0])[1], f"worker {rank}'s statistics")


@pytest.mark.multiprocess
def test_resnet_under_fully_sharded_equals_one_process_of_per_replica_slices(two, per_replica):
    """FSDP shards the parameters and leaves the BatchNorm statistics whole on every process:
    they move with each process's own half, as under MWMS (the chief's initial ones
    broadcast)."""
    expected_params, _ = split(per_replica[0][0])
    for rank, s in enumerate(saved(two, "resnet-fsdp", 2)):
        params, stats = split(s["state"])
        assert s["sharded"] == sorted(expected_params), rank  # every parameter a shard
        assert_same(params, expected_params, f"FSDP ResNet, worker {rank}")
        assert_same(stats, split(per_replica[rank][0])[1], f"worker {rank}'s statistics")


@pytest.mark.multiprocess
def test_resnet_on_a_data_parallel_mesh_equals_one_process_on_the_whole_global_batch(
    two, per_replica
):
    """A mesh step computes on global tensors: BatchNorm's statistics are those of the whole
    global batch split over the replicas (DTensor reduces over the batch dimension: TF
    DTensor's BatchNormalization on a batch-sharded input does the same), so the reference is
    the model on the whole batch, not the per-replica slices Mirrored, MWMS and FSDP give."""
    expected, losses = resnet_reference(1)
    per_replica_params = split(per_replica[0][0])[0]
    for rank, s in enumerate(saved(two, "resnet-mesh", 2)):
        assert s["sharded"] == sorted(per_replica_params), rank  # every parameter on the mesh
        assert s["losses"] == pytest.approx(losses, abs=1e-5), rank
        assert_same(s["state"], expected, f"mesh ResNet, rank {rank}")
        moved = max(
            (v - per_replica_params[k]).abs().max().item() for k, v in split(s["state"])[0].items()
        )
        assert moved > 1e-3, (rank, moved)  # and not the per-replica one


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("check", "build", "batches"),
    [
        ("bert-fsdp", hf_models.bert, bert_batches),
        ("llama-fsdp", hf_models.llama, llama_batches),
    ],
    ids=["bert", "llama"],
)
def test_a_transformer_under_fully_sharded_equals_one_process(two, check, build, batches):
    """BERT (dict inputs, a padding mask, class labels) and the Llama-style decoder (rotary
    tables made in forward, untied head), sharded over 2 processes, each on its half of every
    global batch: the chief's model trained on the whole batches in one process."""
    model = build(seed=CHIEF_SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=SHARDED_LR)
    losses = []
    for batch in batches():
        optimizer.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    expected = state(model)
    trainable = sorted(n for n, p in model.named_parameters())
    for rank, s in enumerate(saved(two, check, 2)):
        assert s["sharded"] == trainable, rank  # every parameter a shard
        assert s["losses"] == pytest.approx(losses, abs=1e-5), rank
        assert_same(s["state"], expected, f"{check}, worker {rank}")


def gpt2_hand_trained(examples: int) -> tuple[dict, list[float]]:
    """GPT-2 (the chief's) trained by the loop anyone writes: its own loss, SGD, fit's batches.
    (state, each epoch's loss: its mean over examples, as fit logs it)."""
    tokens = hf_models.tokens(examples)
    model = hf_models.gpt2(seed=CHIEF_SEED).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=GPT2_LR)
    epoch_losses = []
    for _ in range(GPT2_EPOCHS):
        weighted = 0.0
        for lo in range(0, examples, GPT2_BATCH):
            batch = tokens[lo : lo + GPT2_BATCH]
            optimizer.zero_grad()
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            weighted += loss.item() * len(batch)
        epoch_losses.append(weighted / examples)
    return state(model), epoch_losses


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("check", "examples"),
    # 11 under FSDP: the last global batch (3) splits 2 + 1. The mesh gets 12: see the next
    # test for 11.
    [("gpt2-fit-fsdp", 11), ("gpt2-fit-mesh", 12)],
    ids=["fully-sharded", "data-parallel-mesh"],
)
def test_gpt2_fit_on_its_own_loss_equals_one_process(two, check, examples):
    expected, losses = gpt2_hand_trained(examples)
    for rank, s in enumerate(saved(two, check, 2)):
        assert s["tied"], rank
        assert s["loss"] == pytest.approx(losses, abs=1e-5), rank
        assert_same(s["state"], expected, f"{check}, worker {rank}")


@pytest.mark.multiprocess
def test_an_uneven_last_batch_of_gpt2_on_a_mesh_is_a_named_error(two):
    # A mesh cuts the last batch of 11 sequences (3) 2 + 1, and GPT-2's Conv1D flattens the
    # batch (x.view(-1, width)), which DTensor cannot do across an uneven cut.
    for rank, s in enumerate(saved(two, "gpt2-fit-mesh-uneven", 2)):
        error = s["error"]
        assert error.startswith(
            "ShardingRuleError: DTensor cannot run aten.view.default in Conv1D on a tensor "
            "whose dimension 0 (size 3) the mesh cuts unevenly along 'batch' (2 parts: 2 + 1)"
        ), (rank, error)
        assert "Give global batches that divide by 2" in error, (rank, error)


# ---------------------------------------------------------------- parameter servers


@pytest.mark.multiprocess
def test_resnet_under_sync_parameter_servers_equals_one_process_of_per_replica_slices(
    tmp_path, per_replica
):
    """The parameters live on the ps and take the mean of the two workers' gradients; the
    BatchNorm statistics are buffers, which stay on each worker: its own half's, as under
    MWMS."""
    launch_checks(CHECKS, tmp_path, "ps", "-n", "2", "--ps", "1", done="hf parallel checks ps done")
    expected_params, _ = split(per_replica[0][0])
    for rank in (0, 1):
        params, stats = split(saved(tmp_path, "resnet-ps", 2)[rank]["state"])
        assert_same(params, expected_params, f"sync ps ResNet, worker {rank}")
        assert_same(stats, split(per_replica[rank][0])[1], f"worker {rank}'s statistics")


@pytest.mark.multiprocess
def test_the_coordinators_one_worker_trains_resnet_as_one_process_on_the_whole_batches(
    tmp_path,
):
    """One worker runs the scheduled steps in order, each on a whole global batch: the model in
    one process. The BatchNorm statistics are ps variables that do not train, as TF2 places
    every variable of the scope on a ps: the worker's forward changes them there, and the
    chief's model reads the trained ones (not those it built)."""
    launch_checks(
        CHECKS,
        tmp_path,
        "coordinator",
        *ONE_WORKER_COORDINATOR,
        done="hf parallel checks coordinator done",
    )
    (s,) = saved(tmp_path, "resnet-coordinator", 1)
    expected, losses = resnet_reference(1)
    params, stats = split(expected)
    assert s["losses"] == pytest.approx(losses, abs=1e-5)
    assert_same(s["parameters"], params, "the ps's ResNet")  # what the chief reads
    assert_same(s["worker_statistics"], stats, "the worker's statistics")
    # The chief's statistics: the trained ones, which those it built are not (the comparison
    # tells the two apart).
    _, built = split(state(hf_models.resnet(seed=CHIEF_SEED)))
    assert_same(s["chief_statistics"], stats, "the chief's statistics")
    assert all(not torch.equal(stats[k], built[k]) for k in built)


# ---------------------------------------------------------------- four processes


def whole(per_rank: list[dict], key: str = "weights") -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    for s in per_rank:
        got.update(s[key])
    return got


@pytest.mark.multiprocess
def test_traced_gpt2_on_two_stages_by_two_replicas_trains_as_the_unsplit_model(four):
    per_rank = saved(four, "pipeline-dp", 4)
    # Rank r runs stage r % 2 of replica r // 2.
    assert [(s["stage"], s["replica"]) for s in per_rank] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    ref_losses, ref = train_unsplit(hf_models.gpt2())
    for rank, s in enumerate(per_rank):
        assert s["losses"] == pytest.approx(ref_losses, abs=1e-5), rank
    for replica in (0, 1):
        stages = per_rank[2 * replica : 2 * replica + 2]
        assert_same(whole(stages), ref, f"replica {replica}")
        first, last = stages[0]["weights"], stages[1]["weights"]
        assert TIED[0] in first and TIED[1] in last and TIED[1] not in first
        assert torch.equal(first[TIED[0]], last[TIED[1]])


@pytest.mark.multiprocess
def test_fit_of_traced_gpt2_on_two_stages_by_two_replicas_equals_the_unsplit_model(four):
    model = hf_models.gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for x, y in lm_batches(2):
        optimizer.zero_grad()
        loss = lm_loss(model(input_ids=x, use_cache=False).logits, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    per_rank = saved(four, "pipeline-dp-fit", 4)
    for rank, s in enumerate(per_rank):
        assert s["loss"] == pytest.approx([sum(losses) / len(losses)], abs=1e-5), rank
    for replica in (0, 1):
        assert_same(whole(per_rank[2 * replica : 2 * replica + 2]), every_name(model), "fit")


@pytest.mark.multiprocess
def test_gpt2_on_a_2x2_mesh_is_data_and_tensor_parallel_and_equals_one_process(four):
    model = hf_models.gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=MESH_LR)
    losses = []
    for i in range(MESH_STEPS):
        ids = hf_models.tokens(MESH_BATCH, seed=40 + i)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    expected = every_name(model)
    for rank, s in enumerate(saved(four, "mesh-2x2", 4)):
        assert s["tied"] and s["plain"] == [], rank  # every weight on the mesh, the tie kept
        assert s["losses"] == pytest.approx(losses, abs=1e-5), rank
        assert_same(s["weights"], expected, f"2x2 mesh, rank {rank}")
        # Split along model (Megatron's column/row cut of the Conv1D (in, out) weights),
        # replicated along batch.
        shapes = s["local_shapes"]
        assert shapes["transformer.h.0.attn.c_attn.weight"] == [32, 48]
        assert shapes["transformer.h.0.attn.c_proj.weight"] == [16, 32]
        assert shapes["transformer.h.1.mlp.c_fc.weight"] == [32, 64]
        assert shapes["transformer.wte.weight"] == [96, 32]
        placements = s["placements"]["transformer.h.0.attn.c_attn.weight"]
        assert placements == "(Replicate(), Shard(dim=1))", placements
