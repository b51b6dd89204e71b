"""``map(fn, num_parallel_calls=n)``: up to ``n`` calls of ``fn`` at once, results in order.

The calls run on a pool of ``n`` threads, which helps where ``fn`` leaves the GIL: torch
operations, numpy, reading files, sleeping on I/O. Results come out in the input's order
whatever order the calls finish in, as tf.data's default ``deterministic=True`` gives them;
``deterministic=False`` allows any order in TF, and this order is one of them.

The pool belongs to one pass and is made at its first element; abandoning the pass (``break``,
an upstream ``take``, a ``prefetch`` stopping) closes the generator, whose ``finally`` cancels
the calls not started and waits for the running ones, so no thread outlives the pass.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from stratagem.data import _structure
from stratagem.data._chunks import Chunk, ErrorChunk, ValueChunk
from stratagem.data._nodes import (
    Node,
    Pass,
    PassState,
    Resumed,
    Unread,
    rest_of,
    upstream_state,
    with_rest,
)
from stratagem.data._values import Map, as_component, call_with_element


class ParallelMap(Map):
    def __init__(self, upstream: Node, fn: Callable[..., Any], calls: int) -> None:
        super().__init__(upstream, fn)
        self.calls = calls

    def describe(self) -> str:
        return f"{super().describe()[:-1]}, num_parallel_calls={self.calls})"

    def rebuilt(self, upstream: Node | None, seed: int, position: int) -> Node:
        assert upstream is not None
        return ParallelMap(upstream, self.fn, self.calls)

    def open(self, state: PassState | None = None) -> Pass:
        up = self.upstream.open(upstream_state(state))
        unread = Unread()
        # The calls made and not handed on yet, with their inputs: a checkpoint keeps the
        # inputs, and a resumed pass makes those calls again first.
        in_flight: deque[tuple[Chunk, Future[Any]]] = deque()

        rest = with_rest(state, up)
        chunks = Resumed([] if state is None else list(state["inputs"]), rest)

        def where() -> PassState:
            # The calls in flight, then those a resumed pass has not made again yet.
            inputs = [element for element, _ in in_flight] + chunks.pending()
            return {"up": up.state(), "rest": rest_of(unread, rest), "inputs": inputs}

        return Pass(self._calls(chunks, unread, in_flight), where)

    def _calls(
        self,
        chunks: Iterator[Chunk],
        unread: Unread,
        in_flight: deque[tuple[Chunk, Future[Any]]],
    ) -> Iterator[Chunk]:
        own: set[int] = set()  # the pool's threads, as they start
        pool = ThreadPoolExecutor(
            self.calls, thread_name_prefix="stratagem-map", initializer=_record, initargs=(own,)
        )
        try:
            for chunk in chunks:
                if isinstance(chunk, ErrorChunk):
                    in_flight.append((chunk, _failed(chunk.error)))  # in its place
                    continue
                unread.set(chunk)
                for element in unread.elements():
                    call = pool.submit(_apply, self.fn, element)
                    in_flight.append((ValueChunk([element]), call))
                    if len(in_flight) >= self.calls:
                        yield _result(in_flight.popleft()[1])
            while in_flight:
                yield _result(in_flight.popleft()[1])
        finally:
            # A pass dropped by a call of its own map (its last reference let go in one of the
            # pool's threads) is closed in that thread, which cannot wait for itself: the
            # threads then end on their own once their calls return.
            pool.shutdown(wait=threading.get_ident() not in own, cancel_futures=True)


def _record(own: set[int]) -> None:
    own.add(threading.get_ident())


def _result(call: Future[Any]) -> Chunk:
    """A call's result, or its error as the element's (raised by the ``next()`` that asks for
    it, with the worker's traceback; the pass goes on, as tf.data's)."""
    error = call.exception()
    return ErrorChunk(error) if isinstance(error, Exception) else ValueChunk([call.result()])


def _failed(error: Exception) -> Future[Any]:
    done: Future[Any] = Future()
    done.set_exception(error)
    return done


def _apply(fn: Callable[..., Any], element: Any) -> Any:
    return _structure.map_leaves(as_component, call_with_element(fn, element))
