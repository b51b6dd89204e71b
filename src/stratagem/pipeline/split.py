"""Cutting an ``nn.Sequential`` into consecutive stages: at given points, or balanced.

A split point is the index (or the name) of the layer that *starts* a new stage, so
``split_points=[2]`` cuts ``Sequential(a, b, c, d)`` into ``(a, b)`` and ``(c, d)``. Stages are
slices of the original ``Sequential``, so their parameters keep the unsplit model's names
(``"2.weight"``): state dicts of the stages put together are the whole model's state dict.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import torch
from torch import nn

SplitPoints = Sequence[int | str] | str | None
BALANCE_BY = ("parameters", "time")


def _layers(module: nn.Module, what: str) -> nn.Sequential:
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"cannot split {type(module).__name__} into {what}: only an nn.Sequential can be "
            "split (its layers run one after another, so any cut between two layers is a valid "
            "stage boundary); wrap the layers in nn.Sequential, with a module of its own for "
            "any part that must stay together"
        )
    if len(module) == 0:
        raise ValueError(f"cannot split an empty nn.Sequential into {what}")
    return module


def _as_index(layers: nn.Sequential, point: int | str) -> int:
    names = list(layers._modules)
    if isinstance(point, bool) or not isinstance(point, int | str):
        raise TypeError(f"split point {point!r}: expected a layer index (int) or layer name (str)")
    if isinstance(point, str):
        if point not in names:
            inner = "." in point
            raise ValueError(
                f"split point {point!r} names no layer of the nn.Sequential (its layers are "
                f"{names})"
                + (
                    "; a cut inside a layer is not possible: only between the Sequential's own "
                    "layers"
                    if inner
                    else ""
                )
            )
        return names.index(point)
    return point


def check_split_points(
    module: nn.Module, split_points: Sequence[int | str], num_stages: int
) -> list[int]:
    """Validated split points as layer indices, strictly increasing, each in 1..len-1."""
    layers = _layers(module, f"{num_stages} stages")
    points = [_as_index(layers, p) for p in split_points]
    n = len(layers)
    if len(points) != num_stages - 1:
        raise ValueError(
            f"split_points={list(split_points)} cut the model into {len(points) + 1} stages, but "
            f"the pipeline has {num_stages}; give {num_stages - 1} split points"
        )
    for p in points:
        if not 0 < p < n:
            raise ValueError(
                f"split point {p} is out of range: a stage boundary must be a layer index in "
                f"1..{n - 1} for an nn.Sequential of {n} layers (split_points={list(split_points)})"
            )
    if any(b <= a for a, b in itertools.pairwise(points)):
        raise ValueError(
            f"split_points={list(split_points)} must be strictly increasing (every stage needs "
            "at least one layer)"
        )
    return points


def split_sequential(module: nn.Module, split_points: Sequence[int]) -> list[nn.Sequential]:
    """The stages: slices of ``module`` between consecutive split points (names kept)."""
    layers = _layers(module, "stages")
    bounds = [0, *split_points, len(layers)]
    return [layers[a:b] for a, b in itertools.pairwise(bounds)]  # type: ignore[misc]


def balanced_split_points(costs: Sequence[float], num_stages: int) -> list[int]:
    """Split points that minimise the largest stage's summed cost (contiguous partition).

    Dynamic programming over (layers, stages), exact for the largest stage and cheap for the
    tens of layers a Sequential has. Among cuts with the same largest stage it prefers the more
    even one (smaller sum of squared stage costs), so a parameter-free layer is not left alone.
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(
            f"cannot balance {n} layers over {num_stages} stages: every stage needs at least "
            f"one layer (1 <= num_stages <= {n})"
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = (float("inf"), float("inf"))
    # best[k][i]: (largest stage, sum of squares) for layers[:i] in k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                part = prefix[i] - prefix[j]
                largest, squares = best[k - 1][j]
                value = (max(largest, part), squares + part * part)
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    points, i = [], n
    for k in range(num_stages, 0, -1):
        i = cut[k][i]
        points.append(i)
    return sorted(points)[1:]


def parameter_costs(module: nn.Module) -> list[float]:
    """Each layer's parameter count (at least 1, so parameter-free layers still weigh)."""
    layers = _layers(module, "stages balanced by parameter count")
    return [float(max(1, sum(p.numel() for p in layer.parameters()))) for layer in layers]


def time_costs(module: nn.Module, sample: torch.Tensor, repeats: int = 3) -> list[float]:
    """Each layer's measured forward + backward time on ``sample`` (median of ``repeats``)."""
    layers = _layers(module, "stages balanced by measured time")
    times: list[list[float]] = [[] for _ in layers]
    for _ in range(repeats):
        x = sample.detach()
        for i, layer in enumerate(layers):
            x = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            y = layer(x)
            if y.requires_grad:
                y.backward(torch.ones_like(y))
            times[i].append(time.perf_counter() - start)
            x = y
        layers.zero_grad(set_to_none=True)
    return [sorted(t)[len(t) // 2] for t in times]


def resolve_split_points(
    module: nn.Module,
    num_stages: int,
    split_points: SplitPoints,
    sample: torch.Tensor | None = None,
) -> list[int]:
    """Split points as layer indices from a list, or ``"parameters"``/``"time"`` balancing.

    ``None`` balances by parameter count.
    """
    if split_points is None:
        split_points = "parameters"
    if isinstance(split_points, str):
        if split_points not in BALANCE_BY:
            raise ValueError(
                f"split_points={split_points!r}: expected a list of layer indices or names, or "
                f"one of {BALANCE_BY} to balance the stages automatically"
            )
        layers = _layers(module, f"{num_stages} stages")
        if num_stages > len(layers):
            raise ValueError(
                f"cannot split an nn.Sequential of {len(layers)} layers into {num_stages} "
                "stages: every stage needs at least one layer"
            )
        if split_points == "parameters":
            costs = parameter_costs(module)
        else:
            if sample is None:
                raise ValueError(
                    'split_points="time" measures each layer on a sample batch: pass '
                    "sample_input= (one micro-batch of inputs)"
                )
            costs = time_costs(module, sample)
        return balanced_split_points(costs, num_stages)
    return check_split_points(module, list(split_points), num_stages)
