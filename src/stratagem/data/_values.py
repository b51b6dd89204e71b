"""The pipeline stages that need element values: ``map``, ``filter``, and ``cache``.

They run per element (a user function must see each one), so they come after index-only
stages for speed; ``cache`` turns computed values back into tensors read with vectorized
indices.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from stratagem.data import _structure
from stratagem.data._chunks import (
    Chunk,
    ErrorChunk,
    TensorSlices,
    ValueChunk,
    source_chunks,
    stack_values,
)
from stratagem.data._nodes import (
    INFINITE,
    UNKNOWN,
    Node,
    Pass,
    PassState,
    Unread,
    fresh_copy,
    rest_of,
    upstream_state,
    with_rest,
)
from stratagem.data.spec import TensorSpec, spec_of
from stratagem.errors import InputError

# filter hands on its results in small groups, so take(1) after filter does little work.
_VALUE_GROUP = 64


class Map(Node):
    def __init__(self, upstream: Node, fn: Callable[..., Any]) -> None:
        self.upstream, self.fn = upstream, fn

    def cardinality(self) -> int:
        return self.upstream.cardinality()  # as TF: map keeps the count

    def describe(self) -> str:
        return f"map({getattr(self.fn, '__name__', type(self.fn).__name__)})"

    def rebuilt(self, upstream: Node | None, seed: int, position: int) -> Node:
        return Map(upstream, self.fn)

    def element_spec(self) -> Any:
        """The spec of ``fn``'s result on the first element of a fresh copy of the upstream
        (TF traces ``fn`` symbolically; here it runs once). Over batches of varying size the
        result's leading dimension is reported as ``None``, as TF's trace would."""
        upstream = self.upstream.element_spec()
        for chunk in fresh_copy(self.upstream, 0).open():
            for element in chunk.elements():
                result = _structure.map_leaves(as_component, call_with_element(self.fn, element))
                spec = spec_of(result)
                if _varying_batches(upstream):
                    spec = _structure.map_leaves(_unknown_leading, spec)
                return spec
        raise InputError(
            f"cannot tell the element_spec of {self.describe()}: the dataset it maps is empty, "
            "and the function has to run once to show what it returns"
        )

    def open(self, state: PassState | None = None) -> Pass:
        up = self.upstream.open(upstream_state(state))
        unread = Unread()
        chunks = with_rest(state, up)
        return Pass(
            self._map(chunks, unread),
            lambda: {"up": up.state(), "rest": rest_of(unread, chunks)},
        )

    def _map(self, chunks: Iterator[Chunk], unread: Unread) -> Iterator[Chunk]:
        # One result at a time, as tf.data's map: a consumer (a prefetch thread, the step) gets
        # each element as soon as it is made, and an error comes after the elements before it,
        # as that element's: the next() that asks for it raises, the next one goes on.
        for chunk in chunks:
            if isinstance(chunk, ErrorChunk):
                yield chunk
                continue
            unread.set(chunk)
            for element in unread.elements():
                try:
                    result = call_with_element(self.fn, element)
                except Exception as e:
                    yield ErrorChunk(e)
                    continue
                yield ValueChunk([_structure.map_leaves(as_component, result)])


def _varying_batches(spec: Any) -> bool:
    leaves = _structure.flatten(spec)
    return bool(leaves) and all(leaf.shape and leaf.shape[0] is None for leaf in leaves)


def _unknown_leading(spec: TensorSpec) -> TensorSpec:
    return spec.inner().with_leading(None) if spec.shape else spec


def call_with_element(fn: Callable[..., Any], element: Any) -> Any:
    """Call ``fn`` as tf.data does: a plain tuple element's components become positional args;
    any other element, a namedtuple included, is the one argument.

    A ``StopIteration`` out of ``fn`` is that element's error, never the end of the data: TF's
    ``map`` keeps the cardinality (``preserve_cardinality``) and turns the function's end of
    sequence into an ``InvalidArgumentError`` of the element; here an ``InputError``."""
    try:
        return fn(*element) if type(element) is tuple else fn(element)
    except StopIteration as e:
        name = getattr(fn, "__name__", type(fn).__name__)
        raise InputError(
            f"the function {name} raised StopIteration for an element: a function given to "
            "map, filter or interleave ending the iteration is an error of that element, not "
            "the end of the data (as TF's, which keeps the dataset's cardinality)"
        ) from e


def as_component(value: Any) -> Any:
    # map may return numpy arrays or Python numbers, as TF converts them; other objects pass.
    if isinstance(value, torch.Tensor):
        return value.detach() if value.requires_grad else value
    if isinstance(value, (str, bytes)):
        return value  # a string element stays a Python string (torch has no string tensor)
    try:
        return _structure.to_tensor("<map result>", value)
    except (TypeError, ValueError):
        return value


class Filter(Node):
    def __init__(self, upstream: Node, predicate: Callable[..., Any]) -> None:
        self.upstream, self.predicate = upstream, predicate

    def cardinality(self) -> int:
        n = self.upstream.cardinality()
        return n if n in (0, INFINITE) else UNKNOWN  # as TF: how many pass is not known

    def describe(self) -> str:
        return f"filter({getattr(self.predicate, '__name__', type(self.predicate).__name__)})"

    def rebuilt(self, upstream: Node | None, seed: int, position: int) -> Node:
        return Filter(upstream, self.predicate)

    def open(self, state: PassState | None = None) -> Pass:
        up = self.upstream.open(upstream_state(state))
        unread = Unread()
        out: deque[Chunk] = deque([] if state is None else state["out"])

        chunks = with_rest(state, up)

        def where() -> PassState:
            return {"up": up.state(), "rest": rest_of(unread, chunks), "out": list(out)}

        return Pass(self._filter(chunks, unread, out), where)

    def _filter(
        self, chunks: Iterator[Chunk], unread: Unread, out: deque[Chunk]
    ) -> Iterator[Chunk]:
        while out:
            yield out.popleft()
        for chunk in chunks:
            if isinstance(chunk, ErrorChunk):
                yield chunk  # the failed element's error, in its place
                continue
            unread.set(chunk)
            while (part := unread.take(_VALUE_GROUP)) is not None:
                out.extend(_kept(part, [self._outcome(e) for e in part.elements()]))
                while out:
                    yield out.popleft()

    def _outcome(self, element: Any) -> bool | Exception:
        try:
            return self._keep(element)
        except Exception as e:  # the element's error, raised where it is asked for
            return e

    def _keep(self, element: Any) -> bool:
        result = call_with_element(self.predicate, element)
        if isinstance(result, torch.Tensor):
            if result.numel() != 1:
                raise InputError(
                    f"filter's predicate must return one boolean; it returned a tensor of shape "
                    f"{tuple(result.shape)}"
                )
            return bool(result.item())
        return bool(result)


def _kept(part: Chunk, outcomes: list[bool | Exception]) -> Iterator[Chunk]:
    """``part``'s elements whose outcome is True, in order, with each failed element's error
    in its place (index chunks stay index chunks)."""
    begin = 0
    for i in range(len(outcomes) + 1):
        if i < len(outcomes) and not isinstance(outcomes[i], Exception):
            continue
        keep = np.zeros(len(outcomes), dtype=bool)
        keep[begin:i] = [bool(o) for o in outcomes[begin:i]]
        if keep.any():
            yield part.select(keep)
        if i < len(outcomes):
            yield ErrorChunk(outcomes[i])  # type: ignore[arg-type]
        begin = i + 1


class Cache(Node):
    """Keeps the first complete pass and replays it, as ``tf.data``'s in-memory cache does."""

    def __init__(self, upstream: Node) -> None:
        self.upstream = upstream
        self._kept: list[Chunk] | None = None
        self._stacked: Any = None  # the kept values as tensors, where they were stacked

    def cardinality(self) -> int:
        return self.upstream.cardinality()

    def describe(self) -> str:
        return "cache()"

    def rebuilt(self, upstream: Node | None, seed: int, position: int) -> Node:
        return Cache(upstream)

    def node_state(self) -> dict[str, Any]:
        if self._kept is None:
            return {"kept": None}
        if self._stacked is not None:
            return {"kept": "stacked", "stacked": self._stacked}
        return {"kept": "chunks", "chunks": list(self._kept)}

    def load_node_state(self, state: dict[str, Any]) -> None:
        if state["kept"] == "stacked":
            self._keep_stacked(state["stacked"])
        else:
            self._kept, self._stacked = state.get("chunks"), None

    def sources(self) -> list[Any]:
        return [] if self._stacked is None else [self._kept_source]

    def open(self, state: PassState | None = None) -> Pass:
        mode = None if state is None else state["mode"]
        if mode == "replay" or (mode is None and self._kept is not None):
            assert self._kept is not None
            at = {"mode": "replay", "index": 0 if state is None else int(state["index"])}
            return Pass(_replay(self._kept, at), lambda: dict(at))
        up = self.upstream.open(upstream_state(state))
        if mode == "through" or (mode is None and self.upstream.cardinality() == INFINITE):
            return Pass(up, lambda: {"mode": "through", "up": up.state()})  # endless: not kept
        seen: list[Chunk] = [] if state is None else list(state["seen"])
        failed = {"failed": False if state is None else bool(state["failed"])}

        def where() -> PassState:
            return {"mode": "record", "up": up.state(), "seen": list(seen), **failed}

        return Pass(self._record(up, seen, failed), where)

    def _record(
        self, chunks: Iterator[Chunk], seen: list[Chunk], failed: dict[str, bool]
    ) -> Iterator[Chunk]:
        for chunk in chunks:
            failed["failed"] = failed["failed"] or isinstance(chunk, ErrorChunk)
            seen.append(chunk)
            yield chunk
        # Reached only when the pass completes; an abandoned pass keeps nothing, as in TF, and
        # neither does one with a failed element (the next pass computes it again).
        if not failed["failed"]:
            self._keep(seen)

    def _keep(self, chunks: list[Chunk]) -> None:
        """Keep a pass in its cheapest replayable form.

        Index chunks are kept as they are (8 bytes an element). Computed values (after ``map``)
        are stacked into tensors when they allow it, so later passes read them with vectorized
        indices again, like data given to ``from_tensor_slices``.
        """
        chunks = [c for c in chunks if len(c)]
        self._kept, self._stacked = chunks, None
        if not chunks or not all(isinstance(c, ValueChunk) for c in chunks):
            return
        values = [v for c in chunks for v in c.values]  # type: ignore[union-attr]
        try:
            stacked = stack_values(values)
        except (InputError, RuntimeError, TypeError):  # ragged or not tensors: replay them as is
            return
        self._keep_stacked(stacked)

    def _keep_stacked(self, stacked: Any) -> None:
        self._stacked = stacked
        self._kept_source = TensorSlices(stacked, _structure.flatten(stacked))
        self._kept = list(source_chunks(self._kept_source))


