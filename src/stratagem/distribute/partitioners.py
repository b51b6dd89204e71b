"""Variable partitioners and shard placement for parameter servers (pure logic, no processes).

A partitioner says into how many shards a variable is cut along its first dimension
(TensorFlow's ``tf.distribute.experimental.partitioners``: ``FixedShardsPartitioner``,
``MinSizePartitioner``, ``MaxSizePartitioner``; called as ``partitioner(shape, dtype)`` and
returning the partitions per axis, ``[k, 1, ...]``). ``shard_rows`` cuts the rows as TF does
(the first ``rows % k`` shards get one row more), and ``place_shards`` gives every shard a ps
task, largest first onto the least loaded one, so the bytes each ps holds and serves are
balanced. Every worker computes the same placement from the same shapes: nothing to agree on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def _positive_int(what: str, value: object, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}; got {value!r}")
    return value


def _bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


class Partitioner:
    """Base class: ``partitioner(shape, dtype) -> [shards along axis 0, 1, 1, ...]``."""

    def num_shards(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        raise NotImplementedError

    def __call__(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> list[int]:
        shape = list(shape)
        if not shape:
            return []  # a scalar is never cut
        k = min(self.num_shards(shape, dtype), max(shape[0], 1))
        return [k] + [1] * (len(shape) - 1)


class FixedShardsPartitioner(Partitioner):
    """``num_shards`` shards (fewer when the first dimension has fewer rows)."""

    def __init__(self, num_shards: int) -> None:
        self.num_shards_ = _positive_int("FixedShardsPartitioner num_shards", num_shards)

    def num_shards(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return self.num_shards_

    def __repr__(self) -> str:
        return f"FixedShardsPartitioner(num_shards={self.num_shards_})"


class MinSizePartitioner(Partitioner):
    """As many shards as keep each at least ``min_shard_bytes``, at most ``max_shards``."""

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1) -> None:
        self.min_shard_bytes = _positive_int("MinSizePartitioner min_shard_bytes", min_shard_bytes)
        self.max_shards = _positive_int("MinSizePartitioner max_shards", max_shards)

    def num_shards(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return max(1, min(self.max_shards, _bytes(shape, dtype) // self.min_shard_bytes))

    def __repr__(self) -> str:
        return (
            f"MinSizePartitioner(min_shard_bytes={self.min_shard_bytes}, "
            f"max_shards={self.max_shards})"
        )


class MaxSizePartitioner(Partitioner):
    """The fewest shards of at most ``max_shard_bytes`` each. With ``max_shards``, a variable
    that would need more shards than that is an error (TF silently makes bigger shards; here
    a shard over the bound the user set is refused rather than hidden)."""

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None) -> None:
        self.max_shard_bytes = _positive_int("MaxSizePartitioner max_shard_bytes", max_shard_bytes)
        if max_shards is not None:
            max_shards = _positive_int("MaxSizePartitioner max_shards", max_shards)
        self.max_shards = max_shards

    def num_shards(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        size = _bytes(shape, dtype)
        rows = max(shape[0], 1)
        row_bytes = size // rows
        if row_bytes > self.max_shard_bytes:
            raise ValueError(
                f"a variable of shape {tuple(shape)} ({dtype}) has rows of {row_bytes} bytes, "
                f"more than max_shard_bytes={self.max_shard_bytes}; shards are whole rows"
            )
        rows_per_shard = self.max_shard_bytes // row_bytes if row_bytes else rows
        needed = math.ceil(rows / rows_per_shard)
        if self.max_shards is not None and needed > self.max_shards:
            raise ValueError(
                f"a variable of shape {tuple(shape)} ({dtype}, {size} bytes) needs {needed} shards "
                f"of at most {self.max_shard_bytes} bytes, more than max_shards="
                f"{self.max_shards}; raise max_shards or max_shard_bytes"
            )
        return needed

    def __repr__(self) -> str:
        return (
            f"MaxSizePartitioner(max_shard_bytes={self.max_shard_bytes}, "
            f"max_shards={self.max_shards})"
        )


def shard_rows(rows: int, num_shards: int) -> list[int]:
    """Rows per shard, TF's way: the first ``rows % num_shards`` shards get one row more."""
    base, extra = divmod(rows, num_shards)
    return [base + (1 if i < extra else 0) for i in range(num_shards)]


@dataclass(frozen=True)
class Shard:
    """Rows ``[start, start + rows)`` of variable ``variable``, held by ps task ``ps``."""

    variable: int
    index: int  # among the variable's shards
    start: int
    rows: int
    nbytes: int
    ps: int = -1


def plan_shards(
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence[torch.dtype],
    partitioner: Partitioner | None,
    num_ps: int,
) -> list[list[Shard]]:
    """Every variable's shards, each placed on a ps: per variable, its shards in row order."""
    _positive_int("the number of ps tasks", num_ps)
    pieces: list[Shard] = []
    for v, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        shape = list(shape)
        parts = partitioner(shape, dtype) if partitioner is not None else []
        k = parts[0] if parts else 1
        if parts and k < 1:
            raise ValueError(f"{partitioner!r} returned {parts} for shape {tuple(shape)}")
        rows = shape[0] if shape else 1
        row_bytes = _bytes(shape, dtype) // max(rows, 1) if shape else _bytes(shape, dtype)
        start = 0
        for i, n in enumerate(shard_rows(rows, k) if shape else [1]):
            pieces.append(Shard(v, i, start, n, n * row_bytes))
            start += n
    placed = place_shards([p.nbytes for p in pieces], num_ps)
    out: list[list[Shard]] = [[] for _ in shapes]
    for piece, ps in zip(pieces, placed):
        out[piece.variable].append(
            Shard(piece.variable, piece.index, piece.start, piece.rows, piece.nbytes, ps)
        )
    return out


def place_shards(sizes: Sequence[int], num_ps: int) -> list[int]:
    """The ps of each shard: largest first onto the least loaded ps (ties: the lower index)."""
    load = [0] * num_ps
    placed = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        ps = min(range(num_ps), key=lambda p: (load[p], p))
        placed[i] = ps
        load[ps] += sizes[i]
    return placed


__all__ = [
    "FixedShardsPartitioner",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "Partitioner",
    "Shard",
    "place_shards",
    "plan_shards",
    "shard_rows",
]
