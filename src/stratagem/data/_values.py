"""The pipeline stages that need element values: ``map``, ``filter``, and ``cache``.

They run per element (a user function must see each one), so they come after index-only
stages for speed; ``cache`` turns computed values back into tensors read with vectorized
indices.
"""

from __future__ import annotations

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
from stratagem.data._nodes import INFINITE, UNKNOWN, Node, fresh_copy
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

    def open(self) -> Iterator[Chunk]:
        return self._map(self.upstream.open())

    def _map(self, chunks: Iterator[Chunk]) -> Iterator[Chunk]:
        # One result at a time, as tf.data's map: a consumer (a prefetch thread, the step) gets
        # each element as soon as it is made, and an error comes after the elements before it,
        # as that element's: the next() that asks for it raises, the next one goes on.
        for chunk in chunks:
            if isinstance(chunk, ErrorChunk):
                yield chunk
                continue
            for element in chunk.elements():
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
    any other element, a namedtuple included, is the one argument."""
    return fn(*element) if type(element) is tuple else fn(element)


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

    def open(self) -> Iterator[Chunk]:
        return self._filter(self.upstream.open())

    def _filter(self, chunks: Iterator[Chunk]) -> Iterator[Chunk]:
        for chunk in chunks:
            if isinstance(chunk, ErrorChunk):
                yield chunk  # the failed element's error, in its place
                continue
            for start in range(0, len(chunk), _VALUE_GROUP):
                part = chunk.select(slice(start, start + _VALUE_GROUP))
                yield from _kept(part, [self._outcome(e) for e in part.elements()])

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

    def cardinality(self) -> int:
        return self.upstream.cardinality()

    def describe(self) -> str:
        return "cache()"

    def rebuilt(self, upstream: Node | None, seed: int, position: int) -> Node:
        return Cache(upstream)

    def open(self) -> Iterator[Chunk]:
        if self._kept is not None:
            return iter(self._kept)
        if self.upstream.cardinality() == INFINITE:
            return self.upstream.open()  # an endless pass cannot be kept
        return self._record(self.upstream.open())

    def _record(self, chunks: Iterator[Chunk]) -> Iterator[Chunk]:
        seen: list[Chunk] = []
        failed = False
        for chunk in chunks:
            failed = failed or isinstance(chunk, ErrorChunk)
            seen.append(chunk)
            yield chunk
        # Reached only when the pass completes; an abandoned pass keeps nothing, as in TF, and
        # neither does one with a failed element (the next pass computes it again).
        if not failed:
            self._kept = _compact(seen)


def _compact(chunks: list[Chunk]) -> list[Chunk]:
    """A kept pass in its cheapest replayable form.

    Index chunks are kept as they are (8 bytes an element). Computed values (after ``map``) are
    stacked into tensors when they allow it, so later passes read them with vectorized indices
    again, like data given to ``from_tensor_slices``.
    """
    chunks = [c for c in chunks if len(c)]
    if not chunks or not all(isinstance(c, ValueChunk) for c in chunks):
        return chunks
    values = [v for c in chunks for v in c.values]
    try:
        stacked = stack_values(values)
    except (InputError, RuntimeError, TypeError):  # ragged or not tensors: replay them as is
        return chunks
    source = TensorSlices(stacked, _structure.flatten(stacked))
    return list(source_chunks(source))


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

    def open(self) -> Iterator[Chunk]:
        return self._enumerate(self.upstream.open())

    def _enumerate(self, chunks: Iterator[Chunk]) -> Iterator[Chunk]:
        count = self.start
        for chunk in chunks:
            if not len(chunk):
                continue
            if isinstance(chunk, ErrorChunk):
                yield chunk  # as TF's zip with a range: the failed element takes its number
                count += 1
                continue
            numbers = torch.arange(count, count + len(chunk), dtype=torch.int64)
            yield ValueChunk(list(zip(numbers.unbind(), chunk.elements())))
            count += len(chunk)
