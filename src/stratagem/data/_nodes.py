"""The index-only pipeline stages behind ``Dataset``: each turns its upstream's chunks into its own.

A node is immutable apart from per-pass bookkeeping (a shuffle's pass counter, a cache's kept
pass: ``node_state``). ``open()`` starts a pass: its eager part runs at ``iter()`` time (so seeds
are drawn then), and the ``Pass`` it returns does the work lazily and can say where it stands
(``Pass.state``); ``open(state)`` resumes a pass there, which is what an iterator's checkpoint is.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
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

# Where a pass stands: plain data, tensors and chunks (``_saved_state`` encodes the chunks).
PassState = dict[str, Any]


class Pass:
    """One pass of a stage: its chunks in order, and ``state()``, where it stands after the last
    chunk handed out (what its node's ``open(state)`` resumes from). Stages keep their position
    in a dict their generator updates before each ``yield``, so a suspended pass is always
    consistent."""

    __slots__ = ("_chunks", "_state")

    def __init__(self, chunks: Iterator[Chunk], state: Callable[[], PassState]) -> None:
        self._chunks = chunks
        self._state = state

    def __iter__(self) -> Pass:
        return self

    def __next__(self) -> Chunk:
        return next(self._chunks)

    def state(self) -> PassState:
        return self._state()

    def close(self) -> None:
        close = getattr(self._chunks, "close", None)
        if close is not None:
            close()


class Unread:
    """The part of an upstream chunk a stage has not used yet (``rest`` is in its state)."""

    __slots__ = ("chunk", "offset")

    def __init__(self) -> None:
        self.chunk: Chunk | None = None
        self.offset = 0

    def set(self, chunk: Chunk) -> None:
        self.chunk, self.offset = chunk, 0

    def elements(self) -> Iterator[Any]:
        """The chunk's elements one by one, each counted as used when handed out."""
        assert self.chunk is not None
        for element in self.chunk.elements():
            self.offset += 1
            yield element
        self.chunk = None

    def take(self, n: int) -> Chunk | None:
        """The next ``n`` elements (fewer at the chunk's end), or None when all are used."""
        if self.chunk is None or self.offset >= len(self.chunk):
            self.chunk = None
            return None
        part = self.chunk.select(slice(self.offset, self.offset + n))
        self.offset += len(part)
        return part

    def rest(self) -> Chunk | None:
        if self.chunk is None or self.offset >= len(self.chunk):
            return None
        return self.chunk.select(slice(self.offset, None))


class Resumed:
    """A resumed stage's input: chunks it had not used when its state was saved, then
    ``then``. Until the stage takes them up again they are still its own (``pending``), so a
    state taken before it runs again keeps them (a prefetch's thread may not have reached it:
    seen losing the rest of a chunk, two batches of a pass)."""

    __slots__ = ("_first", "_then")

    def __init__(self, first: list[Chunk], then: Iterator[Chunk]) -> None:
        self._first = deque(first)
        self._then = then

    def __iter__(self) -> Resumed:
        return self

    def __next__(self) -> Chunk:
        if self._first:
            return self._first.popleft()
        return next(self._then)

    def pending(self) -> list[Chunk]:
        return list(self._first)


def with_rest(state: PassState | None, up: Iterator[Chunk]) -> Resumed:
    """A resumed stage's input: the rest of the chunk it was in (``state["rest"]``), then
    ``up``."""
    rest = None if state is None else state["rest"]
    return Resumed([] if rest is None else [rest], up)


def rest_of(unread: Unread, input: Resumed) -> Chunk | None:
    """What a stage has not used of the chunk it is in: its unread part, or, before it took
    its resumed rest up again, that rest."""
    rest = unread.rest()
    if rest is not None:
        return rest
    pending = input.pending()
    return pending[0] if pending else None


def empty_pass() -> Pass:
    return Pass(iter(()), dict)


def upstream_state(state: PassState | None) -> PassState | None:
    return None if state is None else state["up"]


class Node:
    """One stage of a pipeline; ``upstream`` is the stage it reads (None for a source)."""

    upstream: Node | None = None

    def open(self, state: PassState | None = None) -> Pass:
        """A new pass, or (``state``) a pass resumed where ``Pass.state`` said it stood."""
        raise NotImplementedError

    def node_state(self) -> dict[str, Any]:
        """The bookkeeping this node keeps across passes (none for most), for a checkpoint."""
        return {}

    def load_node_state(self, state: dict[str, Any]) -> None:
        """Adopt ``node_state`` as a checkpoint saved it."""

    def sources(self) -> list[Source]:
        """The sources this node's chunks may index (a checkpoint names them by position)."""
        return []

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

    def open(self, state: PassState | None = None) -> Pass:
        position = {"position": 0 if state is None else int(state["position"])}
        return Pass(source_chunks(self.source, position), lambda: dict(position))

    def sources(self) -> list[Source]:
        return [self.source]

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

    def open(self, state: PassState | None = None) -> Pass:
        up = self.upstream.open(upstream_state(state))
        kept = {"pending": [] if state is None else list(state["pending"])}
        return Pass(
            self._batches(up, kept), lambda: {"up": up.state(), "pending": list(kept["pending"])}
        )

    def _batches(self, chunks: Iterator[Chunk], kept: dict[str, list[Chunk]]) -> Iterator[Chunk]:
        size = self.batch_size
        pending: list[Chunk] = kept["pending"]  # the elements gathered for the next batch
        count = sum(len(c) for c in pending)
        for chunk in chunks:
            if not len(chunk):
                continue
            if isinstance(chunk, ErrorChunk):
                # As TF's batch: the error is this batch's, and the elements gathered for it
                # are dropped; the next batch starts with the next element.
                pending, count = [], 0
                kept["pending"] = pending
                yield chunk
                continue
            pending.append(chunk)
            count += len(chunk)
            if count < size:
                continue
            # Concatenate once per emitted group, not once per incoming chunk.
            merged = concat(pending)
            full = count // size * size
            rest = merged.select(slice(full, None))
            pending, count = ([rest], len(rest)) if len(rest) else ([], 0)
            kept["pending"] = pending
            yield _group(merged.select(slice(0, full)), size)
        if count and not self.drop_remainder:
            kept["pending"] = []
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

    def open(self, state: PassState | None = None) -> Pass:
        if self.count == 0:
            return empty_pass()
        at: dict[str, Any] = {
            "pass": self.upstream.open(upstream_state(state)),
            "done": 0 if state is None else int(state["done"]),
            "produced": False if state is None else bool(state["produced"]),
        }

        def where() -> PassState:
            return {"up": at["pass"].state(), "done": at["done"], "produced": at["produced"]}

        return Pass(self._passes(at), where)

    def _passes(self, at: dict[str, Any]) -> Iterator[Chunk]:
        while True:
            for chunk in at["pass"]:
                at["produced"] = at["produced"] or len(chunk) > 0
                yield chunk
            at["done"] += 1
            # An empty pass would repeat emptily forever; TensorFlow stops there too.
            if not at["produced"] or (self.count is not None and at["done"] >= self.count):
                return
            at["produced"] = False
            at["pass"] = self.upstream.open()  # a new pass: an upstream shuffle reshuffles


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

    def open(self, state: PassState | None = None) -> Pass:
        if self.is_hint:
            raise ValueError(
                "shard(SHARD_HINT, SHARD_HINT) is a placeholder: only "
                "strategy.experimental_distribute_dataset under "
                "options.experimental_distribute.auto_shard_policy = AutoShardPolicy.HINT "
                "replaces it with shard(num_workers, worker_index); this dataset was iterated "
                "directly"
            )
        up = self.upstream.open(upstream_state(state))
        # The position of the next chunk's first element in the upstream's order.
        at = {"position": 0 if state is None else int(state["position"])}
        return Pass(self._shard(up, at), lambda: {"up": up.state(), **at})

    def _shard(self, chunks: Iterator[Chunk], at: dict[str, int]) -> Iterator[Chunk]:
        for chunk in chunks:
            start = (self.index - at["position"]) % self.num_shards
            at["position"] += len(chunk)
            if start < len(chunk):
                yield chunk.select(slice(start, None, self.num_shards))


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

    def open(self, state: PassState | None = None) -> Pass:
        if self.count == -1:
            return self.upstream.open(state)
        if self.count == 0:
            return empty_pass()
        up = self.upstream.open(upstream_state(state))
        at = {"remaining": self.count if state is None else int(state["remaining"])}
        return Pass(self._take(up, at), lambda: {"up": up.state(), **at})

    def _take(self, chunks: Iterator[Chunk], at: dict[str, int]) -> Iterator[Chunk]:
        if at["remaining"] <= 0:
            return
        for chunk in chunks:
            if len(chunk) >= at["remaining"]:
                taken, at["remaining"] = at["remaining"], 0
                yield chunk.select(slice(0, taken))
                return  # stop pulling: the upstream may be infinite
            at["remaining"] -= len(chunk)
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

    def open(self, state: PassState | None = None) -> Pass:
        if self.count == -1:
            return empty_pass()
        up = self.upstream.open(upstream_state(state))
        at = {"remaining": self.count if state is None else int(state["remaining"])}
        return Pass(self._skip(up, at), lambda: {"up": up.state(), **at})

    def _skip(self, chunks: Iterator[Chunk], at: dict[str, int]) -> Iterator[Chunk]:
        for chunk in chunks:
            remaining = at["remaining"]
            if remaining >= len(chunk):
                at["remaining"] -= len(chunk)
                continue
            at["remaining"] = 0
            yield chunk.select(slice(remaining, None)) if remaining else chunk


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

    def open(self, state: PassState | None = None) -> Pass:
        return self.upstream.open(state)
