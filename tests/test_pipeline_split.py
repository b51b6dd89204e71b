"""Pipeline parallelism without processes: splitting, balancing, layouts, schedules' order,
clear errors, and the single-process null version of PipelineStrategy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg
from stratagem.cluster import SimpleClusterResolver
from stratagem.errors import SharedParameterError
from stratagem.pipeline import (
    PipelineLayout,
    balanced_split_points,
    check_split_points,
    one_f_one_b_order,
    resolve_split_points,
    split_sequential,
)
from stratagem.pipeline.shared import (
    check_schedule,
    find_shared_parameters,
    shared_between_stages,
)
from stratagem.pipeline.stage_pieces import run_chunks
from stratagem.pipeline.trace import TracedPieces, UntraceableModelError, check_module_paths

PipelineStrategy = sg.distribute.experimental.PipelineStrategy


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


def test_stages_are_slices_that_keep_the_unsplit_names():
    model = mlp()
    stages = split_sequential(model, [2, 4])
    assert [list(s._modules) for s in stages] == [["0", "1"], ["2", "3"], ["4"]]
    merged = {k: v for s in stages for k, v in s.state_dict().items()}
    assert merged.keys() == model.state_dict().keys()
    x = torch.randn(3, 6)
    h = x
    for s in stages:
        h = s(h)
    torch.testing.assert_close(h, model(x))


def test_split_points_by_name_and_index_agree():
    model = nn.Sequential()
    for name in ("embed", "act", "hidden", "out"):
        model.add_module(name, nn.Identity())
    assert check_split_points(model, ["hidden"], 2) == [2]
    assert check_split_points(model, [2], 2) == [2]


@pytest.mark.parametrize(
    ("points", "stages", "message"),
    [
        ([0], 2, r"split point 0 is out of range: .* in 1\.\.4 for an nn.Sequential of 5"),
        ([5], 2, r"split point 5 is out of range"),
        ([-1], 2, r"split point -1 is out of range"),
        ([3, 2], 3, r"must be strictly increasing"),
        ([2, 2], 3, r"must be strictly increasing"),
        ([2], 3, r"cut the model into 2 stages, but the pipeline has 3; give 2 split points"),
        (["9"], 2, r"split point '9' names no layer .* \['0', '1', '2', '3', '4'\]"),
        (["2.weight"], 2, r"a cut inside a layer is not possible"),
    ],
)
def test_bad_split_points_are_named(points, stages, message):
    with pytest.raises(ValueError, match=message):
        check_split_points(mlp(), points, stages)


def test_a_module_that_is_not_sequential_cannot_be_split():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)

        def forward(self, x):
            return self.a(x)

    with pytest.raises(TypeError, match=r"cannot split Net into 2 stages: only an nn.Sequential"):
        check_split_points(Net(), [1], 2)
    with pytest.raises(ValueError, match=r"of 2 layers into 3 stages"):
        resolve_split_points(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), 3, "parameters")


def test_balancing_minimises_the_largest_stage():
    assert balanced_split_points([1, 1, 1, 1], 2) == [2]
    assert balanced_split_points([1, 1, 1, 1], 4) == [1, 2, 3]
    assert balanced_split_points([8, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [1]
    assert balanced_split_points([1, 2, 3, 4, 5], 2) == [3]  # 6 | 9 beats 10 | 5
    # Ties on the largest stage go to the evener cut: no stage of a lone ReLU (cost 1).
    assert balanced_split_points([8320, 1, 16512, 1, 8256, 1, 650], 4) == [2, 3, 5]
    with pytest.raises(ValueError, match=r"cannot balance 2 layers over 3 stages"):
        balanced_split_points([1, 1], 3)


def test_balancing_by_parameters_and_by_time():
    # Linear(6,32)=224, Linear(32,32)=1056, Linear(32,4)=132 parameters (ReLU counts 1).
    assert resolve_split_points(mlp(), 2, "parameters") == [2]
    assert resolve_split_points(mlp(), 2, None) == [2]
    points = resolve_split_points(mlp(), 2, "time", torch.randn(8, 6))
    assert len(points) == 1 and 1 <= points[0] <= 4
    with pytest.raises(ValueError, match=r"pass sample_input="):
        resolve_split_points(mlp(), 2, "time")
    with pytest.raises(ValueError, match=r"split_points='flops'"):
        resolve_split_points(mlp(), 2, "flops")


def test_layout_is_stages_by_replicas():
    layout = PipelineLayout(num_stages=2, num_replicas=2)
    assert [layout.stage_of(r) for r in range(4)] == [0, 1, 0, 1]
    assert [layout.replica_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert layout.pipeline_ranks(1) == [2, 3]
    assert layout.replica_ranks(1) == [1, 3]
    interleaved = PipelineLayout(num_stages=2, stages_per_rank=2)
    assert interleaved.chunks_of(0) == [0, 2] and interleaved.chunks_of(1) == [1, 3]
    with pytest.raises(ValueError, match=r"needs 4 processes, but the job has 3"):
        layout.check_world(3)


def test_one_f_one_b_order():
    assert one_f_one_b_order(0, 2, 3) == [
        ("F", 0),
        ("F", 1),
        ("B", 0),
        ("F", 2),
        ("B", 1),
        ("B", 2),
    ]
    assert one_f_one_b_order(1, 2, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    order = one_f_one_b_order(0, 4, 8)
    assert order[:3] == [("F", 0), ("F", 1), ("F", 2)]
    assert sorted(order) == sorted([("F", i) for i in range(8)] + [("B", i) for i in range(8)])


def test_a_stage_count_that_differs_from_the_processes():
    with pytest.raises(
        ValueError, match=r"num_stages=2 x num_replicas=1 needs 2 processes, but the job has 1"
    ):
        PipelineStrategy(num_stages=2)
    two = SimpleClusterResolver(
        {"worker": ["localhost:1", "localhost:2"]}, task_type="worker", task_id=0
    )
    with pytest.raises(ValueError, match=r"needs 4 processes, but the job has 2"):
        PipelineStrategy(num_stages=4, cluster_resolver=two)
    with pytest.raises(ValueError, match=r"num_replicas=3 does not divide the job's 2 processes"):
        PipelineStrategy(num_replicas=3, cluster_resolver=two)


def test_bad_strategy_options():
    with pytest.raises(ValueError, match=r"schedule='Zero': expected one of"):
        PipelineStrategy(schedule="Zero")
    with pytest.raises(ValueError, match=r"num_microbatches must be an int >= 1, got 0"):
        PipelineStrategy(num_microbatches=0)
    with pytest.raises(ValueError, match=r"stages_per_rank=2 needs schedule='Interleaved1F1B'"):
        PipelineStrategy(schedule="GPipe", stages_per_rank=2)
    with pytest.raises(ValueError, match=r"drain_each_step=False needs schedule='PipeDream'"):
        PipelineStrategy(schedule="1F1B", drain_each_step=False)


def test_null_version_gives_the_full_batch_gradients():
    strategy = PipelineStrategy(schedule="GPipe", num_microbatches=4)
    assert strategy.num_stages == 1 and strategy.num_replicas_in_sync == 1
    model = mlp()
    pipe = strategy.pipeline(model, F.cross_entropy)
    reference = mlp()
    x, y = torch.randn(16, 6), torch.randint(0, 4, (16,))
    loss = pipe.compute_gradients(x, y)
    ref_loss = F.cross_entropy(reference(x), y)
    ref_loss.backward()
    assert loss == pytest.approx(float(ref_loss.detach()), abs=1e-6)
    for (n, p), (_, q) in zip(pipe.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)
    torch.testing.assert_close(pipe.predict(x), reference(x))


def test_micro_batches_that_do_not_divide_the_batch():
    pipe = PipelineStrategy(num_microbatches=4).pipeline(mlp(), F.cross_entropy)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    with pytest.raises(
        ValueError, match=r"the input batch of 10 does not split into 1 replica\(s\) x 4 micro"
    ):
        pipe.train_step(torch.randn(10, 6), torch.randint(0, 4, (10,)), opt)


def test_pipedream_needs_train_step_and_updates_per_micro_batch():
    pipe = PipelineStrategy(schedule="PipeDream", num_microbatches=2).pipeline(
        mlp(), F.cross_entropy
    )
    x, y = torch.randn(8, 6), torch.randint(0, 4, (8,))
    with pytest.raises(ValueError, match=r"compute_gradients needs a synchronous schedule"):
        pipe.compute_gradients(x, y)
    reference = mlp()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for xm, ym in zip(x.chunk(2), y.chunk(2)):
        ref_opt.zero_grad()
        F.cross_entropy(reference(xm), ym).backward()
        ref_opt.step()
    pipe.train_step(x, y, torch.optim.SGD(pipe.parameters(), lr=0.1))
    for (n, p), (_, q) in zip(pipe.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, msg=n)


def tied(tie_mlp: bool = False) -> nn.Sequential:
    """An embedding and a head sharing one weight (and, with ``tie_mlp``, two MLP layers)."""
    wte, head = nn.Embedding(7, 4), nn.Linear(4, 7, bias=False)
    head.weight = wte.weight
    fc1, fc2 = nn.Linear(4, 4), nn.Linear(4, 4)
    if tie_mlp:
        fc2.weight = fc1.weight
    return nn.Sequential(wte, fc1, nn.Tanh(), fc2, head)


def test_parameters_shared_between_stages_are_found_by_identity():
    two = PipelineLayout(num_stages=2)
    [tie] = find_shared_parameters(tied(), [2], two)
    assert (tie.names, tie.stages, tie.owner) == (("0.weight", "4.weight"), (0, 1), 0)
    assert tie.describe() == "'0.weight' (also '4.weight') on stages 0 and 1"
    # A tie within one stage (the MLP's two layers, both on stage 0) is that stage's own.
    [head_tie] = find_shared_parameters(tied(tie_mlp=True), [4], two)
    assert head_tie.names == ("0.weight", "4.weight")
    # Interleaved (chunks 0 and 2 on rank 0, 1 and 3 on rank 1): the MLP's tie is two chunks
    # of rank 0, one stage, so not shared between stages; the embedding's is.
    looped = PipelineLayout(num_stages=2, stages_per_rank=2)
    assert [s.names for s in find_shared_parameters(tied(tie_mlp=True), [2, 3, 4], looped)] == [
        ("0.weight", "4.weight")
    ]
    three = PipelineLayout(num_stages=3)
    assert [(s.stages, s.owner) for s in find_shared_parameters(tied(True), [2, 4], three)] == [
        ((0, 2), 0),
        ((0, 1), 0),
    ]
    assert find_shared_parameters(mlp(), [2, 4], three) == []


def test_pipedream_refuses_a_parameter_shared_between_stages_by_name():
    [tie] = find_shared_parameters(tied(), [2], PipelineLayout(num_stages=2))
    check_schedule([tie], "1F1B")  # synchronous schedules keep it one parameter
    check_schedule([], "PipeDream")
    with pytest.raises(
        SharedParameterError,
        match=r"schedule='PipeDream' cannot .*'0\.weight' \(also '4\.weight'\) on stages 0 and 1",
    ):
        check_schedule([tie], "PipeDream")


def _hand_trained_tied(batches, micro_steps: int) -> tuple[list[float], nn.Sequential]:
    """One process, plain torch: SGD on ``F.cross_entropy``; with ``micro_steps`` > 1, a step
    per micro-batch (PipeDream's updates), each batch's loss the mean of its micro-batches'."""
    torch.manual_seed(0)
    model = tied()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in batches:
        parts = []
        for xm, ym in zip(x.chunk(micro_steps), y.chunk(micro_steps), strict=True):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(xm), ym)
            loss.backward()
            optimizer.step()
            parts.append(loss.item())
        losses.append(sum(parts) / len(parts))
    return losses, model


