"""One process of the planner's HSDP check: the plan's HSDP candidate, built as ``auto`` builds
its choice (``Plan.build``), trains two SGD steps on this process's share of a global batch;
the chief also trains the same model alone on the whole global batch. Writes
``<out>/hsdp-rank<r>.json``: the strategy's mesh, the local shapes of the parameters and
(chief) the largest difference between the two models' parameters.

argv: output folder, replicate, shard.
"""

import dataclasses
import json
import sys

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import stratagem as sg
from stratagem.distribute.planner import ClusterShape

OUT, REPLICATE, SHARD = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
WORLD = REPLICATE * SHARD
PER_PROCESS = 3
STEPS = 2


def build() -> torch.nn.Sequential:
    torch.manual_seed(7)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8), torch.nn.Linear(8, 4)
    )


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    n = WORLD * PER_PROCESS
    return [(torch.randn(n, 6, generator=g), torch.randn(n, 4, generator=g)) for _ in range(STEPS)]


def train(model: torch.nn.Module, batches, scale: int, run=lambda step: step()) -> None:
    """SGD with momentum; the loss of a batch summed over its examples over ``scale`` (the
    global batch), so that the replicas' summed gradients are the global batch's mean's."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:

        def step(x=x, y=y) -> None:
            optimizer.zero_grad()
            (F.mse_loss(model(x), y, reduction="sum") / scale).backward()
            optimizer.step()

        run(step)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def main() -> None:
    planned = sg.distribute.plan(
        build(), torch.zeros(PER_PROCESS, 6), ClusterShape(REPLICATE, SHARD), optimizer="sgd"
    )
    chosen = next(c for c in planned.candidates if c.name == f"HSDP {REPLICATE}x{SHARD}")
    strategy = dataclasses.replace(planned, chosen=chosen).build()
    rank = strategy.cluster_resolver.task_id
    with strategy.scope():
        model = build()
    mine = [
        (
            x[rank * PER_PROCESS : (rank + 1) * PER_PROCESS],
            y[rank * PER_PROCESS : (rank + 1) * PER_PROCESS],
        )
        for x, y in global_batches()
    ]
    train(model, mine, WORLD * PER_PROCESS, run=strategy.run)
    params = {n: full(p.detach()) for n, p in model.named_parameters()}
    result = {
        "mesh": dict(zip(strategy.mesh.mesh_dim_names, strategy.mesh.shape)),
        "local_shapes": {
            n: list(p.to_local().shape)
            for n, p in model.named_parameters()
            if isinstance(p, DTensor)
        },
        "replicas": strategy.num_replicas_in_sync,
    }
    if rank == 0:
        alone = build()
        train(alone, global_batches(), WORLD * PER_PROCESS)
        result["relative_error"] = max(
            float(((params[n] - p.detach()).abs() / (p.detach().abs() + 1e-6)).max())
            for n, p in alone.named_parameters()
        )
        result["close"] = all(
            torch.allclose(params[n], p.detach(), rtol=1e-5, atol=1e-7)
            for n, p in alone.named_parameters()
        )
    with open(f"{OUT}/hsdp-rank{rank}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
