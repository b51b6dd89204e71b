"""How an attempt of a job over several machines ends, agreed by every node's launcher.

With ``--max-restarts``, the connections of the nodes' meeting stay open for the attempt as
control links, node 0's launcher at the hub: every other node reports how its tasks ended (its
``Outcome``, or that its launcher was stopped), node 0 decides for the whole job and tells every
node: ``done``, ``restart`` (every node stops its tasks and the nodes meet again for the next
attempt) or ``failed``. A link that closes or falls silent is a node lost. Node 0 losing a node
is a failure like a task's (the job restarts when it may; the node rejoins at the next meeting,
else it ends with ``JoinTimeoutError``). A node losing node 0's link without its word decides
alike: with a restart left it meets node 0 again (``nodes.LostLink``: both meet when a cut link
heals, else both end with ``JoinTimeoutError``; a refused port is ``NodeLostError``), else the
job ends. One signed JSON message each way per attempt, read by a thread per link and checked
field by field, as the meeting's (``stratagem.cluster.nodes``); no torch.
"""

from __future__ import annotations

import math
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from stratagem.cluster.attempt import Outcome
from stratagem.cluster.nodes import (
    LostLink,
    MeetingSigner,
    NodeAttempt,
    NodeLostError,
    Nodes,
    StoppedWaiting,
)
from stratagem.cluster.tasks import LaunchError, plural

__all__ = ["Agreement", "Decision", "NodeLostError"]

_POLL_S = 0.05
#: TCP keepalive on the control links: a node whose machine or link went down without closing
#: its connection (a cable pulled: no FIN, no RST) is seen as lost after about
#: IDLE + INTERVAL * COUNT seconds of silence, not never; a message that cannot be delivered
#: gives up as soon (TCP_USER_TIMEOUT), not after the kernel's minutes of retransmissions.
KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTERVAL_S = 1
KEEPALIVE_COUNT = 5
_DECISIONS = ("done", "restart", "failed")


@dataclass(frozen=True)
class Decision:
    """Node 0's word on an attempt: ``kind`` (done, restart, failed), the job's exit code and
    reason, and the number of the attempt that follows a restart."""

    kind: str
    exit_code: int
    reason: str
    next_attempt: int


@dataclass(frozen=True)
class _Report:
    """A node's word on its tasks: their outcome, or that its launcher was stopped."""

    exit_code: int
    reason: str
    stopped: bool


class _Reader:
    """Reads the one message a link carries, in a thread; ``lost`` says why none came."""

    def __init__(self, conn: socket.socket, signer: MeetingSigner, source: str) -> None:
        _keep_alive(conn)
        self.message: dict | None = None
        self.lost: str | None = None
        self._closing = False
        self._thread = threading.Thread(
            target=self._read, args=(conn, signer, source), name="stratagem-control", daemon=True
        )
        self._thread.start()

    def _read(self, conn: socket.socket, signer: MeetingSigner, source: str) -> None:
        try:
            self.message = signer.read(conn, math.inf, source, stopped=lambda: self._closing)
        except StoppedWaiting:
            pass
        except LaunchError as e:
            self.lost = str(e)

    def stop(self) -> None:
        self._closing = True  # seen within the read's poll (half a second)

    def join(self) -> None:
        self._thread.join()


