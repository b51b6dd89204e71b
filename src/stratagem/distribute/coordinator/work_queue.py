"""The coordinator's work: scheduled functions (``Closure``) waiting and running, the per-worker
resources' log, and the first error, all under one condition (``WorkQueue.lock``).

Each ``WorkQueue`` method whose docstring says so expects ``lock`` held. ``fail`` keeps the
first error, cancels what is queued (its ``RemoteValue`` gets a ``CancelledError``) and marks
what runs as cancelled, telling each worker through ``tell_to_cancel`` (on a thread of its own).
The dispatch threads (``dispatch``) take closures from here; the workers' loss and rejoin
(``worker_loss``) edit ``workers``.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

from stratagem.comm.messages import Connection
from stratagem.distribute.coordinator.remote_values import CancelledError, RemoteValue


class Closure:
    """A scheduled function: its run request, its value, and what its run must see."""

    def __init__(
        self,
        cid: int,
        name: str,
        call: list[Any],
        accumulators: dict[str, Any],
        on_fetch: Callable[[], None],
    ) -> None:
        self.cid = cid
        self.name = name
        self.call = call  # the "run" request's arguments: [id, table, ref, args, kwargs]
        # The table's number when a worker may keep it (plain data alone, no tensor), the same
        # for every function whose table is the same (``shipping.TableNumbers``); else None.
        self.table_id: int | None = None
        self.entries: dict[str, bytes] | None = None  # each table entry's fingerprint
        self.accumulators = accumulators  # the metrics it sent: their totals come back
        self.value = RemoteValue(name, on_fetch)
        # The writes it must see (``WorkQueue.writes_ended``) when it was scheduled.
        self.must_see = 0
        # Set when an earlier function failed while this one ran: its outcome is not taken.
        self.cancelled: CancelledError | None = None


class WorkQueue:
    """What is scheduled and runs; ``describe(rank)`` names a worker, ``ps_writes()`` counts
    the chief's own writes to the ps, ``tell_to_cancel(rank, cids)`` stops running closures."""

    def __init__(
        self,
        describe: Callable[[int], str],
        ps_writes: Callable[[], int],
        tell_to_cancel: Callable[[int, list[int]], None],
    ) -> None:
        self._describe = describe
        self._ps_writes = ps_writes
        self._tell_to_cancel = tell_to_cancel
        self.lock = threading.Condition()
        self.queue: collections.deque[Closure] = collections.deque()
        self.inflight = 0
        self.running: dict[int, tuple[Closure, int]] = {}  # closure id -> (it, worker rank)
        self.error: BaseException | None = None
        self.resources: list[tuple[str, list[Any], str]] = []  # the per-worker log
        self.replayed: dict[int, int] = {}  # per worker rank: how much of the log it made
        self.workers: list[tuple[int, Connection]] = []  # the workers connected to
        self.next_id = 0
        self.closing = False
        # Runs ended (each may have pushed).
        self.finished = 0
        self.calls = 0  # runs sent to the workers: each is numbered (its worker's pulls)

    def new_id(self) -> int:
        """A fresh number for a closure, a per-worker resource or a table (the lock is held)."""
        self.next_id += 1
        return self.next_id

    def idle(self) -> bool:
        """Nothing queued or running, and every worker has made every per-worker resource (the
        lock is held)."""
        made = all(self.replayed.get(r, 0) == len(self.resources) for r, _ in self.workers)
        return not self.queue and self.inflight == 0 and made

    def writes_ended(self) -> int:
        """How many writes to the ps have ended (the lock is held): the runs of functions
        (each may have pushed) and the chief's own requests that changed the ps."""
        return self.finished + self._ps_writes()

    def call_numbers(self, closure: Closure, sent: collections.deque[tuple[int, int]]) -> list[int]:
        """Number a run of ``closure`` on a worker (the lock is held): ``[call, since]``.

        ``sent`` holds that worker's recent runs (on this connection) as ``(call, writes
        ended when it was sent)``. A copy the worker wrote from the ps during call n holds
        every write that had ended when n was sent; so ``since``, the first such call after
        which the writes ``closure`` must see (those ended when it was scheduled) had all
        ended, tells the worker which copies it need not pull again. Functions scheduled ahead
        of the one running (a loop that keeps several in flight) pull nothing as a rule; one
        scheduled after ``join`` pulls what was pushed since."""
        self.calls += 1
        call = self.calls
        sent.append((call, self.writes_ended()))
        since = next(n for n, ended in sent if ended >= closure.must_see)
        return [call, since]

    def run_ended(self, closure: Closure) -> None:
        """A function's run on a worker ended, however (the lock is held): what it pushed is
        on the ps, so the chief's copies of the variables are behind until the next pull."""
        self.inflight -= 1
        self.finished += 1
        self.running.pop(closure.cid, None)

    def raise_if_error(self) -> None:
        """Raise the first error kept, once (then it is cleared)."""
        with self.lock:
            error, self.error = self.error, None
        if error is not None:
            raise error

    @staticmethod
    def cancelled(closure: Closure, error: BaseException) -> CancelledError:
        return CancelledError(
            f"{closure.name} was cancelled: an earlier function failed ({error}). Schedule it again"
        )

    def fail(self, error: BaseException) -> None:
        """Keep the first error; cancel what is still queued, and what still runs (the lock
        is held)."""
        if self.error is None:
            self.error = error
        while self.queue:
            closure = self.queue.popleft()
            closure.value.settle(error=self.cancelled(closure, error))
        stop: dict[int, list[int]] = {}  # worker rank -> the closures it is to stop
        for cid, (closure, rank) in self.running.items():
            if closure.cancelled is None:
                closure.cancelled = CancelledError(
                    f"{closure.name} was cancelled while it ran on {self._describe(rank)}: "
                    f"an earlier function failed ({error}). Schedule it again"
                )
                stop.setdefault(rank, []).append(cid)
        for rank, cids in stop.items():
            threading.Thread(
                target=self._tell_to_cancel,
                args=(rank, cids),
                name=f"stratagem-cancel-{rank}",
                daemon=True,
            ).start()
        self.lock.notify_all()
