"""The dispatch threads: one per connected worker, each taking the next function from the
shared ``WorkQueue`` (one in flight per worker) after replaying the per-worker resources the
worker has not made, and settling the function's ``RemoteValue`` with what the worker answers.

A run that loses its worker (ended, or silent past the operation timeout) goes back to the
front of the queue, unless it was cancelled; the worker is then handed to ``lost``. Each
function's value is set once, and its metric totals added once, before the value is seen.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

from stratagem import shipping
from stratagem.comm.messages import Connection
from stratagem.distribute.coordinator.remote_values import FunctionError
from stratagem.distribute.coordinator.transport import WorkerLinks
from stratagem.distribute.coordinator.work_queue import Closure, WorkQueue
from stratagem.errors import CollectiveTimeoutError, PeerLostError


def _raised_on_worker(error: Any, headline: Callable[[str, str], str]) -> FunctionError:
    """A worker's error reply (``[type name, message, traceback text]``) as a
    ``FunctionError``: ``headline(type name, message)``, then the worker's traceback."""
    type_name, message, text = error
    return FunctionError(
        f"{headline(type_name, message)}\nThe worker's traceback:\n{text}", type_name
    )


class Dispatch:
    """The dispatch threads of ``work``'s workers; ``lost(rank, error)`` is told of a worker
    whose connection failed (its thread has ended)."""

    def __init__(
        self,
        work: WorkQueue,
        links: WorkerLinks,
        describe: Callable[[int], str],
        lost: Callable[[int, BaseException], None],
    ) -> None:
        self._work = work
        self._links = links
        self._describe = describe
        self._lost = lost
        self.threads: list[threading.Thread] = []
        self.completed = 0  # functions whose value was set (each counted once)
        self.tables_sent_by_number = 0  # runs whose worker had their table
        self.tables_sent_as_changes = 0  # runs sent as the entries that changed since its last

    def start(self, rank: int, connection: Connection) -> None:
        """Start worker ``rank``'s dispatch thread (at the start, and when it rejoins)."""
        thread = threading.Thread(target=self._dispatch, args=(rank, connection), daemon=True)
        self.threads.append(thread)
        thread.start()

    def _dispatch(self, rank: int, connection: Connection) -> None:
        work = self._work
        replayed = 0  # the per-worker resources this worker has made
        sent: collections.deque[tuple[int, int]] = collections.deque(maxlen=64)
        # The table this worker keeps (the last one it was sent).
        kept = shipping.SentTables()
        while True:
            with work.lock:
                work.lock.wait_for(
                    lambda replayed=replayed: (
                        work.closing
                        or replayed < len(work.resources)
                        or (work.queue and work.error is None)
                    )
                )
                if replayed < len(work.resources):
                    method, args, what = work.resources[replayed]
                    closure = None
                elif work.queue and work.error is None:
                    closure = work.queue.popleft()
                    work.inflight += 1
                    work.running[closure.cid] = (closure, rank)
                    calls = work.call_numbers(closure, sent)
                else:
                    return  # closing, nothing left for this worker
            if closure is None:
                if not self._make_resource(rank, connection, method, args, what):
                    return
                replayed += 1
                with work.lock:
                    work.replayed[rank] = replayed
                    work.lock.notify_all()
                continue
            if not self._run(rank, connection, closure, calls, kept):
                return

    def _make_resource(
        self, rank: int, connection: Connection, method: str, args: list[Any], what: str
    ) -> bool:
        work = self._work
        try:
            outcome = self._links.ask(rank, connection, method, args, what)
        except PeerLostError as e:
            self._lost(rank, e)
            return False
        except Exception as e:  # stuck (timed out), or it answered outside the protocol
            connection.close()
            with work.lock:
                work.fail(RuntimeError(f"{what} on {self._describe(rank)} failed: {e}"))
            self._lost(rank, e)
            return False
        if "error" in outcome:
            with work.lock:
                work.fail(
                    _raised_on_worker(
                        outcome["error"],
                        lambda t, m: f"{what} failed on {self._describe(rank)}: {t}: {m}",
                    )
                )
        return True

    def _run(
        self,
        rank: int,
        connection: Connection,
        closure: Closure,
        calls: list[int],
        kept: shipping.SentTables,
    ) -> bool:
        work = self._work
        call = [*closure.call, calls, closure.table_id]
        sending = kept.to_send(closure.call[1], closure.table_id, closure.entries)
        call[1] = sending.table
        if sending.how == "number":
            self.tables_sent_by_number += 1
        elif sending.how == "changes":
            call.append(sending.changes_to)
            self.tables_sent_as_changes += 1
        try:
            outcome = self._links.ask(rank, connection, "run", call, f"the function {closure.name}")
        except (PeerLostError, CollectiveTimeoutError) as e:
            # Ended, or stopped answering (stopped or stuck: no note for the operation
            # timeout): as TF's, another worker runs the function (unless it was cancelled).
            # A stuck worker that comes back may still push what it computed, as in TF; its
            # value is not taken (the connection is closed), and the function's value is set
            # once.
            connection.close()
            with work.lock:
                work.run_ended(closure)
                if closure.cancelled is not None:
                    closure.value.settle(error=closure.cancelled)
                else:
                    work.queue.appendleft(closure)
                work.lock.notify_all()
            self._lost(rank, e)
            return False
        except Exception as e:  # it answered outside the protocol
            connection.close()
            error = RuntimeError(f"{closure.name} on {self._describe(rank)} failed: {e}")
            with work.lock:
                work.run_ended(closure)
                closure.value.settle(error=error)
                work.fail(error)
            self._lost(rank, e)
            return False
        with work.lock:
            work.run_ended(closure)
            if closure.cancelled is not None:
                # Cancelled while it ran (an earlier function failed): whatever it ended with,
                # its value is the cancellation, and its error (the cancellation itself, as a
                # rule) is not a new one for join to raise; its metric totals are not taken.
                closure.value.settle(error=closure.cancelled)
            elif "error" in outcome:
                error = _raised_on_worker(
                    outcome["error"],
                    lambda t, m: f"{closure.name} raised {t} on {self._describe(rank)}: {m}",
                )
                closure.value.settle(error=error)
                work.fail(error)
            else:
                totals = outcome.get("totals", {})

                def merge() -> None:
                    # Once per function (a rerun's totals never count twice), and before the
                    # value is seen: a metric read after fetch() includes this function.
                    shipping.add_totals(closure.accumulators, totals)
                    self.completed += 1

                closure.value.settle(outcome["value"], merge=merge)
            # An ended run changes only what join waits for (an error, nothing in flight):
            # waking it (and every waiting dispatch thread) at each of a fit epoch's functions
            # had the chief's main thread take the GIL from the dispatch thread about to send
            # the next function (reply to next send: 360 us in fit, 75-135 in a custom loop).
            if work.error is not None or work.inflight == 0:
                work.lock.notify_all()
        return True