def test_the_null_version_trains_a_tied_model_as_one_process_does():
    # One stage: the tie is within it, nothing to share; PipeDream is not refused either.
    g = torch.Generator().manual_seed(1)

    def draw() -> torch.Tensor:
        return torch.randint(0, 7, (8,), generator=g)

    batches = [(draw(), draw()) for _ in range(3)]
    # 1F1B steps once per batch; PipeDream updates after each of the 4 micro-batches.
    for schedule, micro_steps in (("1F1B", 1), ("PipeDream", 4)):
        torch.manual_seed(0)
        model = tied()
        pipe = PipelineStrategy(num_stages=1, schedule=schedule).pipeline(model, F.cross_entropy)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        losses = [pipe.train_step(x, y, opt) for x, y in batches]
        ref_losses, ref = _hand_trained_tied(batches, micro_steps)
        # The same float32 operations in another grouping (a micro-batch mean of means): a few
        # ulps apart at most, far below one SGD step's change (~1e-2).
        assert losses == pytest.approx(ref_losses, rel=1e-6), schedule
        assert model[0].weight is model[4].weight, schedule
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=f"{schedule} {name}")


# ---------------------------------------------------------------------- traced splits


class TinyLM(nn.Module):
    """Not a Sequential: an embedding tied to the head, blocks in a ModuleList, and a skip from
    the embedding to the head (a value a middle stage must hand on)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = skip = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h + skip)


class Gate(nn.Module):
    """Control flow on a tensor's value: torch.export cannot capture it as one graph."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) if x.sum() > 0 else x


