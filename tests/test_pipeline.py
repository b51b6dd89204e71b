"""Pipeline parallelism on real stage processes (gloo): schedules against the unsplit model,
PipeDream's weight stashing (and its absence detected), checkpoints, stages x replicas, and the
example end to end through the launcher."""

from __future__ import annotations

import copy
import re
import sys

import pytest
import torch
import torch.nn.functional as F

from cluster_utils import REPO, WORKERS, Process, child_env, run_cluster
from stratagem.pipeline import one_f_one_b_order
from workers.common import (
    build_model,
    build_tied_model,
    global_batches,
    make_optimizer,
    token_batches,
)

pytestmark = pytest.mark.multiprocess

TWO_STAGE_CHECKS = [
    "grads-GPipe",
    "grads-1F1B",
    "grads-Interleaved1F1B",
    "stash-on",
    "stash-off",
    "checkpoint",
    "pipedream-train",
    "pipedream-carry",
    "tied-GPipe",
    "tied-1F1B",
    "tied-Interleaved1F1B",
    "tied-PipeDream",
    "tied-checkpoint",
    "tied-fit",
]


def _run_checks(tmp_path_factory, n: int, checks: list[str]):
    out = tmp_path_factory.mktemp(f"pipeline{n}")
    results = run_cluster(
        WORKERS / "pipeline_checks.py", n, out, args=[str(out), *checks], timeout=180
    )
    for i, r in enumerate(results):
        r.check(f"stage process {i}")
    return {
        check: [torch.load(out / f"{check}-rank{r}.pt", weights_only=False) for r in range(n)]
        for check in checks
    }


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory):
    return _run_checks(tmp_path_factory, 2, TWO_STAGE_CHECKS)


def _reference_gradients(rows: int | None = None):
    torch.manual_seed(0)
    model = build_model()
    x, y = global_batches(1)[0]
    loss = F.cross_entropy(model(x[:rows]), y[:rows])
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B"])
@pytest.mark.parametrize("rows", [24, 16], ids=["batch24", "then-batch16"])
def test_schedules_give_the_unsplit_models_gradients(two_stages, schedule, rows):
    # The second step has another batch size: torch's schedules fix shapes at their first
    # step, so the pipeline builds one schedule per size.
    ref_loss, ref = _reference_gradients(rows)
    suffix = "" if rows == 24 else "16"
    got: dict[str, torch.Tensor] = {}
    for rank, saved in enumerate(two_stages[f"grads-{schedule}"]):
        assert saved[f"loss{suffix}"] == pytest.approx(ref_loss, abs=1e-5), rank
        assert not set(got) & set(saved[f"grads{suffix}"])  # each layer on one stage only
        got.update(saved[f"grads{suffix}"])
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=1e-6, rtol=1e-5, msg=name)


def _stale_backwards(records) -> tuple[int, int]:
    """(micro-batches whose applied gradient is not that of their forward's weights, total).

    Recomputes each recorded micro-batch's vector-Jacobian product here, with the weights the
    stage had when that micro-batch's forward ran, and compares it with what the stage applied.
    """
    stale = total = 0
    for rec in records:
        layers = rec["layers"]
        stage = build_model()[int(layers[0]) : int(layers[-1]) + 1]
        for key, (grad_output, applied) in rec["backward"].items():
            stage.load_state_dict(rec["forward_weights"][key])
            out = stage(rec["inputs"][key])
            if grad_output is None:  # the last stage: the loss
                out = F.cross_entropy(out, rec["targets"][key])
            names = [n for n, _ in stage.named_parameters()]
            expected = torch.autograd.grad(out, list(stage.parameters()), grad_output)
            total += 1
            if not all(torch.allclose(e, applied[n], atol=1e-6) for n, e in zip(names, expected)):
                stale += 1
    return stale, total


def test_pipedream_backward_uses_the_weights_of_its_forward(two_stages):
    records = two_stages["stash-on"]
    stale, total = _stale_backwards(records)
    assert total == 2 * 2 * 4  # 2 stages x 2 steps x 4 micro-batches
    assert stale == 0
    # Stage 0 really had two weight versions in flight at once (else nothing was tested).
    assert records[0]["max_versions_in_flight"] == 2


def test_without_stashing_the_same_check_detects_newer_weights(two_stages):
    records = two_stages["stash-off"]
    stale_first, _ = _stale_backwards(records[:1])
    stale_last, _ = _stale_backwards(records[1:])
    # On stage 0 every micro-batch but the first of each step ran backward after an update
    # (1F1B: F0 F1 B0 F2 B1 ...); the last stage's backward follows its forward at once.
    assert stale_first == 6
    assert stale_last == 0


