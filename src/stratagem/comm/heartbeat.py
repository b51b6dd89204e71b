"""Liveness of the peers, kept in the rendezvous store, read when a collective fails.

A failed or stuck collective does not say which peer is to blame (gloo reports a reset socket
or a bare timeout). Each process bumps a counter in the store every ``interval`` seconds from a
background thread, together with the number and name of the collective it is in; when an
operation fails, comparing two snapshots tells a dead peer (counter frozen, or store gone with
its host) from a live one that is merely elsewhere in the program.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class PeerState:
    beats: int  # -1: never seen
    position: str  # "<seq>:<operation>" the peer last reported
    exit_status: str | None  # "ok" / "error" once the peer has shut down


class Heartbeat:
    """Publishes this process's liveness; inspects the others' on demand."""

    def __init__(
        self,
        host: str,
        port: int,
        prefix: str,
        rank: int,
        world_size: int,
        *,
        interval: float = 0.5,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.interval = interval
        # A connection of its own: TCPStore clients are not meant to be shared between threads
        # that block, and the main thread may be blocked in a collective when we need the store.
        td = datetime.timedelta(seconds=max(5.0, 4 * interval))
        self._address = (host, port)
        self._store = dist.PrefixStore(prefix, dist.TCPStore(host, port, None, False, td))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._position = "0:start"
        self.store_lost = False
        self._thread = threading.Thread(target=self._run, name="stratagem-heartbeat", daemon=True)
        self._beat()
        self._thread.start()

    def set_position(self, position: str) -> None:
        """Record the operation this process is in (published with the next beat)."""
        self._position = position

    def _beat(self) -> None:
        with self._lock:
            self._store.add(f"hb/{self.rank}", 1)
            self._store.set(f"pos/{self.rank}", self._position)

    def reachable(self) -> bool:
        """Whether the store still listens, asked with a plain socket.

        c10d prints a C++ stack trace whenever a store operation meets a closed socket; a
        refused connection tells the same (the host is gone) without the noise.
        """
        if self.store_lost:
            return False
        try:
            with socket.create_connection(self._address, timeout=2.0):
                return True
        except OSError:
            self.store_lost = True
            return False

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                if not self.reachable():
                    return
                self._beat()
            except Exception:
                # The store lives in the rendezvous host; losing it means losing that host.
                self.store_lost = True
                return

    def snapshot(self) -> dict[int, PeerState]:
        """The current state of every peer, as the store has it."""
        out: dict[int, PeerState] = {}
        with self._lock:
            for r in range(self.world_size):
                beats = self._store.add(f"hb/{r}", 0)
                pos = self._store.get(f"pos/{r}").decode() if self._has(f"pos/{r}") else "?"
                status = self._store.get(f"exit/{r}").decode() if self._has(f"exit/{r}") else None
                out[r] = PeerState(beats, pos, status)
        return out

    def _has(self, key: str) -> bool:
        return self._store.check([key])

    def find_lost(self) -> tuple[list[int], dict[int, PeerState]]:
        """Ranks that stopped beating over ~3 intervals (or all of them: the store is gone).

        Returns (lost ranks, latest snapshot). A peer that shut down with an error counts as
        lost at once. Raises ConnectionError when the store itself cannot be reached.
        """
        if not self.reachable():
            raise ConnectionError("the rendezvous store is unreachable")
        first = self.snapshot()
        time.sleep(3 * self.interval)
        second = self.snapshot()
        lost = [
            r
            for r in range(self.world_size)
            if r != self.rank
            and (second[r].exit_status == "error" or second[r].beats == first[r].beats)
            and second[r].exit_status != "ok"
        ]
        return lost, second

    def mark_exit(self, status: str) -> None:
        """Tell the others this process is shutting down, cleanly ("ok") or not ("error")."""
        self.stop()
        if not self.reachable():
            return
        with self._lock:
            self._store.set(f"exit/{self.rank}", status)

    def wait_for_exits(self, timeout: float) -> None:
        """Wait until every other peer has shut down or stopped beating (the host's duty).

        The store lives in this process; leaving earlier would cut the others off in the middle
        of their own shutdown.
        """
        deadline = time.monotonic() + timeout
        last_beats: dict[int, tuple[int, float]] = {}
        while time.monotonic() < deadline:
            pending = []
            with self._lock:
                for r in range(self.world_size):
                    if r == self.rank or self._has(f"exit/{r}"):
                        continue
                    beats = self._store.add(f"hb/{r}", 0)
                    seen, since = last_beats.get(r, (-1, time.monotonic()))
                    if beats != seen:
                        last_beats[r] = (beats, time.monotonic())
                        pending.append(r)
                    elif time.monotonic() - since < 4 * self.interval:
                        pending.append(r)
            if not pending:
                return
            time.sleep(self.interval / 5)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * self.interval + 1)
