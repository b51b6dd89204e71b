"""Hugging Face models split at module paths (traced, not rewritten as an nn.Sequential) on two
stage processes, against the unsplit model trained on the same batches: GPT-2 (its embedding tied
to its head, on the first and the last stage) under GPipe, 1F1B and interleaved 1F1B, its
whole-model checkpoint, Model.fit, and a Llama-style decoder; and an untraceable module named."""

from __future__ import annotations

import pytest
import torch

import stratagem as sg
from cluster_utils import WORKERS, run_cluster
from real_models import hf_models
from real_models.lm_pipeline import (
    BATCH,
    every_name,
    lm_batches,
    lm_loss,
    train_unsplit,
)
from stratagem.pipeline import UntraceableModelError

CHECKS = [
    "gpt2-GPipe",
    "gpt2-1F1B",
    "gpt2-Interleaved1F1B",
    "gpt2-untied-copies",
    "gpt2-checkpoint",
    "gpt2-fit",
    "llama-1F1B",
]
TIED = ("transformer.wte.weight", "lm_head.weight")


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory):
    """Every check in one job of two stage processes (each traces the models itself)."""
    out = tmp_path_factory.mktemp("traced-pipeline")
    script = WORKERS / "traced_pipeline_checks.py"
    results = run_cluster(script, 2, out, args=[str(out), *CHECKS], timeout=420)
    for i, r in enumerate(results):
        r.check(f"stage process {i}")
    return {
        check: [torch.load(out / f"{check}-rank{r}.pt", weights_only=False) for r in range(2)]
        for check in CHECKS
    }


def _whole(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """The stages' weights put together: each rank's names are the whole model's."""
    got: dict[str, torch.Tensor] = {}
    for saved in per_rank:
        got.update(saved["weights"])
    return got


def _assert_close_to(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert got.keys() == ref.keys()
    for name, value in ref.items():
        torch.testing.assert_close(got[name], value, atol=1e-5, rtol=1e-4, msg=name)


def _tied_copies(per_rank: list[dict]) -> list[torch.Tensor]:
    return [s["weights"][n] for s in per_rank for n in TIED if n in s["weights"]]


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B"])
def test_gpt2_cut_at_a_module_path_trains_as_the_unsplit_model(two_stages, schedule):
    saved = two_stages[f"gpt2-{schedule}"]
    ref_losses, ref = train_unsplit(hf_models.gpt2())
    for rank, s in enumerate(saved):
        assert s["losses"] == pytest.approx(ref_losses, abs=1e-5), rank
    _assert_close_to(_whole(saved), ref)
    # The embedding is on the first stage, the head on the last: two processes, one parameter.
    first, last = saved[0]["weights"], saved[1]["weights"]
    assert TIED[0] in first and TIED[1] in last and TIED[1] not in first
    assert torch.equal(first[TIED[0]], last[TIED[1]])
    if schedule == "1F1B":  # predictions of another batch size (traced again) are the model's
        model = hf_models.gpt2()
        train_unsplit(model)
        with torch.no_grad():
            expected = model(input_ids=lm_batches()[0][0][:3], use_cache=False).logits
        for s in saved:
            torch.testing.assert_close(s["predictions"], expected, atol=1e-5, rtol=1e-4)


def test_the_tie_check_fails_when_the_stages_do_not_share_the_tied_weight(two_stages):
    # The negative control of the test above: the same run with no parameter found shared
    # between the stages. Each copy then trains on its own stage's gradient only.
    saved = two_stages["gpt2-untied-copies"]
    first, last = _tied_copies(saved)
    assert not torch.allclose(first, last, atol=1e-3)
    _, ref = train_unsplit(hf_models.gpt2())
    assert not torch.allclose(saved[0]["weights"][TIED[0]], ref[TIED[0]], atol=1e-3)


def test_a_whole_model_checkpoint_of_the_traced_gpt2_restores(two_stages):
    saved = two_stages["gpt2-checkpoint"]
    # Gathered for the checkpoint: every process holds the whole model, trained 2 steps.
    _, ref = train_unsplit(hf_models.gpt2(), steps=2)
    for s in saved:
        _assert_close_to(s["at_save"], ref)
    # It loads outside any pipeline, into a model with other weights, the tie one tensor...
    restored = hf_models.gpt2(seed=7)
    sg.train.Checkpoint(model=restored).restore(saved[0]["path"])
    assert restored.lm_head.weight is restored.transformer.wte.weight
    _assert_close_to(every_name(restored), saved[0]["at_save"])
    # ...and into a fresh pipeline, whose stages then train on as the original did.
    for rank, s in enumerate(saved):
        assert s["tied"], rank
        for name, value in s["restored"].items():
            assert torch.equal(value, s["at_save"][name]), (rank, name)
        assert s["again"] == s["continued"], rank


def test_fit_of_a_traced_gpt2_equals_the_unsplit_model(two_stages):
    saved = two_stages["gpt2-fit"]
    # What fit does in one process: SGD(0.5) on batches of 8, the loss the mean over tokens
    # (SparseCategoricalCrossentropy over the last axis), History's loss the epoch's mean.
    model = hf_models.gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for x, y in lm_batches(2):
        opt.zero_grad()
        loss = lm_loss(model(input_ids=x, use_cache=False).logits, y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert BATCH == 8
    for s in saved:
        assert s["loss"] == pytest.approx([sum(losses) / len(losses)], abs=1e-5)
    _assert_close_to(_whole(saved), every_name(model))
    assert torch.equal(*_tied_copies(saved))


def test_a_llama_style_decoder_cut_at_a_module_path_trains_as_the_unsplit_model(two_stages):
    saved = two_stages["llama-1F1B"]
    ref_losses, ref = train_unsplit(hf_models.llama())
    for rank, s in enumerate(saved):
        assert s["losses"] == pytest.approx(ref_losses, abs=1e-5), rank
    _assert_close_to(_whole(saved), ref)
    # Rotary positions and the causal mask are made on the first stage and handed on.
    assert "lm_head.weight" in saved[1]["weights"]
    assert "model.embed_tokens.weight" in saved[0]["weights"]


class DataDependent(torch.nn.Module):
    """An MLP that skips itself on large activations: control flow on a tensor's value."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if hidden.abs().max() > 100 else self.mlp(hidden)


def test_an_untraceable_module_of_gpt2_is_named():
    model = hf_models.gpt2()
    block = model.transformer.h[0]
    block.mlp = DataDependent(block.mlp)
    strategy = sg.distribute.experimental.PipelineStrategy(num_microbatches=2)
    with pytest.raises(UntraceableModelError) as caught:
        strategy.pipeline(model, lm_loss, sample_input=hf_models.tokens(2))
    message = str(caught.value)
    assert "could not trace module 'transformer.h.0.mlp' (DataDependent): " in message, message
    assert "GuardOnDataDependentSymNode" in message and "\n" not in message, message
    assert "nn.Sequential" in message, message
