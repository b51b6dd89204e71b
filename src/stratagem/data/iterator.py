"""The iterator ``iter(dataset)`` returns: ``next``, ``get_next`` and ``get_next_as_optional``
(TF's ``OwnedIterator``), and ``state_dict``/``load_state_dict``, its exact position for a
checkpoint (``sg.train.Checkpoint(iterator=it)``, as TF's iterators are checkpointable)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from stratagem.data._chunks import Chunk
from stratagem.data._nodes import Node
from stratagem.data._saved_state import decode, encode
from stratagem.data.optional import Optional
from stratagem.errors import InputError

STATE_FORMAT = "stratagem.data iterator"
STATE_VERSION = 1


class DatasetIterator:
    """One pass over a dataset's elements."""

    __slots__ = ("_chunk", "_node", "_pass", "_pending", "_taken")

    def __init__(self, node: Node) -> None:
        self._node = node
        # open() runs now, not at the first next(): shuffle seeds are drawn at iter() time.
        self._pass = node.open()
        self._chunk: Chunk | None = None  # the chunk being handed out, element by element
        self._taken = 0  # of its elements, handed out
        self._pending: Iterator[Any] = iter(())

    def __iter__(self) -> DatasetIterator:
        return self

    def __next__(self) -> Any:
        while True:
            element = next(self._pending, _NONE)
            if element is not _NONE:
                self._taken += 1
                return element
            self._chunk, self._taken = None, 0
            chunk = next(self._pass)  # StopIteration ends the pass
            self._pending = chunk.elements()  # a failed element's error is raised here
            self._chunk = chunk

    def get_next(self) -> Any:
        """The next element; raises ``StopIteration`` at the end (TF: ``OutOfRangeError``)."""
        return next(self)

    def get_next_as_optional(self) -> Optional:
        """The next element as an ``Optional``, empty at the end instead of raising."""
        element = next(self, _NONE)
        if element is _NONE:
            return Optional.empty(lambda: self._node.element_spec())
        return Optional.from_value(element)

    @property
    def element_spec(self) -> Any:
        return self._node.element_spec()  # on demand: a map's spec runs its function

    # -- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where this iterator stands, as tensors and plain data: every stage's position, the
        elements stages hold (a shuffle's buffer, a batch being gathered, a prefetch's made
        elements) and the pipeline's seeds and pass counters. A restore continues at the exact
        next element. Raises ``InputError`` for a pipeline whose position cannot be saved (a
        ``from_generator`` source)."""
        stages = self._node.stages()
        sources: list[Any] = []
        nodes = []
        for stage in stages:
            nodes.append(encode(stage.node_state(), sources))
            sources.extend(stage.sources())
        rest = None
        if self._chunk is not None and self._taken < len(self._chunk):
            rest = self._chunk.select(slice(self._taken, None))
        position = encode({"pass": self._pass.state(), "rest": rest}, sources)
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "stages": _signature(stages),
            "nodes": nodes,
            "position": position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where the iterator that saved ``state`` stood (a pipeline of the same
        stages); this iterator's own pass is dropped."""
        stages = self._node.stages()
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise InputError(f"not a saved {STATE_FORMAT} state: {_brief(state)}")
        if state.get("version") != STATE_VERSION:
            raise InputError(
                f"a saved iterator state of version {state.get('version')!r}; this version of "
                f"stratagem reads version {STATE_VERSION}"
            )
        if state.get("stages") != _signature(stages):
            raise InputError(
                f"the saved iterator went over a pipeline of stages {state.get('stages')}; this "
                f"one goes over {_signature(stages)}: restore into an iterator of the dataset "
                "made the same way"
            )
        self._pass.close()
        sources: list[Any] = []
        for stage, saved in zip(stages, state["nodes"]):
            stage.load_node_state(decode(saved, sources))
            sources.extend(stage.sources())
        position = decode(state["position"], sources)
        self._pass = self._node.open(position["pass"])
        rest: Chunk | None = position["rest"]
        self._chunk, self._taken = rest, 0
        self._pending = iter(()) if rest is None else rest.elements()


def _signature(stages: list[Node]) -> list[str]:
    """What a saved state must match: the kinds of the stages (not their seeds, which a
    distributed job draws anew at each start and the state carries)."""
    return [type(stage).__name__ for stage in stages]


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


_NONE = object()