def simulate_pipedream(
    num_replicas: int, steps: int = 2, m: int = 4, lr: float = 0.1, drain: bool = True
):
    """PipeDream on 2 stages, computed in this process pass by pass: stage 0 in its 1F1B order
    with a weight copy per forward (the stash), stage 1 one micro-batch after another, each
    update after one micro-batch's gradients averaged over the replicas. Without ``drain`` the
    steps' micro-batches are one stream: one warm-up at the start, one drain at the end."""
    torch.manual_seed(0)
    model = build_model()
    s0, s1 = model[:2], model[2:]
    opt0 = torch.optim.SGD(s0.parameters(), lr=lr)
    opt1 = torch.optim.SGD(s1.parameters(), lr=lr)
    r_ = range(num_replicas)

    def update(module, opt, grads):
        for p, *per_replica in zip(module.parameters(), *grads):
            p.grad = sum(per_replica) / num_replicas
        opt.step()
        opt.zero_grad()

    batches = global_batches(steps)
    if not drain:
        assert num_replicas == 1  # (with replicas, each step's batch is cut per replica first)
        batches = [(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))]
        m *= steps
    for x, y in batches:
        xs = [xr.chunk(m) for xr in x.chunk(num_replicas)]
        ys = [yr.chunk(m) for yr in y.chunk(num_replicas)]
        forwards, input_grads, done = {}, {}, 0
        for kind, i in one_f_one_b_order(0, 2, m):
            if kind == "F":
                stash = copy.deepcopy(s0)
                forwards[i] = (stash, [stash(xs[r][i]) for r in r_])
                continue
            while done <= i:  # stage 1 runs micro-batches in order as their inputs arrive
                h = [forwards[done][1][r].detach().requires_grad_() for r in r_]
                g = [
                    torch.autograd.grad(
                        F.cross_entropy(s1(h[r]), ys[r][done]), [h[r], *s1.parameters()]
                    )
                    for r in r_
                ]
                input_grads[done] = [gr[0] for gr in g]
                update(s1, opt1, [gr[1:] for gr in g])
                done += 1
            stash, outs = forwards.pop(i)
            update(
                s0,
                opt0,
                [
                    torch.autograd.grad(outs[r], list(stash.parameters()), input_grads[i][r])
                    for r in r_
                ],
            )
    return {n: p.detach() for n, p in model.named_parameters()}


def _assert_weights(saved_per_rank, expected):
    got: dict[str, torch.Tensor] = {}
    for s in saved_per_rank:
        got.update(s["weights"])
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-4, msg=name)


def test_pipedream_training_matches_its_pass_by_pass_simulation(two_stages):
    saved = two_stages["pipedream-train"]
    _assert_weights(saved, simulate_pipedream(num_replicas=1))
    # ...and not the synchronous result: the updates really were per micro-batch and stale.
    torch.manual_seed(0)
    sync = build_model()
    opt = torch.optim.SGD(sync.parameters(), lr=0.1)
    for x, y in global_batches(2):
        opt.zero_grad()
        F.cross_entropy(sync(x), y).backward()
        opt.step()
    first = next(iter(saved[0]["weights"]))
    assert not torch.allclose(saved[0]["weights"][first], sync.state_dict()[first], atol=1e-3)


def test_pipedream_without_draining_keeps_micro_batches_in_flight_across_steps(two_stages):
    saved = two_stages["pipedream-carry"]
    # Between the steps stage 0 keeps its warm-up micro-batch in flight; the last stage none.
    assert saved[0]["in_flight"] == [1, 1] and saved[1]["in_flight"] == [0, 0]
    _assert_weights(saved, simulate_pipedream(num_replicas=1, drain=False))
    # ...which is not what draining after each step gives.
    drained = two_stages["pipedream-train"][0]["weights"]
    first = next(iter(drained))
    assert not torch.allclose(saved[0]["weights"][first], drained[first], atol=1e-6)
    assert saved[0]["losses"] == saved[1]["losses"]  # every process gets the mean loss


def test_checkpoint_saves_and_restores_every_stage(two_stages):
    for rank, saved in enumerate(two_stages["checkpoint"]):
        assert saved["epoch"] == 2, rank
        assert saved["resumed"] == saved["continued"], rank
        for name, value in saved["after"].items():
            torch.testing.assert_close(saved["again"][name], value, atol=0, rtol=0, msg=name)


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory):
    """2 stages x 2 data-parallel replicas: one job for every check that needs them."""
    return _run_checks(tmp_path_factory, 4, ["dp-grads", "dp-pipedream-train", "dp-tied"])


