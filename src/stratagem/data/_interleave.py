"""``interleave``: a dataset made from each input element, read ``block_length`` elements at a
time from ``cycle_length`` of them in turn, as tf.data's interleave (deterministic order).

Its state is the input's position, and for each slot of the cycle the input element it was
made from and its iterator's own state: a restore makes the slot's dataset again from that
element and continues its iterator where it stood.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from stratagem.data._chunks import Chunk, ErrorChunk, ValueChunk
from stratagem.data._nodes import (
    UNKNOWN,
    Node,
    Pass,
    PassState,
    Unread,
    rest_of,
    upstream_state,
    with_rest,
)
from stratagem.data._saved_state import Encoded
from stratagem.data._values import call_with_element
from stratagem.errors import InputError


class Interleave(Node):
    def __init__(
        self,
        upstream: Node,
        fn: Callable[..., Any],
        cycle_length: int,
        block_length: int,
        iterate: Callable[[Any], Any],
    ) -> None:
        self.upstream, self.fn = upstream, fn
        self.cycle_length, self.block_length = cycle_length, block_length
        self._iterate = iterate  # a Dataset's iterator (given by dataset.py, which owns Dataset)

    def cardinality(self) -> int:
        return UNKNOWN  # as TF, unless the input is empty or infinite; not worth telling here

    def describe(self) -> str:
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        return f"interleave({name}, cycle_length={self.cycle_length}, block={self.block_length})"

    def rebuilt(self, upstream: Node | None, seed: int, position: int) -> Node:
        assert upstream is not None
        return Interleave(upstream, self.fn, self.cycle_length, self.block_length, self._iterate)

    def element_spec(self) -> Any:
        for chunk in self.upstream.open():
            for element in chunk.elements():
                return self._inner(element).element_spec
        raise InputError(f"cannot tell the element_spec of {self.describe()}: its input is empty")

    def _inner(self, element: Any) -> Any:
        made = call_with_element(self.fn, element)
        try:
            return self._iterate(made)
        except TypeError:
            raise InputError(
                f"interleave's function must return an sg.data.Dataset; it returned "
                f"{type(made).__name__}"
            ) from None

    def open(self, state: PassState | None = None) -> Pass:
        up = self.upstream.open(upstream_state(state))
        cycle = _Cycle(self, up, state)
        return Pass(cycle.chunks(), cycle.state)


class _Cycle:
    """One pass: TF's InterleaveDatasetOp loop, slot by slot."""

    def __init__(self, node: Interleave, up: Pass, state: PassState | None) -> None:
        self.node, self.up = node, up
        self.unread = Unread()
        self.input = with_rest(state, up)
        self.slots: list[tuple[Chunk, Any] | None] = [None] * node.cycle_length
        self.index, self.block, self.ended = 0, 0, False
        if state is not None:
            self.index, self.block, self.ended = state["index"], state["block"], state["ended"]
            for i, slot in enumerate(state["slots"]):
                if slot is not None:
                    element = next(slot["input"].elements())
                    iterator = node._inner(element)
                    iterator.load_state_dict(slot["iterator"])
                    self.slots[i] = (slot["input"], iterator)

    def state(self) -> PassState:
        slots = [
            None if s is None else {"input": s[0], "iterator": Encoded(s[1].state_dict())}
            for s in self.slots
        ]
        return {
            "up": self.up.state(),
            "rest": rest_of(self.unread, self.input),
            "slots": slots,
            "index": self.index,
            "block": self.block,
            "ended": self.ended,
        }

    def _next_input(self) -> Chunk | None:
        """The next input element as a one-element chunk (or a failed one), None at the end."""
        while True:
            part = self.unread.take(1)
            if part is not None:
                return part
            chunk = next(self.input, None)
            if chunk is None or isinstance(chunk, ErrorChunk):
                return chunk
            self.unread.set(chunk)

    def _advance(self) -> None:
        self.block = 0
        self.index = (self.index + 1) % self.node.cycle_length

    def chunks(self) -> Iterator[Chunk]:
        while not self.ended or any(s is not None for s in self.slots):
            slot = self.slots[self.index]
            if slot is not None:
                try:
                    element = next(slot[1])
                except StopIteration:
                    self.slots[self.index] = None
                    self._advance()
                    continue
                except Exception as e:  # the inner element's error, in its place
                    yield ErrorChunk(e)
                    continue
                self.block += 1
                if self.block == self.node.block_length:
                    self._advance()
                yield ValueChunk([element])
            elif not self.ended:
                part = self._next_input()
                if part is None:
                    self.ended = True
                elif isinstance(part, ErrorChunk):
                    yield part
                else:
                    element = next(part.elements())
                    self.slots[self.index] = (part, self.node._inner(element))
            else:
                self._advance()
