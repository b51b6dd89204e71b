"""What the traced-pipeline tests and their worker share: language-model batches, the loss over
logits and labels, and the unsplit model trained on them (the reference)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from real_models import hf_models

BATCH = 8
MICROBATCHES = 4
STEPS = 3


def lm_batches(steps: int = STEPS, seed: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of (token ids, the next token at each position)."""
    batches = []
    for step in range(steps):
        seq = hf_models.tokens(BATCH, seed=seed + step, seq=hf_models.SEQ + 1)
        batches.append((seq[:, :-1], seq[:, 1:]))
    return batches


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy of a micro-batch: what the pipeline's last stage runs."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def every_name(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Weights under every name, a tied one under each of its names."""
    return {n: p.detach().clone() for n, p in module.named_parameters(remove_duplicate=False)}


def train_unsplit(model: torch.nn.Module, steps: int = STEPS):
    """The reference: the whole model in one process, whole batches. (losses, weights)."""
    opt = make_optimizer(model.parameters())
    losses = []
    for x, y in lm_batches(steps):
        opt.zero_grad()
        loss = lm_loss(model(input_ids=x, use_cache=False).logits, y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, every_name(model)


def fit_gpt2(strategy):
    """``Model.fit`` of the tiny GPT-2 under ``strategy`` (a pipeline: traced and cut at its
    split points) on 2 of ``lm_batches``, SGD and a Keras loss: (the history, the model)."""
    import stratagem as sg

    batches = lm_batches(2)
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    with strategy.scope():
        model = sg.keras.Model(hf_models.gpt2())
        model.compile(
            sg.keras.optimizers.SGD(0.5),
            sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return history, model