def tokens(n: int) -> torch.Tensor:
    return torch.randint(0, 11, (n, 5), generator=torch.Generator().manual_seed(n))


def test_a_traced_split_keeps_the_whole_models_names_and_parameters():
    model = TinyLM()
    pieces = TracedPieces(model, ["blocks.1", "blocks.2"], tokens(2), num_chunks=3, mine=[0, 1, 2])
    # Each stage is named by what its graph reads: the tie by its use there (embedding, head).
    assert pieces.names == [
        ["emb.weight", "blocks.0.0.weight", "blocks.0.0.bias"],
        ["blocks.1.0.weight", "blocks.1.0.bias"],
        ["blocks.2.0.weight", "blocks.2.0.bias", "head.weight"],
    ]
    assert set(pieces.module.state_dict()) == set(model.state_dict())
    # The stages train the model's own parameters (the tracer's copies of the tie are gone).
    whole = dict(model.named_parameters(remove_duplicate=False))
    for name, p in pieces.module.named_parameters(remove_duplicate=False):
        assert p is whole[name], name
    # The skip is handed on through the middle stage; other batch sizes are traced again.
    middle = pieces.chunks_for(2)[1][1]
    assert len(middle.route.emits) == 2
    for n in (2, 3):
        torch.testing.assert_close(run_chunks(pieces.chunks_for(n), tokens(n)), model(tokens(n)))
    [tie] = shared_between_stages(model, pieces.chunk_of_name(), PipelineLayout(num_stages=3))
    assert tie.describe() == "'emb.weight' (also 'head.weight') on stages 0 and 2"
    # Interleaved on 2 ranks: chunks 1 and 3 here; the tie is between chunks 0 and 3.
    looped = PipelineLayout(num_stages=2, stages_per_rank=2)
    pieces4 = TracedPieces(
        model, ["blocks.0", "blocks.1", "blocks.2"], tokens(2), num_chunks=4, mine=[1, 3]
    )
    assert [c for c, _ in pieces4.chunks_for(2)] == [1, 3]
    assert "emb.weight" not in pieces4.module.state_dict()
    [tie4] = shared_between_stages(model, pieces4.chunk_of_name(), looped)
    assert (tie4.stages, tie4.owner) == ((0, 1), 0)


