"""Shared by the worker scripts and the tests that compare against them."""

import torch

GLOBAL_BATCH = 24
STEPS = 4


def build_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(5, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 3),
    )


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
