"""``prefetch`` and ``prefetch_to_device``: the next elements prepared in a background thread.

Every stage before a prefetch runs in one background thread per pass (a ``map``, reading a
batch from the arrays, a copy to a device), which keeps up to ``buffer_size`` finished elements
in a queue while the training step runs in the caller's thread. Elements come out in the order
the upstream makes them: one producer, one FIFO queue.

An element's error (its ``map`` raised) travels in its place and is raised by the ``next()``
that asks for it; the pass goes on, as tf.data's. Any other exception in the background thread
is handed to the consumer and raised by its ``next()`` with the background thread's traceback,
ending the pass. The thread stops when the pass ends, when the pass is
abandoned (a ``break`` drops the iterator: the generator's ``finally`` or, for a pass never
started, a ``weakref.finalize``, stops it), and at interpreter exit (an ``atexit`` hook stops
every live one), so no thread outlives its iterator.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from stratagem.data._chunks import Chunk, ErrorChunk, ValueChunk
from stratagem.data._nodes import Node

# TF's AUTOTUNE tunes the buffer while it runs; a fixed two elements keeps one ready while the
# next is made, which is what overlapping one producer with one consumer needs.
AUTOTUNE_BUFFER = 2

Transfer = Callable[[Any], Any]

_ITEM, _FAILED, _END, _ERROR = "item", "failed", "end", "error"
_live: weakref.WeakSet[Prefetcher] = weakref.WeakSet()


class Prefetch(Node):
    """Up to ``buffer_size`` elements made ahead in a background thread.

    ``send`` runs on each element in the background thread (a copy to a device) and
    ``receive`` in the consumer's thread as it takes the element (waiting for that copy).
    """

    def __init__(
        self,
        upstream: Node,
        buffer_size: int,
        send: Transfer | None = None,
        receive: Transfer | None = None,
        description: str | None = None,
    ) -> None:
        self.upstream, self.buffer_size = upstream, buffer_size
        self.send, self.receive = send, receive
        self.description = description or f"prefetch({buffer_size})"

    def cardinality(self) -> int:
        return self.upstream.cardinality()

    def describe(self) -> str:
        return self.description

    def rebuilt(self, upstream: Node | None, seed: int, position: int) -> Node:
        assert upstream is not None
        return Prefetch(upstream, self.buffer_size, self.send, self.receive, self.description)

    def open(self) -> Iterator[Chunk]:
        chunks = self.upstream.open()  # now, in the caller: shuffle seeds are drawn at iter()
        if self.buffer_size == 0 and self.send is None:
            return chunks
        worker = Prefetcher(chunks, max(1, self.buffer_size), self.send)
        drained = _drain(worker, self.receive)
        # A pass dropped before its first next() never runs the generator's finally.
        weakref.finalize(drained, worker.stop)
        return drained


def _drain(worker: Prefetcher, receive: Transfer | None) -> Iterator[Chunk]:
    try:
        while True:
            kind, value = worker.get()
            if kind == _END:
                return
            if kind == _ERROR:
                # The exception keeps the background thread's frames in its traceback.
                raise value
            if kind == _FAILED:
                yield ErrorChunk(value)
                continue
            yield ValueChunk([value if receive is None else receive(value)])
    finally:
        worker.stop()


class Prefetcher:
    """The background thread of one pass and its bounded queue of ``(kind, value)``."""

    def __init__(self, chunks: Iterator[Chunk], buffer_size: int, send: Transfer | None) -> None:
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=buffer_size)
        self._stopping = threading.Event()
        self._send = send
        self.thread = threading.Thread(
            target=self._fill, args=(chunks,), name="stratagem-prefetch", daemon=True
        )
        _live.add(self)
        self.thread.start()

    def _fill(self, chunks: Iterator[Chunk]) -> None:
        try:
            for chunk in chunks:
                if isinstance(chunk, ErrorChunk):
                    if not self._put(_FAILED, chunk.error):
                        return
                    continue
                for element in chunk.elements():
                    if not self._put(_ITEM, element):
                        return
            self._put(_END, None)
        except BaseException as exc:  # handed to the consumer, which raises it at its step
            self._put(_ERROR, exc)
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()  # an upstream parallel map shuts its pool down, here, in its thread

    def _put(self, kind: str, value: Any) -> bool:
        """Queue an element unless stopping. Checking before every put is what lets ``stop``
        wake a blocked producer by emptying the queue once: at most one put follows it."""
        if self._stopping.is_set():
            return False
        if kind == _ITEM and self._send is not None:
            value = self._send(value)
        self._queue.put((kind, value))
        return True

    def get(self) -> tuple[str, Any]:
        return self._queue.get()

    def stop(self) -> None:
        """Stop the thread and wait for it (it finishes the element it is making)."""
        self._stopping.set()
        # Empty the queue so that a producer blocked on a full one wakes; it then sees the flag
        # before making another element, so at most one more put follows, into free space.
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if threading.current_thread() is not self.thread:
            self.thread.join()
        _live.discard(self)


@atexit.register
def _stop_all() -> None:
    for worker in list(_live):
        worker.stop()