def test_two_stages_by_two_replicas(four_processes):
    results = four_processes
    # PipeDream with replicas: every micro-batch's gradients averaged over its stage's replicas.
    pipedream = results["dp-pipedream-train"]
    _assert_weights(pipedream[:2], simulate_pipedream(num_replicas=2))
    for a, b in ((0, 2), (1, 3)):  # the replicas of a stage end identical
        for name, value in pipedream[a]["weights"].items():
            torch.testing.assert_close(pipedream[b]["weights"][name], value, atol=0, rtol=0)
    saved = results["dp-grads"]
    ref_loss, ref = _reference_gradients()
    for rank, s in enumerate(saved):
        assert s["loss"] == pytest.approx(ref_loss, abs=1e-5), rank
        for name, g in s["grads"].items():  # replicas of a stage hold the averaged gradient
            torch.testing.assert_close(g, ref[name], atol=1e-6, rtol=1e-5, msg=f"{rank} {name}")
    assert set(saved[0]["grads"]) | set(saved[1]["grads"]) == set(ref)
    assert saved[0]["grads"].keys() == saved[2]["grads"].keys()


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        ("PipeDream", "PeerLostError: worker 1 (localhost:"),
        ("1F1B", "PeerLostError: worker 1 (localhost:"),
    ],
    ids=["PipeDream", "1F1B"],
)
def test_a_lost_stage_is_named_not_a_hang(tmp_path, schedule, message):
    check = f"lost-{schedule}"
    results = run_cluster(
        WORKERS / "pipeline_checks.py",
        2,
        tmp_path,
        args=[str(tmp_path), check],
        env={"STRATAGEM_OP_TIMEOUT": "20"},
    )
    for i, r in enumerate(results):
        r.check(f"stage process {i}")
    saved = torch.load(tmp_path / f"{check}-rank0.pt")
    # Named (the stage's task, the operation) and lost, not a CollectiveTimeoutError after the
    # operation timeout: a peer that ended is told from one that is slow.
    assert saved["error"].startswith(message), saved
    assert " was lost during " in saved["error"], saved


@pytest.mark.e2e
def test_example_pipedream_on_two_stages_reaches_90_percent(tmp_path):
    output = _run_example(tmp_path, 2, ["--schedule", "PipeDream"])
    accuracies = [float(a) for a in re.findall(r"Test accuracy: ([0-9.]+)", output)]
    assert len(accuracies) == 2 and min(accuracies) >= 0.90, output


@pytest.mark.e2e
def test_example_on_four_stages_writes_every_stage(tmp_path):
    # One epoch only (4 processes on a 2-core machine); the full run: docs/guides/pipelines.md.
    ckpt = tmp_path / "ckpt"
    output = _run_example(tmp_path, 4, ["--epochs", "1", "--checkpoint-dir", str(ckpt)])
    assert sorted(p.name for p in ckpt.iterdir()) == [f"stage-{s}.pt" for s in range(4)]
    for s in range(4):
        assert f"PipelineModel(stage={s}/4" in output, output
    accuracies = re.findall(r"Test accuracy: ([0-9.]+)", output)
    assert len(accuracies) == 4 and len(set(accuracies)) == 1, output  # the same predictions
    assert float(accuracies[0]) > 0.5, output  # one epoch learns (chance is 0.1)


