"""The global-token rule: a padded language model's loss is normalised by the count of real
tokens of the whole step (every replica, every accumulated micro-batch), so any split trains
as one process on the global batch. Halves of 1 and 97 real tokens; the reference is one
process on the global batch (workers/token_lm.py), the weights' change within 1e-5 relative."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import stratagem as sg
from cluster_utils import WORKERS, run_cluster
from workers.token_lm import LR, MICRO, TinyLM, check_update, data


def _fit_update(strategy: sg.distribute.Strategy, k: int) -> dict[str, torch.Tensor]:
    with strategy.scope():
        model = sg.keras.Model(TinyLM())
        initial = {n: p.detach().clone() for n, p in model.module.named_parameters()}
        steps = k if k > 1 else None
        model.compile(sg.keras.optimizers.SGD(LR, gradient_accumulation_steps=steps))
    ids, labels = data()
    model.fit(ids, labels, batch_size=MICRO, shuffle=False, verbose=0)
    return {n: initial[n] - p.detach() for n, p in model.module.named_parameters()}


@pytest.mark.parametrize("k", [1, 2, 4])
def test_fit_on_a_models_own_loss_equals_one_process_on_the_step_global_batch(k):
    """One device, k micro-batches of 4 rows per step (accumulation): each real token of the
    step weighs 1/N, not each micro-batch 1/k."""
    check_update(_fit_update(sg.distribute.get_strategy(), k), k, f"one device, k={k}")


@pytest.mark.parametrize("k", [1, 2, 4])
def test_fit_on_two_replicas_with_1_and_97_tokens_equals_one_process(k):
    """MirroredStrategy's two replicas in this process, one holding 1 real token of a
    micro-batch and the other 97 (or 1 and 1, 97 and 97)."""
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    check_update(_fit_update(strategy, k), k, f"two replicas, k={k}")


def test_the_per_example_rule_would_differ_here():
    """The data makes the rules differ: the replicas' means weighed by their examples (the
    rule without the count) move the weights otherwise than the token mean."""
    model = TinyLM()
    ids, labels = data()
    halves = range(0, len(ids), 2)  # one step of the 8 halves of 2 rows
    loss = sum(model(ids[lo : lo + 2], labels=labels[lo : lo + 2]).loss for lo in halves)
    (loss * 2 / len(ids)).backward()
    per_example = {n: LR * p.grad for n, p in model.named_parameters()}
    with pytest.raises(AssertionError):
        check_update(per_example, len(ids) // MICRO, "per-example rule")


def _token_step(strategy: sg.distribute.Strategy) -> dict[str, torch.Tensor]:
    """A custom loop's step: per-token losses, the padding mask as ``sample_weight``."""
    with strategy.scope():
        model = TinyLM()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids, labels = data()
    batches = [(ids[lo : lo + MICRO], labels[lo : lo + MICRO]) for lo in range(0, len(ids), MICRO)]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        logits = model(x).logits[:, :-1]
        targets = y[:, 1:]
        mask = (targets != -100).float()
        per_token = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.clamp(min=0).reshape(-1),
            reduction="none",
        ).reshape(targets.shape)  # fmt: skip
        optimizer.zero_grad()
        sg.nn.compute_average_loss(per_token, sample_weight=mask).backward()
        optimizer.step()

    for batch in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=batch)
    return {n: initial[n] - p.detach() for n, p in model.named_parameters()}


def test_compute_average_loss_with_a_token_mask_divides_by_the_global_token_count():
    """Two replicas with 1 and 97 real tokens: their shares sum to the gradient of the mean
    over the 98 tokens (TF would divide by the 4 examples)."""
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    check_update(_token_step(strategy), 1, "compute_average_loss")


def test_compute_average_loss_divides_by_examples_unless_weights_are_per_token():
    """A weight per example (rank 1), or a given ``global_batch_size``, is TF's rule: the
    weighted sum over the global batch; a weight per token divides by the tokens' weights."""
    per_token = torch.arange(6.0).reshape(2, 3)
    weights = torch.tensor([1.0, 0.0])
    got = sg.nn.compute_average_loss(per_token.sum(1), sample_weight=weights)
    assert got.item() == pytest.approx(3.0 / 2)
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # 3 tokens: 0 + 1 + 2
    assert sg.nn.compute_average_loss(per_token, sample_weight=mask).item() == 1.0
    # global_batch_size given: TF's rule (over the examples), whatever the weights' shape.
    got = sg.nn.compute_average_loss(per_token, sample_weight=mask, global_batch_size=2)
    assert got.item() == 1.5
    assert sg.nn.compute_average_loss(per_token, sample_weight=0 * mask).item() == 0.0


def test_the_models_own_loss_is_the_mean_over_the_real_targets():
    """The reference's loss by hand: the second micro-batch's halves hold 1 and 97 targets, and
    the model's own loss is the mean of their cross-entropy over the 98."""
    model = TinyLM()
    ids, labels = data()
    second = slice(MICRO, 2 * MICRO)
    logits = model(ids[second]).logits[:, :-1]
    targets = labels[second, 1:]
    real = targets != -100
    assert int(real[:2].sum()) == 1 and int(real[2:].sum()) == 97
    by_hand = F.cross_entropy(logits[real], targets[real], reduction="sum") / 98
    own = model(ids[second], labels=labels[second]).loss
    torch.testing.assert_close(own, by_hand)


@pytest.fixture(scope="module")
def cluster_updates(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("token_loss")
    results = run_cluster(WORKERS / "token_loss_checks.py", 2, workdir, timeout=240)
    for i, r in enumerate(results):
        r.check(f"worker {i}")
    return [torch.load(workdir / f"result-{i}.pt", weights_only=True) for i in range(2)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["mwms", "fsdp", "mesh"])
def test_fit_on_two_workers_with_1_and_97_tokens_equals_one_process(cluster_updates, strategy):
    """Two processes under MultiWorkerMirroredStrategy, FullyShardedStrategy and a
    data-parallel MeshStrategy, accumulation 1, 2 and 4 (one job runs them all; a mesh refuses
    accumulation: 1 there)."""
    for rank, updates in enumerate(cluster_updates):
        for k in (1,) if strategy == "mesh" else (1, 2, 4):
            check_update(updates[f"{strategy}-{k}"], k, f"{strategy} rank {rank} k={k}")


def test_a_loss_function_that_takes_no_count_keeps_the_per_example_rule():
    """Hugging Face's image classifiers (ResNet) take ``**kwargs`` and have a ``loss_function``
    (``ForSequenceClassificationLoss``), a mean over the replica's own batch that ignores any
    count: the global-token rule must not apply to them, only to losses naming the count."""
    from stratagem.keras import module_calls
    from stratagem.keras.token_loss import GlobalTokens

    def mean_loss(labels, logits, config, **kwargs):
        return F.cross_entropy(logits, labels)

    def token_loss(logits, labels, vocab_size, num_items_in_batch=None, **kwargs):
        return F.cross_entropy(logits, labels, reduction="sum") / num_items_in_batch

    class Classifier(torch.nn.Module):
        loss_function = staticmethod(mean_loss)

        def forward(self, pixel_values=None, labels=None, **kwargs):
            return pixel_values

    class LanguageModel(Classifier):
        loss_function = staticmethod(token_loss)

    for module, applies in [(Classifier(), False), (LanguageModel(), True)]:
        signature = module_calls.forward_signature(module)
        assert GlobalTokens.applies(module, signature) is applies, type(module).__name__