def test_tracing_leaves_the_model_as_it_was():
    model = TinyLM()
    TracedPieces(model, ["blocks.1"], tokens(2), num_chunks=2, mine=[0, 1])
    assert "forward" not in model.blocks[1].__dict__  # the tracer's split marker is removed
    assert model.head.weight is model.emb.weight


def test_an_untraceable_module_is_named_with_the_tracers_reason():
    model = TinyLM()
    model.blocks[1] = Gate()
    with pytest.raises(UntraceableModelError) as caught:
        TracedPieces(model, ["blocks.2"], tokens(2), num_chunks=2, mine=[0])
    message = str(caught.value)
    assert "cannot split TinyLM at ['blocks.2']" in message
    assert "could not trace module 'blocks.1' (Gate): GuardOnDataDependentSymNode:" in message
    assert "nn.Sequential" in message  # the route that needs no tracing
    assert "\n" not in message  # the tracer's reason in one line
    assert "forward" not in model.blocks[2].__dict__  # left as it was, even after a failure
    with pytest.raises(UntraceableModelError, match=r"a traced pipeline's input is one tensor"):
        TracedPieces(TinyLM(), ["blocks.1"], {"ids": tokens(2)}, num_chunks=2, mine=[0])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("points", "message"),
    [
        (["blocks.9"], r"'blocks.9' names no module of TinyLM \(its modules under 'blocks' are "),
        (["block"], r"its modules at the top are \['emb', 'blocks', 'head'\]"),
        (["blocks.1", "blocks.2"], r"cut TinyLM into 3 stages, but the pipeline has 2"),
        ("parameters", r"module paths, a list of strings .* needs an nn.Sequential"),
        ([1], r"module paths"),
    ],
)
def test_bad_module_paths_are_named(points, message):
    with pytest.raises(ValueError, match=message):
        check_module_paths(TinyLM(), points, 2)


