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
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from stratagem.data._chunks import BLOCK, Chunk, ErrorChunk, IndexChunk, Source, ValueChunk
from stratagem.data._nodes import Node, Pass, PassState, upstream_state

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
        self._passes = 0  # iter() calls so far: pass e uses seed (seed, e)
        self._drawn: int | None = None  # the one seed of an unseeded non-reshuffling shuffle

    def cardinality(self) -> int:
        return self.upstream.cardinality()

    def describe(self) -> str:
        return f"shuffle({self.buffer_size}, seed={self.seed}, reshuffle={self.reshuffle})"

    def rebuilt(self, upstream: Node | None, seed: int, position: int) -> Node:
        own = self.seed if self.seed is not None else derive_seed(seed, _TAG_RESEED, position)
        return Shuffle(upstream, self.buffer_size, own, self.reshuffle)

    def node_state(self) -> dict[str, Any]:
        # The seed too: a distributed job reseeds its copy with a seed drawn anew at each start,
        # and a resumed job must go on with the order of the job that saved.
        return {"seed": self.seed, "passes": self._passes, "drawn": self._drawn}

    def load_node_state(self, state: dict[str, Any]) -> None:
        self.seed, self._passes, self._drawn = state["seed"], state["passes"], state["drawn"]

    def open(self, state: PassState | None = None) -> Pass:
        if state is None:
            rng = self._pass_generator()
        else:
            rng = np.random.default_rng()
            rng.bit_generator.state = state["rng"]
        up = self.upstream.open(upstream_state(state))
        n = self.upstream.cardinality()
        if 0 <= n <= self.buffer_size:
            return _Permuted(up, rng, state).as_pass()  # what a buffer holding everything is
        return _Streaming(up, self.buffer_size, rng, state).as_pass()

    def _pass_generator(self) -> np.random.Generator:
        if self.seed is not None:
            epoch = self._passes if self.reshuffle else 0
            self._passes += 1
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

    def encode_all(self, chunks: list[Chunk]) -> np.ndarray:
        arrays = [self.encode(c) for c in chunks if len(c)]
        return np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)

    def decode(self, handles: np.ndarray) -> Iterator[Chunk]:
        """The elements of ``handles``, which leave the buffer."""
        yield from self.peek(handles)
        if self.direct is None:
            for h in handles.tolist():
                del self.parked[h]

    def peek(self, handles: np.ndarray) -> list[Chunk]:
        """The elements of ``handles`` as chunks, left where they are (for a checkpoint)."""
        if self.direct is not None:
            return [IndexChunk(self.direct, handles.copy())] if len(handles) else []
        parked = [self.parked[h] for h in handles.tolist()]
        if any(isinstance(p, IndexChunk) for p in parked):
            return parked
        return [ValueChunk(parked)] if parked else []


class _Permuted:
    """A shuffle whose buffer holds the whole pass: gather everything, emit a permutation."""

    def __init__(self, up: Pass, rng: np.random.Generator, state: PassState | None) -> None:
        self.up, self.rng = up, rng
        self.gathered: list[Chunk] = [] if state is None else list(state["gathered"])
        self.out: deque[Chunk] | None = None
        if state is not None and state["out"] is not None:
            self.out = deque(state["out"])

    def as_pass(self) -> Pass:
        return Pass(self._chunks(), self._state)

    def _state(self) -> PassState:
        return {
            "up": self.up.state(),
            "rng": self.rng.bit_generator.state,
            "gathered": list(self.gathered),
            "out": None if self.out is None else list(self.out),
        }

    def _chunks(self) -> Iterator[Chunk]:
        if self.out is None:
            for chunk in self.up:
                if isinstance(chunk, ErrorChunk):
                    yield chunk  # as TF's shuffle: an input's error is raised as the buffer fills
                elif len(chunk):
                    self.gathered.append(chunk)
            handles = _Handles()
            everything = handles.encode_all(self.gathered)
            order = everything[self.rng.permutation(len(everything))]
            self.out, self.gathered = deque(handles.decode(order)), []
        while self.out:
            yield self.out.popleft()


class _Streaming:
    """tf.data's shuffle: fill a buffer of ``size``, then each step emit a random slot's element
    and put the next input element in that slot; at the end, emit what is left in random order.

    The steps are vectorized over a block of inputs ``u`` with slot draws ``j``: step k emits
    ``u[t]`` for the latest earlier step t of the block that drew the same slot, else the slot's
    content at the block's start. Same distribution as the one-by-one loop, at numpy speed.
    Its state: the buffer's elements in slot order, the inputs not yet stepped, the outputs not
    yet handed on, and the generator's state.
    """

    def __init__(
        self, up: Pass, size: int, rng: np.random.Generator, state: PassState | None
    ) -> None:
        self.up, self.size, self.rng = up, size, rng
        self.handles = _Handles()
        self.buffer: np.ndarray | None = None
        self.filling: list[np.ndarray] = []
        self.incoming = np.zeros(0, dtype=np.int64)  # received, not stepped yet
        self.out: deque[Chunk] = deque()
        if state is not None:
            if state["buffer"] is not None:
                self.buffer = self.handles.encode_all(state["buffer"])
            self.filling = [self.handles.encode_all(state["filling"])]
            self.incoming = self.handles.encode_all(state["incoming"])
            self.out = deque(state["out"])

    def as_pass(self) -> Pass:
        return Pass(self._chunks(), self._state)

    def _state(self) -> PassState:
        peek = self.handles.peek
        return {
            "up": self.up.state(),
            "rng": self.rng.bit_generator.state,
            "buffer": None if self.buffer is None else peek(self.buffer),
            "filling": [c for f in self.filling for c in peek(f)],
            "incoming": peek(self.incoming),
            "out": list(self.out),
        }

    def _chunks(self) -> Iterator[Chunk]:
        yield from self._drain()  # what a restored pass had made and not handed on
        yield from self._step()
        for chunk in self.up:
            if isinstance(chunk, ErrorChunk):
                yield chunk  # as TF's shuffle: an input's error is raised when it arrives
                continue
            if len(chunk):
                self.incoming = self.handles.encode(chunk)
                yield from self._step()
        if self.buffer is not None:
            rest = self.buffer
        else:
            rest = np.concatenate(self.filling) if self.filling else np.zeros(0, dtype=np.int64)
        self.buffer, self.filling = None, []
        if len(rest):
            self.out.extend(self.handles.decode(rest[self.rng.permutation(len(rest))]))
        yield from self._drain()

    def _step(self) -> Iterator[Chunk]:
        while len(self.incoming):
            if self.buffer is None:
                filled = sum(len(f) for f in self.filling)
                need = self.size - filled
                self.filling.append(self.incoming[:need])
                self.incoming = self.incoming[need:]
                if filled + len(self.filling[-1]) == self.size:
                    self.buffer, self.filling = np.concatenate(self.filling), []
                continue
            block, self.incoming = self.incoming[:BLOCK], self.incoming[BLOCK:]
            self.out.extend(self.handles.decode(_steps(self.buffer, block, self.rng)))
            yield from self._drain()

    def _drain(self) -> Iterator[Chunk]:
        while self.out:
            yield self.out.popleft()


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
