"""What ``ClusterCoordinator`` hands back: remote values, per-worker datasets and
iterators, and the errors a scheduled function ends with (TF's names)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol


class _MakesIterators(Protocol):
    def make_iterator(self, dataset: PerWorkerDataset) -> PerWorkerIterator: ...


class CancelledError(RuntimeError):
    """A scheduled function that never ran: an earlier one failed (TF's ``CancelledError``)."""


class FunctionError(RuntimeError):
    """A scheduled function raised on its worker; the message has the worker's traceback."""

    def __init__(self, message: str, type_name: str) -> None:
        super().__init__(message)
        self.type_name = type_name  # the type the function raised on the worker


class ClosureInputError(RuntimeError):
    """A scheduled function's argument is a ``RemoteValue`` whose function failed: the function
    does not run (TF's ``ClosureInputError``, its message); ``original_exception`` is that
    failure."""

    def __init__(self, original_exception: BaseException) -> None:
        if isinstance(original_exception, ClosureInputError):
            original_exception = original_exception.original_exception
        self.original_exception = original_exception
        super().__init__(
            f"Input has an error, the original exception is {original_exception!r}, error "
            f"message is {original_exception}."
        )


class RemoteValue:
    """The value a scheduled function will return (TF's ``tf.distribute.experimental.
    coordinator.RemoteValue``): ``fetch()`` waits for it."""

    def __init__(self, name: str, on_fetch: Callable[[], None] = lambda: None) -> None:
        self._name = name
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._on_fetch = on_fetch  # the coordinator's: the chief's reads see the ps after it

    def settle(
        self,
        value: Any = None,
        error: BaseException | None = None,
        merge: Callable[[], None] = lambda: None,
    ) -> bool:
        """The coordinator's side: set the value once (a function run twice is counted
        once); ``merge`` (what else the function returned: its metric totals) runs first, so
        that whoever fetches the value sees all of it. False if it was set already (``merge``
        is not run)."""
        if self._done.is_set():
            return False
        self._value, self._error = value, error
        merge()
        self._done.set()
        return True

    def fetch(self) -> Any:
        """Wait for the function to finish; its value (or the error it raised)."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        self._on_fetch()
        return self._value

    def settled(self) -> tuple[Any, BaseException | None]:
        """Wait for the function to finish: its value and its error (one of them None), as the
        coordinator passes it to a function scheduled with it as an argument."""
        self._done.wait()
        return self._value, self._error

    def get(self) -> Any:
        """As ``fetch`` (TF's ``get`` returns the value without copying it to the host)."""
        return self.fetch()

    def __repr__(self) -> str:
        state = "pending" if not self._done.is_set() else "failed" if self._error else "ready"
        return f"RemoteValue({self._name}, {state})"


class PerWorkerIterator:
    """An iterator that each worker holds its own of; passed to ``schedule``, the function gets
    the iterator of the worker it runs on."""

    def __init__(self, iterator_id: int) -> None:
        self.iterator_id = iterator_id

    def __next__(self) -> Any:
        raise TypeError(
            "a per-worker iterator is read inside a scheduled function (pass it to "
            "coordinator.schedule), not on the chief"
        )


class PerWorkerDataset:
    """A dataset built on every worker by ``dataset_fn``; ``iter`` gives a ``PerWorkerIterator``."""

    def __init__(self, coordinator: _MakesIterators, dataset_id: int) -> None:
        self._coordinator = coordinator
        self.dataset_id = dataset_id

    def __iter__(self) -> PerWorkerIterator:
        return self._coordinator.make_iterator(self)