def test_the_null_version_runs_a_traced_model_as_one_process_does():
    x, y = tokens(8), tokens(8)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    reference = TinyLM()
    ref_loss = loss_fn(reference(x), y)
    ref_loss.backward()
    # One stage; and two chunks of one process (interleaving), passed on from chunk to chunk.
    for schedule, points in (("1F1B", None), ("Interleaved1F1B", ["blocks.1"])):
        strategy = PipelineStrategy(schedule=schedule, num_microbatches=2, split_points=points)
        pipe = strategy.pipeline(TinyLM(), loss_fn, sample_input=x[:4])
        assert pipe.compute_gradients(x, y) == pytest.approx(float(ref_loss), abs=1e-6)
        for (n, p), (_, q) in zip(pipe.named_parameters(), reference.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=n)
        torch.testing.assert_close(pipe.predict(x[:3]), reference(x[:3]))


def test_a_traced_pipeline_refuses_what_it_cannot_do_by_name():
    model, x = TinyLM(), tokens(4)
    with pytest.raises(ValueError, match=r"pass sample_input="):
        PipelineStrategy().pipeline(model, F.cross_entropy)
    with pytest.raises(ValueError, match=r"schedule='PipeDream' cannot run TinyLM"):
        PipelineStrategy(schedule="PipeDream").pipeline(model, F.cross_entropy, sample_input=x)
    interleaved = PipelineStrategy(schedule="Interleaved1F1B", num_microbatches=2)
    with pytest.raises(ValueError, match=r"give split_points.*such as \['blocks.2'\]"):
        interleaved.pipeline(model, F.cross_entropy, sample_input=x)
    with pytest.raises(ValueError, match=r"cut TinyLM into 2 stages, but the pipeline has 1"):
        PipelineStrategy().pipeline(
            model, F.cross_entropy, sample_input=x, split_points=["blocks.1"]
        )
    pipe = PipelineStrategy(num_microbatches=2).pipeline(model, F.cross_entropy, sample_input=x)
    with pytest.raises(ValueError, match=r"traced for inputs of shape \(batch, 5\), got \(4, 6\)"):
        pipe.predict(torch.zeros(4, 6, dtype=torch.long))
