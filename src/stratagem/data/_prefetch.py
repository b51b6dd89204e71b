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
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from stratagem.data._chunks import Chunk, ErrorChunk, ValueChunk
from stratagem.data._nodes import Node, Pass, PassState, Unread, upstream_state
from stratagem.errors import InputError

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

    def open(self, state: PassState | None = None) -> Pass:
        # Now, in the caller: shuffle seeds are drawn at iter().
        up = self.upstream.open(upstream_state(state))
        if self.buffer_size == 0 and self.send is None:
            return Pass(up, lambda: {"up": up.state(), "made": []})
        made = [] if state is None else list(state["made"])
        worker = Prefetcher(up, made, max(1, self.buffer_size), self.send)
        drained = _drain(worker, self.receive)
        # A pass dropped before its first next() never runs the generator's finally.
        weakref.finalize(drained, worker.stop)
        return Pass(drained, worker.state)


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
    """The background thread of one pass and its bounded buffer of ``(kind, value)``.

    The thread makes one element at a time while holding ``_making``, and puts it in the
    buffer; ``state`` takes that lock too, so it sees the upstream's position and the elements
    made from it (the buffer's, and the rest of the chunk being read) at one moment: elements
    made ahead are kept in a checkpoint, not lost.
    """

    def __init__(
        self, up: Pass, made: list[Chunk], buffer_size: int, send: Transfer | None
    ) -> None:
        self._up = up
        self._restored: deque[Chunk] = deque(made)  # a resumed pass's made elements, first
        self._unread = Unread()
        self._size = buffer_size
        self._ready: deque[tuple[str, Any, Any]] = deque()  # (kind, element as made, as sent)
        self._changed = threading.Condition()
        self._making = threading.Lock()
        self._stopping = threading.Event()
        self._send = send
        # Set while the thread waits for room, the buffer full and nothing being made; cleared
        # by each get(). For tests and diagnostics: it shows the thread idle without a sleep.
        self.waiting_for_room = threading.Event()
        # Started by the first get(), as TF's prefetch starts at the first GetNext: an iterator
        # made and then restored from a checkpoint has made nothing in vain.
        self.thread = threading.Thread(target=self._fill, name="stratagem-prefetch", daemon=True)
        _live.add(self)

    def _fill(self) -> None:
        try:
            while self._wait_for_room():
                with self._making:
                    item = self._make()
                    if item is None:
                        self._put((_END, None, None))
                        return
                    self._put(item)
        except BaseException as exc:  # handed to the consumer, which raises it at its step
            self._put((_ERROR, exc, exc))
        finally:
            self._up.close()  # an upstream parallel map shuts its pool down, here, in its thread

    def _make(self) -> tuple[str, Any, Any] | None:
        """The next element as ``(kind, value, value sent)``; None at the end of the pass."""
        while True:
            part = self._unread.take(1)
            if part is not None:
                element = next(part.elements())
                sent = element if self._send is None else self._send(element)
                return (_ITEM, element, sent)
            chunk = self._restored.popleft() if self._restored else next(self._up, None)
            if chunk is None:
                return None
            if isinstance(chunk, ErrorChunk):
                return (_FAILED, chunk.error, chunk.error)
            self._unread.set(chunk)

    def _wait_for_room(self) -> bool:
        with self._changed:
            while len(self._ready) >= self._size and not self._stopping.is_set():
                self.waiting_for_room.set()
                self._changed.wait()
        return not self._stopping.is_set()

    def _put(self, item: tuple[str, Any, Any]) -> None:
        with self._changed:
            self._ready.append(item)
            self._changed.notify_all()

    def get(self) -> tuple[str, Any]:
        if self.thread.ident is None:
            self.thread.start()
        with self._changed:
            while not self._ready:
                self._changed.wait()
            kind, _, sent = self._ready.popleft()
            self.waiting_for_room.clear()  # under the lock: set again only once full again
            self._changed.notify_all()
        return kind, sent

    def state(self) -> PassState:
        """Where the pass stands for the consumer: the upstream's position, and every element
        made from it that the consumer has not taken, in order."""
        with self._making, self._changed:
            made: list[Chunk] = []
            for kind, element, _ in self._ready:
                if kind == _ITEM:
                    made.append(ValueChunk([element]))
                elif kind == _FAILED:
                    made.append(ErrorChunk(element))
                elif kind == _ERROR:
                    raise InputError(
                        "cannot save the position of a prefetch whose upstream raised "
                        f"{type(element).__name__}: {element}"
                    )
            rest = self._unread.rest()
            made.extend(([rest] if rest is not None else []) + list(self._restored))
            return {"up": self._up.state(), "made": made}

    def stop(self) -> None:
        """Stop the thread and wait for it (it finishes the element it is making)."""
        self._stopping.set()
        with self._changed:
            self._changed.notify_all()
        if self.thread.ident is None:
            self._up.close()  # never started: nothing else will close the upstream
        elif threading.current_thread() is not self.thread:
            self.thread.join()
        _live.discard(self)


def running_prefetchers() -> list[Prefetcher]:
    """The background threads' prefetchers not stopped yet (for tests and diagnostics)."""
    return [worker for worker in list(_live) if worker.thread.ident is not None]


@atexit.register
def _stop_all() -> None:
    for worker in list(_live):
        worker.stop()