def _run_example(tmp_path, n: int, args: list[str]) -> str:
    argv = [sys.executable, "-m", "stratagem.cli", "run", "-n", str(n)]
    argv += [str(REPO / "examples" / "pipeline.py"), *args]
    result = Process(argv, child_env(), tmp_path, f"launcher{len(args)}").wait(timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


# ---------------------------------------------------------------------- tied parameters


def _every_name(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters(remove_duplicate=False)}


def _tied_reference(tie_mlp: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The unsplit tied model, one process, 3 steps on the whole global batches."""
    torch.manual_seed(0)
    model = build_tied_model(tie_mlp)
    losses = _steps_by_hand(model, make_optimizer("sgd", model.parameters()), token_batches(3))
    return losses, _every_name(model)


def _steps_by_hand(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list
) -> list[float]:
    """One plain torch step per ``(x, y)`` batch, on its mean cross-entropy; each step's loss."""
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _assert_trained_as_the_unsplit_model(per_rank: list[dict], tie_mlp: bool) -> None:
    ref_losses, ref = _tied_reference(tie_mlp)
    got: dict[str, torch.Tensor] = {}
    for rank, saved in enumerate(per_rank):
        assert saved["error"] == "", (rank, saved["error"])
        assert saved["losses"] == pytest.approx(ref_losses, abs=1e-5), rank
        got.update(saved["weights"])  # a replica's stages together: the whole model's names
    assert got.keys() == ref.keys()
    for name, value in ref.items():
        torch.testing.assert_close(got[name], value, atol=1e-5, rtol=1e-4, msg=name)
    # Every process's copy of the tied weight (an embedding on one stage, the head on another)
    # is bit-identical: one parameter, not copies that drift apart.
    copies = [
        s["weights"][n]
        for s in per_rank
        for n in ("wte.weight", "lm_head.weight")
        if n in s["weights"]
    ]
    assert len(copies) == len(per_rank)
    for copy_ in copies[1:]:
        assert torch.equal(copy_, copies[0])


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B"])
def test_a_parameter_tied_across_stages_trains_as_one(two_stages, schedule):
    # 1F1B: the embedding and the head share a weight, on stages 0 and 1. GPipe also ties the
    # MLP's two layers across the stages, and starts the copies different (the pipeline makes
    # them one at set-up). Interleaved: the MLP's two layers are in two chunks of one rank (the
    # gradient adds up there, once), the embedding and the head on the two ranks.
    _assert_trained_as_the_unsplit_model(two_stages[f"tied-{schedule}"], schedule != "1F1B")


def test_a_parameter_tied_across_stages_and_replicas_trains_as_one(four_processes):
    # Stages x replicas: the shared gradient adds up over the stages of each replica, and is
    # averaged over the replicas, as the unsplit model's on the global batch.
    _assert_trained_as_the_unsplit_model(four_processes["dp-tied"], tie_mlp=False)


def test_pipedream_refuses_a_parameter_shared_between_stages(two_stages):
    for rank, saved in enumerate(two_stages["tied-PipeDream"]):
        error = saved["error"]
        assert error.startswith("SharedParameterError: schedule='PipeDream' "), (rank, error)
        # Which parameter, between which stages, and what to do.
        assert "'wte.weight' (also 'lm_head.weight') on stages 0 and 1" in error, error
        assert "'1F1B'" in error and "split_points" in error, error


def test_a_checkpoint_writes_a_tied_tensor_once_and_restores_the_tie(two_stages):
    saved = two_stages["tied-checkpoint"]
    # The first stage holding it writes the shared tensor; the other stage's file refers to it.
    assert "wte.weight" in saved[0]["written"]
    assert "lm_head.weight" not in saved[1]["written"]
    assert "fc2.weight" in saved[1]["written"]
    # A restore loads both copies from that one tensor (stage 1's copy had drifted)...
    tied_at_save = saved[0]["at_save"]["wte.weight"]
    assert torch.equal(saved[0]["restored"]["wte.weight"], tied_at_save)
    assert torch.equal(saved[1]["restored"]["lm_head.weight"], tied_at_save)
    # ...and training resumes exactly where the original went on.
    for rank, s in enumerate(saved):
        assert s["resumed"] == s["continued"], rank
        for name, value in s["after"].items():
            torch.testing.assert_close(s["again"][name], value, atol=0, rtol=0, msg=name)
    # Gathered into a whole model, every stage's layers, and the tie still one parameter.
    for rank, s in enumerate(saved):
        assert s["whole_tied"], rank
        for name, value in {**saved[0]["again"], **saved[1]["again"]}.items():
            torch.testing.assert_close(s["whole"][name], value, atol=0, rtol=0, msg=name)


def test_fit_of_a_tied_model_on_two_stages_equals_a_single_process_loop(two_stages):
    import stratagem as sg

    # One process by hand, as the worker's fit (shuffle=False: the two batches of 24 in order,
    # two epochs): torch's Adam with Keras's defaults (epsilon 1e-7), F.cross_entropy.
    torch.manual_seed(0)
    model = build_tied_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-7)
    epoch_losses = []
    for _ in range(2):
        losses = _steps_by_hand(model, optimizer, token_batches(2))
        epoch_losses.append(sum(losses) / len(losses))  # equal batches: the examples' mean
    assert model.wte.weight is model.lm_head.weight
    ref = _every_name(model)
    saved = two_stages["tied-fit"]
    got: dict[str, torch.Tensor] = {}
    for rank, s in enumerate(saved):
        assert s["loss"] == pytest.approx(epoch_losses, abs=1e-5), rank
        got.update(s["weights"])
    assert got.keys() == ref.keys()
    # The stages sum 4 micro-batches' gradients (another float32 order than one batch's), and
    # Adam divides by sqrt(v): ulp-sized gradient differences grow to ~1e-6 in 4 steps; one
    # step moves each weight by ~1e-2 (lr), so 1e-5 still tells any wrong step.
    for name, value in ref.items():
        torch.testing.assert_close(got[name], value, atol=1e-5, rtol=1e-4, msg=name)
    assert torch.equal(saved[0]["weights"]["wte.weight"], saved[1]["weights"]["lm_head.weight"])
    # The whole-model checkpoint the chief wrote holds every stage's layers, the tie one tensor.
    restored = build_tied_model()
    sg.train.Checkpoint(model=restored).restore(saved[0]["path"])
    assert restored.wte.weight is restored.lm_head.weight
    for name, p in restored.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(p.detach(), got[name], atol=0, rtol=0, msg=name)