def _replay(kept: list[Chunk], at: dict[str, Any]) -> Iterator[Chunk]:
    while at["index"] < len(kept):
        at["index"] += 1
        yield kept[at["index"] - 1]


class Enumerate(Node):
    """``(index, element)`` pairs, the index an int64 scalar counting from ``start``."""

    def __init__(self, upstream: Node, start: int) -> None:
        self.upstream, self.start = upstream, start

    def cardinality(self) -> int:
        return self.upstream.cardinality()

    def describe(self) -> str:
        return f"enumerate(start={self.start})"

    def rebuilt(self, upstream: Node | None, seed: int, position: int) -> Node:
        return Enumerate(upstream, self.start)

    def element_spec(self) -> Any:
        return (TensorSpec((), torch.int64), self.upstream.element_spec())

    def open(self, state: PassState | None = None) -> Pass:
        up = self.upstream.open(upstream_state(state))
        at = {"count": self.start if state is None else int(state["count"])}
        return Pass(self._enumerate(up, at), lambda: {"up": up.state(), **at})

    def _enumerate(self, chunks: Iterator[Chunk], at: dict[str, int]) -> Iterator[Chunk]:
        for chunk in chunks:
            if not len(chunk):
                continue
            count = at["count"]
            at["count"] += len(chunk)
            if isinstance(chunk, ErrorChunk):
                yield chunk  # as TF's zip with a range: the failed element takes its number
                continue
            numbers = torch.arange(count, count + len(chunk), dtype=torch.int64)
            yield ValueChunk(list(zip(numbers.unbind(), chunk.elements())))
