"""The data and model of the exact-resume checks (``resume_checks.py`` and its test)."""

import torch

import stratagem as sg
from workers.common import build_model

STOP, EXAMPLES, GLOBAL_BATCH, EPOCHS = 7, 120, 12, 2
MAP_CALLS = [0]  # calls of the pipeline's map function in this process


def _mapped(features: torch.Tensor, label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    MAP_CALLS[0] += 1
    return features * 1.0, label


def dataset() -> sg.data.Dataset:
    """Examples whose last feature is their id, through a streaming shuffle (a buffer of 37 of
    120), map, batch, repeat and prefetch: 20 global batches of 12."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(EXAMPLES, 5, generator=g)
    y = torch.randint(0, 3, (EXAMPLES,), generator=g)
    ids = torch.arange(EXAMPLES, dtype=torch.float32)[:, None]
    return (
        sg.data.Dataset.from_tensor_slices((torch.cat([x, ids], 1), y))
        .shuffle(37, seed=7)
        .map(_mapped)
        .batch(GLOBAL_BATCH)
        .repeat(EPOCHS)
        .prefetch(2)
    )


class Ledgered(torch.nn.Module):
    """The model on the features, recording the ids of the examples it sees in training."""

    def __init__(self) -> None:
        super().__init__()
        self.net = build_model()
        self.seen: list[list[int]] = []

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen.append(features[:, -1].long().tolist())
        return self.net(features[:, :-1])
