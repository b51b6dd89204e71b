"""The index-only pipeline stages behind ``Dataset``: each turns its upstream's chunks into its own.

A node is immutable apart from per-pass bookkeeping (a shuffle's pass counter, a cache's kept
pass). ``open()`` starts a pass: its eager part runs at ``iter()`` time (so seeds are drawn
then), and the generator it returns does the work lazily.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from stratagem.data import _structure
from stratagem.data._chunks import (
    Chunk,
    ErrorChunk,
    IndexChunk,
    Source,
    ValueChunk,
    concat,
    source_chunks,
    stack_values,
)

INFINITE = -1
UNKNOWN = -2


class Node:
    """One stage of a pipeline; ``upstream`` is the stage it reads (None for a source)."""

    upstream: Node | None = None

    def open(self) -> Iterator[Chunk]:
        raise NotImplementedError

    def cardinality(self) -> int:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def rebuilt(self, upstream: Node | None, seed: int, position: int) -> Node:
        """A fresh copy (no pass state) reading ``upstream``; ``Shuffle`` also takes ``seed``."""
        raise NotImplementedError

    def element_spec(self) -> Any:
        """The structure of ``TensorSpec``s of this stage's elements (the upstream's, unless
        the stage changes them)."""
        assert self.upstream is not None
        return self.upstream.element_spec()

    def stages(self) -> list[Node]:
        """This pipeline's nodes, source first."""
        node: Node | None = self
        chain: list[Node] = []
        while node is not None:
            chain.append(node)
            node = node.upstream
        return chain[::-1]


def fresh_copy(node: Node, seed: int) -> Node:
    """A copy of the pipeline ending at ``node``, with no pass state: every stage ``rebuilt``,
    unseeded shuffles seeded from ``(seed, position)``. The data is shared, not copied."""
    copy: Node | None = None
    for position, stage in enumerate(node.stages()):
        copy = stage.rebuilt(copy, seed, position)
    assert copy is not None
    return copy


class SourceNode(Node):
    def __init__(self, source: Source, description: str) -> None:
        self.source = source
        self.description = description

    def open(self) -> Iterator[Chunk]:
        return source_chunks(self.source)

    def cardinality(self) -> int:
        return len(self.source)

    def describe(self) -> str:
        return self.description

    def rebuilt(self, upstream: Node | None, seed: int, position: int) -> Node:
        return self  # stateless, and the data is shared anyway

    def element_spec(self) -> Any:
        return self.source.element_spec()


class Batch(Node):
    def __init__(self, upstream: Node, batch_size: int, drop_remainder: bool) -> None:
        self.upstream, self.batch_size, self.drop_remainder = upstream, batch_size, drop_remainder

    def cardinality(self) -> int:
        n = self.upstream.cardinality()
        if n < 0:
            return n
        return n // self.batch_size if self.drop_remainder else -(-n // self.batch_size)

    def describe(self) -> str:
        return f"batch({self.batch_size}, drop_remainder={self.drop_remainder})"

    def rebuilt(self, upstream: Node | None, seed: int, position: int) -> Node:
        return Batch(upstream, self.batch_size, self.drop_remainder)

    def element_spec(self) -> Any:
        # As TF: the batch dimension is static only when every batch is full.
        size = self.batch_size if self.drop_remainder else None
        return _structure.map_leaves(lambda s: s.with_leading(size), self.upstream.element_spec())

    def open(self) -> Iterator[Chunk]:
        return self._batches(self.upstream.open())

    def _batches(self, chunks: Iterator[Chunk]) -> Iterator[Chunk]:
        size = self.batch_size
        pending: list[Chunk] = []
        count = 0
        for chunk in chunks:
            if not len(chunk):
                continue
            if isinstance(chunk, ErrorChunk):
                # As TF's batch: the error is this batch's, and the elements gathered for it
                # are dropped; the next batch starts with the next element.
                yield chunk
                pending, count = [], 0
                continue
            pending.append(chunk)
            count += len(chunk)
            if count < size:
                continue
            # Concatenate once per emitted group, not once per incoming chunk.
            merged = concat(pending)
            full = count // size * size
            yield _group(merged.select(slice(0, full)), size)
            rest = merged.select(slice(full, None))
            pending, count = ([rest], len(rest)) if len(rest) else ([], 0)
        if count and not self.drop_remainder:
            yield _group(concat(pending), count)


