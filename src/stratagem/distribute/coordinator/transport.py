"""How the coordinator talks to its workers: one connection per worker for its functions
(``comm.messages``, proving the job's secret), a second one, made when first needed, for
cancellations, and the ``hello`` that checks a worker runs the chief's program.

``ask`` is one request and its reply: a worker that ended is a ``PeerLostError``, one that
stops answering a ``CollectiveTimeoutError`` (the operation timeout). ``tell_to_cancel`` never
raises: a worker that cannot be told has nothing left to stop.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from stratagem import shipping
from stratagem.comm.messages import Connection
from stratagem.comm.process_group import Timeouts


class WorkerLinks:
    """The coordinator's connections to the workers of ``world``; ``compression`` is the
    strategy's, said in the hello."""

    def __init__(self, world: Any, compression: Any) -> None:
        self._world = world
        self._control: dict[int, Connection] = {}  # per worker rank: where cancels are said
        self._control_lock = threading.Lock()
        program = shipping.program_file()
        root = shipping.program_root()
        hello: list[Any] = [None, None]
        if program is not None:
            hello = [program.relative_to(root).as_posix(), shipping.file_hash(program)]
        hello.append(compression)
        self._hello = hello  # said again to a worker that rejoins

    def connect(self, rank: int) -> Connection:
        """A connection to worker ``rank`` (proving the job's secret)."""
        world = self._world
        return Connection(
            world.address(rank),
            me=world.name,
            peer=world.describe(rank),
            secret=world.secret,
            timeout=Timeouts.from_env().operation,
        )

    def hello(self, rank: int, connection: Connection) -> None:
        """The coordinator's hello: raises unless the worker runs the chief's program."""
        self.ask(rank, connection, "hello", self._hello, "the coordinator's hello")

    def ask(
        self, rank: int, connection: Connection, method: str, args: list[Any], what: str
    ) -> Any:
        world = self._world
        return connection.call(
            method,
            args,
            what=what,
            silent=world.silent,
            peer_ended=lambda: world.has_ended(rank),
        )

    def tell_to_cancel(self, rank: int, cids: list[int]) -> None:
        """Tell worker ``rank`` to stop these functions (TF's cancellation of in-flight
        functions), on a connection of its own: the dispatch thread's waits for the run's
        reply. A worker that is gone, or cannot be reached, has nothing left to stop."""
        try:
            with self._control_lock:  # one connection per worker, one cancellation at a time
                connection = self._control.get(rank)
                if connection is None or connection.closed:
                    connection = self._control[rank] = self.connect(rank)
                self.ask(rank, connection, "cancel", [cids], "a cancellation")
        except Exception as e:  # the functions' values are cancelled all the same
            print(
                f"could not tell {self._world.describe(rank)} to stop the cancelled functions "
                f"{cids} ({type(e).__name__}: {e}); their outcome is not taken",
                file=sys.stderr,
            )

    def drop_control(self, rank: int) -> None:
        """Close worker ``rank``'s cancellation connection (lost: a rejoined incarnation gets
        a connection of its own)."""
        with self._control_lock:
            control = self._control.pop(rank, None)
        if control is not None:
            control.close()

    def close_control(self) -> None:
        """Close every cancellation connection (at shutdown)."""
        with self._control_lock:
            control, self._control = list(self._control.values()), {}
        for connection in control:
            connection.close()
