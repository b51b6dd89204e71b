"""What ``fit``/``evaluate``/``predict`` accept, turned into an iterable of global batches.

- arrays or tensors ``x`` (and ``y``) with ``batch_size`` (the *global* batch, default 32): an
  ``sg.data.Dataset``, shuffled each epoch when asked (the distribute layer gives every worker
  the same shuffle, so slicing the global batch shards the data exactly once per epoch);
- an ``sg.data.Dataset``, a DataLoader or any re-iterable of batches ``(x, y)`` or
  ``(x, y, sample_weight)``: used as is, each batch being a global batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from stratagem import data as sg_data

DEFAULT_BATCH_SIZE = 32


def _as_tensor(value: Any, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    raise TypeError(f"{name} must be an array or a tensor here, got {type(value).__name__}")


def global_batches(
    x: Any, y: Any, batch_size: int | None, *, shuffle: bool, what: str
) -> tuple[Iterable[Any], int | None]:
    """The global batches and, when known, how many there are per epoch."""
    if x is None:
        raise ValueError(f"{what} needs data: x is None")
    if isinstance(x, torch.Tensor | np.ndarray):
        if batch_size is not None and (
            isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
        ):
            raise ValueError(f"batch_size must be a positive integer; got {batch_size!r}")
        size = batch_size or DEFAULT_BATCH_SIZE
        xs = _as_tensor(x, "x")
        if y is not None:
            ys = _as_tensor(y, "y")
            if len(ys) != len(xs):
                raise ValueError(
                    f"x and y hold different numbers of examples: {len(xs)} and {len(ys)}"
                )
            dataset = sg_data.Dataset.from_tensor_slices((xs, ys))
        else:
            dataset = sg_data.Dataset.from_tensor_slices(xs)
        if shuffle:
            dataset = dataset.shuffle(len(xs))
        return dataset.batch(size), math.ceil(len(xs) / size)
    if y is not None:
        raise ValueError(
            f"{what}: y must be None when x is a dataset or an iterable of batches "
            f"(got x of type {type(x).__name__}); the batches carry the targets"
        )
    if batch_size is not None:
        raise ValueError(
            f"{what}: batch_size applies to arrays; a dataset of type {type(x).__name__} is "
            "already batched (each of its batches is a global batch)"
        )
    if not isinstance(x, Iterable):
        raise TypeError(
            f"{what} takes arrays/tensors, an sg.data.Dataset, a DataLoader or an iterable of "
            f"batches; got {type(x).__name__}"
        )
    try:
        steps = len(x)  # type: ignore[arg-type]
    except TypeError:
        steps = None
    return x, steps


def unpack(data: Any) -> tuple[Any, Any, Any]:
    """``(x, y, sample_weight)`` from a batch that is ``x``, ``(x, y)`` or ``(x, y, w)``."""
    if isinstance(data, tuple | list):
        if len(data) == 2:
            return data[0], data[1], None
        if len(data) == 3:
            return data[0], data[1], data[2]
        if len(data) == 1:
            return data[0], None, None
        raise ValueError(f"a batch is x, (x, y) or (x, y, sample_weight); got {len(data)} parts")
    return data, None, None
