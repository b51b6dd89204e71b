"""``Dataset.shuffle``: seeds, the full permutation, and tf.data's streaming buffer shuffle.

Seeds decide everything a distributed job needs to agree on: two processes that build the same
pipeline with the same shuffle seeds see the same order, so slicing a global batch gives each
worker distinct examples. ``seed_scope`` and ``Dataset.reseeded`` give unseeded shuffles such
seeds.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from stratagem.data._chunks import BLOCK, Chunk, ErrorChunk, IndexChunk, Source, ValueChunk
from stratagem.data._nodes import Node

_MASK64 = (1 << 64) - 1
# Domain tags keep the seeds seed_scope and reseeded derive apart from each other.
_TAG_SCOPE, _TAG_RESEED = 0x5C09E, 0x2E5EED


def derive_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed determined by ``(seed, *keys)``, the same on every machine."""
    sequence = np.random.SeedSequence([seed & _MASK64, *(k & _MASK64 for k in keys)])
    return int(sequence.generate_state(1, np.uint64)[0] >> np.uint64(1))


class _Scope:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.created = itertools.count()


_scope: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar(
    "stratagem_data_seed_scope", default=None
)


@contextlib.contextmanager
def seed_scope(seed: int) -> Iterator[None]:
    """Give every unseeded ``shuffle`` created inside a seed derived from ``(seed, k)``.

    For the distribute layer: ``distribute_datasets_from_function`` runs the user's dataset
    function inside ``seed_scope(shared_seed)`` on every worker, so the k-th shuffle each worker
    creates gets the same seed and every worker sees the same order. Shuffles given an explicit
    seed keep it. Scopes nest (the innermost one counts); threads start outside any scope.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed_scope needs an integer seed; got {seed!r} ({type(seed).__name__})")
    token = _scope.set(_Scope(seed))
    try:
        yield
    finally:
        _scope.reset(token)


def scoped_seed() -> int | None:
    """The seed a shuffle created now gets from the enclosing ``seed_scope``, if any."""
    scope = _scope.get()
    if scope is None:
        return None
    return derive_seed(scope.seed, _TAG_SCOPE, next(scope.created))


def _torch_seed() -> int:
    # Drawn from torch's global generator, so torch.manual_seed makes unseeded runs repeat.
    return int(torch.randint(0, 1 << 62, (), dtype=torch.int64))


class Shuffle(Node):
    def __init__(self, upstream: Node, buffer_size: int, seed: int | None, reshuffle: bool) -> None:
        self.upstream = upstream
        self.buffer_size = buffer_size
        self.seed = seed  # None: drawn from torch at iter() time
        self.reshuffle = reshuffle
        self._passes = itertools.count()  # iter() calls so far: pass e uses seed (seed, e)
        self._drawn: int | None = None  # the one seed of an unseeded non-reshuffling shuffle

    def cardinality(self) -> int:
        return self.upstream.cardinality()

    def describe(self) -> str:
        return f"shuffle({self.buffer_size}, seed={self.seed}, reshuffle={self.reshuffle})"

    def rebuilt(self, upstream: Node | None, seed: int, position: int) -> Node:
        own = self.seed if self.seed is not None else derive_seed(seed, _TAG_RESEED, position)
        return Shuffle(upstream, self.buffer_size, own, self.reshuffle)

    def open(self) -> Iterator[Chunk]:
        rng = self._pass_generator()
        n = self.upstream.cardinality()
        chunks = self.upstream.open()
        if 0 <= n <= self.buffer_size:
            return _permuted(chunks, rng)  # what a buffer holding everything amounts to
        return _streaming(chunks, self.buffer_size, rng)

    def _pass_generator(self) -> np.random.Generator:
        if self.seed is not None:
            epoch = next(self._passes) if self.reshuffle else 0
            return np.random.default_rng([self.seed & _MASK64, epoch])
        if self.reshuffle:
            return np.random.default_rng(_torch_seed())
        if self._drawn is None:
            self._drawn = _torch_seed()
        return np.random.default_rng(self._drawn)


class _Handles:
    """Elements as int64 handles, so the shuffle buffer is a numpy array whatever they are.

    Scalar indices of one source (the common, fast case) are their own handles. Anything else
    (batches, computed values) is parked in a dict under a counter; those elements are few or
    already cost per-element work.
    """

    def __init__(self) -> None:
        self.direct: Source | None = None
        self.decided = False
        self.parked: dict[int, Any] = {}  # values, or one-row index chunks
        self.counter = 0

    def encode(self, chunk: Chunk) -> np.ndarray:
        scalar = isinstance(chunk, IndexChunk) and chunk.ids.ndim == 1
        if not self.decided:
            self.decided = True
            if isinstance(chunk, IndexChunk) and scalar:
                self.direct = chunk.source
        if self.direct is not None:
            if not (isinstance(chunk, IndexChunk) and scalar and chunk.source is self.direct):
                raise AssertionError("a shuffle pass mixed chunk kinds")  # a bug of ours
            return chunk.ids
        handles = np.arange(self.counter, self.counter + len(chunk), dtype=np.int64)
        if isinstance(chunk, ValueChunk):
            self.parked.update(zip(handles.tolist(), chunk.values))
        else:  # batches: their index rows, each read later as one element
            self.parked.update(
                zip(handles.tolist(), (IndexChunk(chunk.source, row[None]) for row in chunk.ids))
            )
        self.counter += len(chunk)
        return handles

    def decode(self, handles: np.ndarray) -> Iterator[Chunk]:
        if self.direct is not None:
            yield IndexChunk(self.direct, handles)
            return
        parked = [self.parked.pop(h) for h in handles.tolist()]
        if any(isinstance(p, IndexChunk) for p in parked):
            yield from parked
        else:
            yield ValueChunk(parked)


def _permuted(chunks: Iterator[Chunk], rng: np.random.Generator) -> Iterator[Chunk]:
    handles = _Handles()
    encoded = []
    for chunk in chunks:
        if isinstance(chunk, ErrorChunk):
            yield chunk  # as TF's shuffle: an input's error is raised while the buffer fills
        elif len(chunk):
            encoded.append(handles.encode(chunk))
    if encoded:
        everything = np.concatenate(encoded)
        yield from handles.decode(everything[rng.permutation(len(everything))])


def _streaming(chunks: Iterator[Chunk], size: int, rng: np.random.Generator) -> Iterator[Chunk]:
    """tf.data's shuffle: fill a buffer of ``size``, then each step emit a random slot's element
    and put the next input element in that slot; at the end, emit what is left in random order.

    The steps are vectorized over a block of inputs ``u`` with slot draws ``j``: step k emits
    ``u[t]`` for the latest earlier step t of the block that drew the same slot, else the slot's
    content at the block's start. Same distribution as the one-by-one loop, at numpy speed.
    """
    handles = _Handles()
    filling: list[np.ndarray] = []
    filled = 0
    buffer: np.ndarray | None = None
    for chunk in chunks:
        if isinstance(chunk, ErrorChunk):
            yield chunk  # as TF's shuffle: an input's error is raised when it arrives
            continue
        if not len(chunk):
            continue
        incoming = handles.encode(chunk)
        if buffer is None:
            need = size - filled
            filling.append(incoming[:need])
            filled += len(filling[-1])
            incoming = incoming[need:]
            if filled < size:
                continue
            buffer = np.concatenate(filling)
        for start in range(0, len(incoming), BLOCK):
            out = _steps(buffer, incoming[start : start + BLOCK], rng)
            yield from handles.decode(out)
    rest = buffer if buffer is not None else np.concatenate(filling) if filling else None
    if rest is not None and len(rest):
        yield from handles.decode(rest[rng.permutation(len(rest))])


def _steps(buffer: np.ndarray, inputs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Run ``len(inputs)`` buffer steps in place on ``buffer``; return what they emit."""
    k = len(inputs)
    slots = rng.integers(0, len(buffer), size=k)
    order = np.argsort(slots, kind="stable")
    sorted_slots = slots[order]
    same = sorted_slots[1:] == sorted_slots[:-1]  # neighbours in a group drew the same slot
    previous = np.full(k, -1, dtype=np.int64)
    previous[order[1:][same]] = order[:-1][same]
    emitted = np.where(previous >= 0, inputs[previous], buffer[slots])
    last = np.ones(k, dtype=bool)
    last[:-1] = ~same  # each slot keeps the input of the last step that drew it
    buffer[sorted_slots[last]] = inputs[order[last]]
    return emitted
