"""Shared by the worker scripts and the tests that compare against them."""

from collections import OrderedDict

import torch

GLOBAL_BATCH = 24
STEPS = 4
VOCAB, WIDTH = 11, 8


def build_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(5, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 3),
    )


def build_tied_model(tie_mlp: bool = False) -> torch.nn.Sequential:
    """Tied embeddings, as GPT-2 has: the head reuses the embedding's weight
    (``lm_head.weight is wte.weight``), an MLP between, no dropout. ``tie_mlp`` also ties
    ``fc2.weight`` to ``fc1.weight`` (two chunks of one rank sharing under interleaving)."""
    wte = torch.nn.Embedding(VOCAB, WIDTH)
    fc1, fc2 = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)
    head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
    head.weight = wte.weight
    if tie_mlp:
        fc2.weight = fc1.weight
    layers = OrderedDict(wte=wte, fc1=fc1, act=torch.nn.Tanh(), fc2=fc2, lm_head=head)
    return torch.nn.Sequential(layers)


def token_batches(
    steps: int = 3, batch: int = GLOBAL_BATCH
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, next tokens) for the tied model."""
    g = torch.Generator().manual_seed(4321)
    return [
        (
            torch.randint(0, VOCAB, (batch,), generator=g),
            torch.randint(0, VOCAB, (batch,), generator=g),
        )
        for _ in range(steps)
    ]


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    raise ValueError(name)


def global_batches(
    steps: int = STEPS, batch: int = GLOBAL_BATCH
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    return [
        (torch.randn(batch, 5, generator=g), torch.randint(0, 3, (batch,), generator=g))
        for _ in range(steps)
    ]


def reference_training(initial: dict, optimizer: str, batches) -> dict:
    """One process, the whole global batch, the mean loss: what every strategy must match."""
    model = build_model()
    model.load_state_dict(initial)
    opt = make_optimizer(optimizer, model.parameters())
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def keras_data(n: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    """Examples for Model.fit; 100 is no multiple of the global batch 24 (a partial batch)."""
    g = torch.Generator().manual_seed(4321)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)