class Agreement:
    """The control links of one attempt (``NodeAttempt.links``) and what came over them."""

    def __init__(
        self, met: NodeAttempt, nodes: Nodes, max_restarts: int, log: Callable[[str], None]
    ) -> None:
        self.met = met
        self.nodes = nodes
        self.max_restarts = max_restarts
        self.log = log
        where = f"{nodes.master_addr}:{nodes.master_port}"
        self._readers = {
            rank: _Reader(
                conn,
                met.signer,
                f"node {rank}'s launcher"
                if nodes.node_rank == 0
                else f"node 0's launcher at {where}",
            )
            for rank, conn in met.links.items()
        }
        self._remote: Outcome | None = None  # what ``remote_failure`` gave the attempt
        #: Another node: its link to node 0 was lost without node 0's word (``settle``).
        self.lost: LostLink | None = None

    # --- during the attempt ---

    def remote_failure(self) -> Outcome | None:
        """What ends this node's attempt from elsewhere (polled by ``Job.wait``): on node 0,
        another node's failure or loss; on another node, node 0's decision or loss."""
        if self._remote is None:
            if self.nodes.node_rank == 0:
                self._remote = self._first_failure()
            else:
                self._remote = self._from_node0()
        return self._remote

    def _first_failure(self) -> Outcome | None:
        for rank in sorted(self._readers):
            reader = self._readers[rank]
            if reader.lost is not None:
                return Outcome(1, f"node {rank}'s launcher was lost ({reader.lost})")
            report = self._report(rank)
            if report is not None and report.exit_code != 0:
                return Outcome(report.exit_code, f"node {rank}: {report.reason}")
        return None

    def _from_node0(self) -> Outcome | None:
        reader = self._readers[0]
        if reader.lost is not None:
            return Outcome(1, f"node 0's launcher was lost ({reader.lost})")
        decision = self._decision()
        if decision is not None and decision.kind != "done":
            return Outcome(decision.exit_code, decision.reason)
        return None

    # --- the attempt's end ---

    def report(self, outcome: Outcome | None, signum: int | None) -> None:
        """Another node tells node 0 how its tasks ended (``signum``: its launcher was stopped);
        nothing when the attempt was ended by node 0's word or node 0 is gone. Node 0 stopped
        tells every node that the job failed."""
        if self.nodes.node_rank == 0:
            if signum is not None:
                name = signal.Signals(signum).name
                self._tell(Decision("failed", 128 + signum, f"node 0 stopped: received {name}", 0))
            return
        if outcome is not None and outcome is self._remote:
            return
        if signum is not None:
            name = signal.Signals(signum).name
            report = _Report(128 + signum, f"launcher stopped: received {name}", True)
        else:
            assert outcome is not None
            report = _Report(outcome.exit_code, outcome.reason, False)
        self.met.signer.send(
            self.met.links[0],
            {
                "attempt": self.met.attempt,
                "exit_code": report.exit_code,
                "reason": report.reason,
                "stopped": report.stopped,
            },
        )

    def settle(self, outcome: Outcome, interrupted: Callable[[], int | None]) -> Decision:
        """The job's decision on this attempt, whose own ``outcome`` this node has: node 0
        waits for every node's report (or the first failure), decides and tells every node;
        another node waits for node 0's word, or decides alike when node 0's link is lost (its
        ``lost`` then says why). Raises ``NodeLostError`` when that happens with no restart
        left."""
        if self.nodes.node_rank == 0:
            decision = self._decide(outcome, interrupted)
            self._tell(decision)
            return decision
        while True:
            decision = self._decision()
            if decision is not None:
                return decision
            lost = self._readers[0].lost
            if lost is not None:
                return self._node0_lost(lost)
            signum = interrupted()
            if signum is not None:
                name = signal.Signals(signum).name
                return Decision("failed", 128 + signum, f"stopped: received {name}", 0)
            time.sleep(_POLL_S)

    def _node0_lost(self, why: str) -> Decision:
        """Node 0's link lost without its word: decide as node 0 does on losing this node
        (a failure of the attempt), so that both sides act alike whichever is alive."""
        attempt = self.met.attempt
        where = f"{self.nodes.master_addr}:{self.nodes.master_port}"
        if attempt >= self.max_restarts:
            raise NodeLostError(
                f"node 0's launcher at {where} was lost ({why}) while {self.nodes.name} waited "
                f"for its word on attempt {attempt + 1}, with no restart left (--max-restarts "
                f"{self.max_restarts}): the job ends (node 0, if it runs, ends it too, having "
                f"lost {self.nodes.name})"
            )
        self.lost = LostLink(why, attempt)
        return Decision("restart", 1, f"node 0's launcher was lost ({why})", attempt + 1)

    def _tell(self, decision: Decision) -> None:
        for conn in self.met.links.values():
            self.met.signer.send(
                conn,
                {
                    "attempt": self.met.attempt,
                    "decision": decision.kind,
                    "exit_code": decision.exit_code,
                    "reason": decision.reason,
                    "next_attempt": decision.next_attempt,
                },
            )

    def _decide(self, outcome: Outcome, interrupted: Callable[[], int | None]) -> Decision:
        failure: Outcome | None = None
        stopped = False
        if outcome.exit_code != 0:
            failure = (
                outcome
                if outcome is self._remote
                else Outcome(outcome.exit_code, f"node 0: {outcome.reason}")
            )
        else:
            waiting_since = time.monotonic()
            while failure is None and any(self._report(r) is None for r in self._readers):
                failure = self._first_failure()
                signum = interrupted()
                if signum is not None:
                    name = signal.Signals(signum).name
                    return Decision("failed", 128 + signum, f"node 0 stopped: received {name}", 0)
                if time.monotonic() - waiting_since > 1.0 and failure is None:
                    waiting_since = math.inf  # said once
                    self.log(f"node 0 waiting for {self._waiting()} to finish")
                time.sleep(_POLL_S)
            failure = failure or self._first_failure()
        if failure is None:
            return Decision(
                "done", 0, f"every node's tasks ended well ({plural(self.nodes.nnodes, 'node')})", 0
            )
        stopped = any(
            (report := self._report(r)) is not None and report.stopped for r in self._readers
        )
        if stopped:
            return Decision("failed", failure.exit_code, failure.reason, 0)
        attempt = self.met.attempt
        if attempt >= self.max_restarts:
            restarts = plural(self.max_restarts, "restart")
            return Decision("failed", failure.exit_code, f"{failure.reason} (after {restarts})", 0)
        return Decision("restart", failure.exit_code, failure.reason, attempt + 1)

    def _waiting(self) -> str:
        return ", ".join(f"node {r}" for r in sorted(self._readers) if self._report(r) is None)

    def close(self) -> None:
        for reader in self._readers.values():
            reader.stop()
        for reader in self._readers.values():
            reader.join()
        self.met.close()

    # --- the messages, checked field by field ---

    def _report(self, rank: int) -> _Report | None:
        message = self._readers[rank].message
        if message is None:
            return None
        source = f"node {rank}'s launcher"
        fields = {"attempt": int, "exit_code": int, "reason": str, "stopped": bool}
        _check(message, fields, source)
        if message["attempt"] != self.met.attempt:
            raise LaunchError(
                f"{source} reported on attempt {message['attempt'] + 1}, expected attempt "
                f"{self.met.attempt + 1}"
            )
        return _Report(message["exit_code"], message["reason"], message["stopped"])

    def _decision(self) -> Decision | None:
        message = self._readers[0].message
        if message is None:
            return None
        source = "node 0's launcher"
        fields = {
            "attempt": int,
            "decision": str,
            "exit_code": int,
            "reason": str,
            "next_attempt": int,
        }
        _check(message, fields, source)
        if message["decision"] not in _DECISIONS or message["attempt"] != self.met.attempt:
            raise LaunchError(
                f"{source} decided {message['decision']!r} on attempt {message['attempt'] + 1}, "
                f"expected one of {list(_DECISIONS)} on attempt {self.met.attempt + 1}"
            )
        if message["decision"] == "restart" and not (
            self.met.attempt < message["next_attempt"] <= self.max_restarts
        ):
            raise LaunchError(
                f"{source} restarts as attempt {message['next_attempt'] + 1}, expected one after "
                f"attempt {self.met.attempt + 1}, within --max-restarts {self.max_restarts}"
            )
        return Decision(
            message["decision"], message["exit_code"], message["reason"], message["next_attempt"]
        )


def _check(message: dict, fields: dict[str, type], source: str) -> None:
    if set(message) != set(fields) or not all(
        type(message[key]) is kind for key, kind in fields.items()
    ):
        raise LaunchError(
            f"{source} sent {message!r}, expected the fields "
            f"{ {key: kind.__name__ for key, kind in fields.items()} }"
        )


def _keep_alive(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),  # Linux; macOS has TCP_KEEPALIVE for the idle time
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_COUNT),
        ("TCP_USER_TIMEOUT", 1000 * (KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_COUNT)),
    ):
        if hasattr(socket, option):
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