def _group(chunk: Chunk, size: int) -> Chunk:
    """``chunk``'s elements in consecutive batches of ``size`` (``len(chunk)`` divides evenly)."""
    if isinstance(chunk, IndexChunk):
        ids = chunk.ids.reshape(len(chunk) // size, size, *chunk.ids.shape[1:])
        return IndexChunk(chunk.source, ids)
    values = chunk.values
    return ValueChunk([stack_values(values[i : i + size]) for i in range(0, len(values), size)])


class Repeat(Node):
    def __init__(self, upstream: Node, count: int | None) -> None:
        self.upstream, self.count = upstream, count  # None repeats forever

    def cardinality(self) -> int:
        n = self.upstream.cardinality()
        if self.count == 0 or n == 0:
            return 0
        if self.count is None or n == INFINITE:
            return INFINITE
        return UNKNOWN if n == UNKNOWN else n * self.count

    def describe(self) -> str:
        return "repeat()" if self.count is None else f"repeat({self.count})"

    def rebuilt(self, upstream: Node | None, seed: int, position: int) -> Node:
        return Repeat(upstream, self.count)

    def open(self) -> Iterator[Chunk]:
        if self.count == 0:
            return iter(())
        return self._passes(self.upstream.open())

    def _passes(self, first: Iterator[Chunk]) -> Iterator[Chunk]:
        chunks, done = first, 0
        while True:
            produced = False
            for chunk in chunks:
                produced = produced or len(chunk) > 0
                yield chunk
            done += 1
            # An empty pass would repeat emptily forever; TensorFlow stops there too.
            if not produced or (self.count is not None and done >= self.count):
                return
            chunks = self.upstream.open()  # a new pass: an upstream shuffle reshuffles


SHARD_HINT = -1  # shard(SHARD_HINT, SHARD_HINT): filled in by AutoShardPolicy.HINT


class ShardNode(Node):
    def __init__(self, upstream: Node, num_shards: int, index: int) -> None:
        self.upstream, self.num_shards, self.index = upstream, num_shards, index

    @property
    def is_hint(self) -> bool:
        return self.num_shards == SHARD_HINT

    def cardinality(self) -> int:
        n = self.upstream.cardinality()
        if n < 0 or self.is_hint:
            return n if n < 0 else UNKNOWN
        return n // self.num_shards + (1 if self.index < n % self.num_shards else 0)

    def describe(self) -> str:
        if self.is_hint:
            return "shard(SHARD_HINT, SHARD_HINT)"
        return f"shard({self.num_shards}, {self.index})"

    def rebuilt(self, upstream: Node | None, seed: int, position: int) -> Node:
        return ShardNode(upstream, self.num_shards, self.index)

    def open(self) -> Iterator[Chunk]:
        if self.is_hint:
            raise ValueError(
                "shard(SHARD_HINT, SHARD_HINT) is a placeholder: only "
                "strategy.experimental_distribute_dataset under "
                "options.experimental_distribute.auto_shard_policy = AutoShardPolicy.HINT "
                "replaces it with shard(num_workers, worker_index); this dataset was iterated "
                "directly"
            )
        return self._shard(self.upstream.open())

    def _shard(self, chunks: Iterator[Chunk]) -> Iterator[Chunk]:
        position = 0  # of the chunk's first element in the upstream's order
        for chunk in chunks:
            start = (self.index - position) % self.num_shards
            if start < len(chunk):
                yield chunk.select(slice(start, None, self.num_shards))
            position += len(chunk)


class Take(Node):
    def __init__(self, upstream: Node, count: int) -> None:
        self.upstream, self.count = upstream, count  # -1 takes everything

    def cardinality(self) -> int:
        n = self.upstream.cardinality()
        if self.count == -1:
            return n
        if n == INFINITE:
            return self.count
        return UNKNOWN if n == UNKNOWN else min(n, self.count)

    def describe(self) -> str:
        return f"take({self.count})"

    def rebuilt(self, upstream: Node | None, seed: int, position: int) -> Node:
        return Take(upstream, self.count)

    def open(self) -> Iterator[Chunk]:
        if self.count == -1:
            return self.upstream.open()
        if self.count == 0:
            return iter(())
        return self._take(self.upstream.open())

    def _take(self, chunks: Iterator[Chunk]) -> Iterator[Chunk]:
        remaining = self.count
        for chunk in chunks:
            if len(chunk) >= remaining:
                yield chunk.select(slice(0, remaining))
                return  # stop pulling: the upstream may be infinite
            remaining -= len(chunk)
            yield chunk


class Skip(Node):
    def __init__(self, upstream: Node, count: int) -> None:
        self.upstream, self.count = upstream, count  # -1 skips everything

    def cardinality(self) -> int:
        n = self.upstream.cardinality()
        if self.count == -1:
            return 0
        return n if n < 0 else max(0, n - self.count)

    def describe(self) -> str:
        return f"skip({self.count})"

    def rebuilt(self, upstream: Node | None, seed: int, position: int) -> Node:
        return Skip(upstream, self.count)

    def open(self) -> Iterator[Chunk]:
        if self.count == -1:
            return iter(())
        return self._skip(self.upstream.open())

    def _skip(self, chunks: Iterator[Chunk]) -> Iterator[Chunk]:
        remaining = self.count
        for chunk in chunks:
            if remaining >= len(chunk):
                remaining -= len(chunk)
                continue
            yield chunk.select(slice(remaining, None)) if remaining else chunk
            remaining = 0


class WithOptions(Node):
    """``with_options``: the elements unchanged; the options hold for the whole pipeline."""

    def __init__(self, upstream: Node, options: Any) -> None:
        self.upstream, self.options = upstream, options

    def cardinality(self) -> int:
        return self.upstream.cardinality()

    def describe(self) -> str:
        return "with_options()"

    def rebuilt(self, upstream: Node | None, seed: int, position: int) -> Node:
        return WithOptions(upstream, self.options)

    def open(self) -> Iterator[Chunk]:
        return self.upstream.open()
