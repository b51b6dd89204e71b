"""Hugging Face's GPT-2 under the global-token rule: its own loss (``ForCausalLMLoss``, given
``num_items_in_batch``) on padded batches trains under two replicas and gradient accumulation as
one process on each step's global batch (the count taken after GPT-2's shift of the labels)."""

from __future__ import annotations

import pytest
import torch

import stratagem as sg
from real_models import hf_models

# Real labels per row (the rest -100): GPT-2 predicts labels 1.., so a row of L has L - 1
# targets; each micro-batch of 4 rows is 2 per replica.
LENGTHS = [2, 0, 16, 16, 16, 9, 1, 0]
LR = 0.5


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    ids = hf_models.tokens(len(LENGTHS), seed=3)
    labels = ids.clone()
    for row, length in enumerate(LENGTHS):
        labels[row, length:] = -100
    return ids, labels


def _update(model: torch.nn.Module, initial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: initial[n] - p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("k", [1, 2])
def test_gpt2_fit_on_padded_batches_equals_one_process(k):
    ids, labels = _data()
    reference = hf_models.gpt2()
    initial = {n: p.detach().clone() for n, p in reference.named_parameters()}
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    rows = 4 * k
    for lo in range(0, len(ids), rows):
        optimizer.zero_grad()
        reference(input_ids=ids[lo : lo + rows], labels=labels[lo : lo + rows]).loss.backward()
        optimizer.step()
    expected = _update(reference, initial)

    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = sg.keras.Model(hf_models.gpt2())
        model.compile(sg.keras.optimizers.SGD(LR, gradient_accumulation_steps=k if k > 1 else None))
    model.fit({"input_ids": ids}, labels, batch_size=4, shuffle=False, verbose=0)
    got = _update(model.module, initial)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-7, msg=name)
