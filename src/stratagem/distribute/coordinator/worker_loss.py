"""A worker lost, and its next incarnation rejoining: the coordinator's side of
``stratagem run --restart-workers``.

``lost(rank, error)`` drops the worker from ``WorkQueue.workers`` (the others take its work)
and watches the rendezvous for a newer incarnation of it (``comm.rendezvous.reclaim``); one
that signs in is connected to, greeted, and given a dispatch thread (``start``) that replays
the per-worker resources from the start of the log before its first function. Every worker
lost is an error at once without restarts, else once none rejoined within the rendezvous
timeout.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from stratagem.cluster.tasks import restart_workers_of
from stratagem.comm.messages import Connection
from stratagem.comm.process_group import Timeouts
from stratagem.distribute.coordinator.transport import WorkerLinks
from stratagem.distribute.coordinator.work_queue import WorkQueue
from stratagem.errors import PeerLostError

# How often the coordinator looks for a lost worker's next incarnation (a store read and a
# liveness probe, both on this machine's chief: cheap).
_REJOIN_POLL_S = 0.25


class WorkerLoss:
    """The workers of ``world`` as they are lost and rejoin; ``start(rank, connection)``
    starts a rejoined worker's dispatch thread."""

    def __init__(
        self,
        work: WorkQueue,
        links: WorkerLinks,
        world: Any,
        start: Callable[[int, Connection], None],
    ) -> None:
        self._work = work
        self._links = links
        self._world = world
        self._start = start
        self._incarnations = dict(world.incarnations)  # of the workers connected to
        # The launcher restarts lost workers (--restart-workers): losing all is not the end.
        self._expect_rejoin = restart_workers_of(os.environ) > 0
        self._all_lost_at: float | None = None

    def lost(self, rank: int, error: BaseException) -> None:
        """Worker ``rank``'s connection failed with ``error``: the others take its work, and
        a newer incarnation of it may rejoin."""
        work = self._work
        self._links.drop_control(rank)  # a rejoined incarnation gets a connection of its own
        with work.lock:
            work.workers = [(r, c) for r, c in work.workers if r != rank]
            if not work.workers and not work.closing:
                if self._expect_rejoin:
                    self._all_lost_at = time.monotonic()
                else:
                    work.fail(RuntimeError(f"every worker was lost; the last: {error}"))
            work.lock.notify_all()
            if work.closing:
                return
            waiting = self._all_lost_at is not None and not work.workers
        who = self._world.describe(rank)
        if waiting:
            patience = Timeouts.from_env().rendezvous
            print(
                f"{error}; every worker is lost: waiting up to {patience:g} s for a restarted one "
                "to rejoin (--restart-workers; STRATAGEM_RENDEZVOUS_TIMEOUT)",
                file=sys.stderr,
            )
        elif self._expect_rejoin:
            print(f"{error}; the other workers take its work until {who} rejoins", file=sys.stderr)
        else:  # a worker restarted by hand (STRATAGEM_TASK_INCARNATION) may still rejoin
            print(f"{error}; the other workers take its work", file=sys.stderr)
        threading.Thread(
            target=self._await_rejoin,
            args=(rank,),
            name=f"stratagem-rejoin-{rank}",
            daemon=True,
        ).start()

    def _await_rejoin(self, rank: int) -> None:
        """Wait for a newer incarnation of lost worker ``rank`` (restarted by the launcher);
        connect to it, and give it a dispatch thread that replays the per-worker resources
        from the start of the log before its first function. Ends at shutdown."""
        work, world = self._work, self._world
        known = self._incarnations.get(rank, 1)
        while True:
            with work.lock:
                if work.lock.wait_for(lambda: work.closing, timeout=_REJOIN_POLL_S):
                    return
                self._give_up_when_none_rejoins()
            # ``state`` looks the rank up again once its known process has ended.
            if world.state(rank) != "alive" or world.incarnations[rank] <= known:
                continue
            incarnation = world.incarnations[rank]
            try:
                connection = self._links.connect(rank)
            except PeerLostError:
                known = incarnation  # it ended again before we met: wait for the next one
                continue
            try:
                self._links.hello(rank, connection)
            except PeerLostError:
                connection.close()
                known = incarnation
                continue
            except Exception as e:  # another program, or it answered outside the protocol
                connection.close()
                with work.lock:
                    work.fail(
                        RuntimeError(
                            f"{world.describe(rank)} rejoined (incarnation {incarnation}) but "
                            f"cannot serve this coordinator: {e}"
                        )
                    )
                return
            with work.lock:
                if work.closing:
                    connection.close()
                    return
                self._incarnations[rank] = incarnation
                work.replayed[rank] = 0
                self._all_lost_at = None
                work.workers.append((rank, connection))
                self._start(rank, connection)
                resources = len(work.resources)
                work.lock.notify_all()
            print(
                f"{world.describe(rank)} restarted (incarnation {incarnation}); rejoined the "
                f"coordinator (it remakes {resources} per-worker resources, then takes work)",
                file=sys.stderr,
                flush=True,
            )
            return

    def _give_up_when_none_rejoins(self) -> None:
        """Every worker lost, none back within the rendezvous timeout: fail what is queued, as
        without restarts (the lock is held)."""
        patience = Timeouts.from_env().rendezvous
        lost_at = self._all_lost_at
        if lost_at is None or self._work.workers or time.monotonic() - lost_at <= patience:
            return
        self._all_lost_at = None
        self._work.fail(
            RuntimeError(
                f"every worker was lost and none rejoined within {patience:g} s "
                "(STRATAGEM_RENDEZVOUS_TIMEOUT): the launcher's --restart-workers ran out, or "
                "the restarted workers could not start"
            )
        )
