"""Is a peer alive, and where is it? A tiny TCP server per process, asked when a collective fails.

A failed or stuck collective does not say which peer is to blame: gloo reports a reset socket
or a bare timeout. Each process therefore listens on a port of its own, published at the roll
call, and answers every connection with one line — its state and the collective it is in — then
hangs up. When an operation fails, each peer is asked directly: a refused or silent connection
is a dead or unreachable peer; an answer says what a live one is doing.

Nothing here touches the rendezvous store after start-up. c10d prints a C++ stack trace whenever
a store operation meets a closed socket, and the store dies with its host, which is exactly the
case being diagnosed.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from stratagem.cluster.address import is_loopback
from stratagem.comm.binding import bind_address, bind_hint
from stratagem.errors import RendezvousError

_MAX_ANSWER_BYTES = 4096


@dataclass(frozen=True)
class PeerState:
    """What a peer answered: ``running`` (with its position), ``ok`` or ``error`` (exiting)."""

    status: str
    position: str


class LivenessServer:
    """Answers ``<status> <position>`` to every connection, from a daemon thread."""

    def __init__(self, advertise_host: str) -> None:
        # The address peers are told is the one listened on (``comm.binding``).
        family, bind = bind_address(advertise_host, 0)
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.bind((bind, 0))
        except OSError as e:
            self._sock.close()
            raise RendezvousError(
                f"this process's liveness server cannot listen on {bind}: {e.strerror or e}"
                f"{bind_hint(advertise_host, bind)}"
            ) from None
        self._sock.listen(64)
        self.host = bind
        self.address = f"{advertise_host}:{self._sock.getsockname()[1]}"
        self.status = "running"
        self.position = "0:start"
        self._thread = threading.Thread(target=self._serve, name="stratagem-liveness", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    conn.sendall(f"{self.status} {self.position}\n".encode())
                except OSError:
                    pass

    def close(self, status: str) -> None:
        """Say how this process ends, then stop answering (peers then see it as gone)."""
        self.status = status
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        if self._thread is not threading.current_thread():
            # The accept wakes with an error at once: then no thread of ours outlives close.
            self._thread.join(timeout=5)


# What ``probe`` returns for a peer whose port accepts but which does not answer: the kernel
# completes the connection for a process that is alive but stopped (SIGSTOP) or frozen.
SILENT = "silent"
# What ``probe`` returns for a peer it cannot reach at all: nothing refuses, nothing answers.
UNREACHABLE = "unreachable"
# The status of a process that found peers gone during a collective and is ending for it; its
# position then names the ranks it found gone (``"2"``, ``"2,3"``).
LOST = "lost"
# The status of a process whose collective timed out with every peer alive: it has its report
# and is ending; its position still says where it waited.
TIMED_OUT = "timed-out"
# A position's prefix once its operation has completed: the process has started no collective
# since (it computes, or it is stuck outside collectives).
DONE = "done "


def operation_position(number: int, operation: str, *, done: bool = False) -> str:
    """What a process answers as its position: ``#12 (all_reduce of gradients)`` while in
    operation 12, ``done #12 (...)`` once it has completed."""
    return f"{DONE if done else ''}#{number} ({operation})"


def whereabouts(position: str, mine: str | None) -> str | None:
    """How a peer at ``position`` stands to this process's operation at position ``mine``: None
    when it is in the same operation (same number, same operation), else in words where it is
    (``has not reached it: ...``). ``mine`` is None when this process waits in a collective of
    the script's own, which has no number: then only where the peer was last is known."""
    if mine is None:
        return (
            f"was last in operation {position.removeprefix(DONE)} (the script's own "
            "collectives have no numbers)"
        )
    if position == mine:
        return None
    if position.startswith(DONE):
        return (
            f"has not reached it: it completed {position.removeprefix(DONE)} and has started "
            "no collective since (it is computing, or stuck outside collectives)"
        )
    if not position.startswith("#"):
        return f"has not reached it: it is at {position or 'an unknown point'}"
    if position.partition(" ")[0] == mine.partition(" ")[0]:
        # The same count of operations, another operation: the two programs diverged (one
        # skipped a collective the other ran, then called the next).
        return (
            f"has not reached it: it is in {position} instead, after as many operations (one of "
            "the two skipped a collective the other ran)"
        )
    return f"has not reached it: it is in {position} instead"


def probe(address: str, timeout: float) -> PeerState | None:
    """Ask one peer; None when it refuses (its process is gone), ``PeerState("unreachable")``
    when no answer comes back at all (its machine, or the network to it, is down: the process
    may be alive on the other side of a cut link), ``PeerState("silent")`` when it accepts the
    connection but does not answer in time (alive, but stopped or stuck).
    """
    host, _, port = address.rpartition(":")
    try:
        conn = socket.create_connection((host, int(port)), timeout=timeout)
    except ConnectionRefusedError:
        return None
    except OSError:  # a timeout, no route to the host, the network down
        return PeerState(UNREACHABLE, "")
    with conn:
        conn.settimeout(timeout)
        data = b""
        try:
            # A liveness answer is one short line; a longer one is no stratagem process.
            while not data.endswith(b"\n"):
                chunk = conn.recv(4096)
                if not chunk or len(data) + len(chunk) > _MAX_ANSWER_BYTES:
                    return None
                data += chunk
        except TimeoutError:
            return PeerState(SILENT, "")
        except OSError:
            return None
    status, _, position = data.decode(errors="replace").strip().partition(" ")
    return PeerState(status, position)


def refuses(address: str, timeout: float = 2.0) -> bool:
    """Whether nothing listens at a liveness ``address`` any more: the connection is refused,
    so the process that published it has ended. A silent or unreachable one is not ended."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def probe_all(addresses: dict[int, str], timeout: float = 1.5) -> dict[int, PeerState | None]:
    """Ask every peer at once; the answer for each rank, None for the lost ones."""
    if not addresses:
        return {}
    with ThreadPoolExecutor(max_workers=min(32, len(addresses))) as pool:
        answers = pool.map(lambda a: probe(a, timeout), addresses.values())
        return dict(zip(addresses, answers))


def first_lost(answers: dict[int, PeerState | None]) -> tuple[list[int], list[int]]:
    """Of the peers that ended, those to name as the failure, and those that ended after it.

    When one task dies, the others fail in the same collective and end too; a survivor that
    probes a little later finds several peers gone and cannot tell the first from the rest by
    its port alone. A peer that ended because it lost others says so while it exits (status
    ``LOST``, the ranks it found gone): the peers that some such witness names are the failure,
    and the witnesses, and the other ended peers no witness names, ended after it. Without any
    witness every ended peer is named, as nothing tells them apart. A peer that cannot be
    reached counts as ended here (it is lost to this process) and keeps its status to be told
    apart. Returns (first, after), each in rank order; ([], []) when no peer ended."""
    ended = {
        r for r, a in answers.items() if a is None or a.status in ("ok", "error", LOST, UNREACHABLE)
    }
    witnesses = {r for r, a in answers.items() if a is not None and a.status == LOST}
    named: set[int] = set()
    for r in witnesses:
        position = answers[r].position  # type: ignore[union-attr]
        named.update(int(x) for x in position.split(",") if x.strip().isdigit())
    first = sorted((named & ended) - witnesses)
    if not first:  # no witness, or none names a peer that ended: name every ended one
        first = sorted(ended - witnesses) or sorted(ended)
    return first, sorted(ended - set(first))


def linger(addresses: dict[int, str], seconds: float) -> None:
    """Keep answering (the caller's server is still open) while a peer waiting in a collective
    may yet time out and ask where this process waited: at most ``seconds``, and only while
    some peer answers ``running`` inside an operation (one outside collectives will not time
    out soon). Peers that time out in the same hang a moment later then name where each
    waited, instead of finding this process gone and calling it lost."""
    deadline = time.monotonic() + seconds
    waiting = dict(addresses)
    while waiting and time.monotonic() < deadline:
        # One peer at a time, in this thread: this runs at exit, when Python starts no
        # thread pool any more.
        for rank, address in list(waiting.items()):
            answer = probe(address, timeout=0.5)
            if answer is None or answer.status != "running" or answer.position.startswith(DONE):
                del waiting[rank]
        if waiting:
            time.sleep(0.1)


def advertised_host(rendezvous_host: str) -> str:
    """The address peers can reach this process at: loopback for local jobs, else the local
    address of the route to the rendezvous host (no packet is sent: a UDP connect only routes)."""
    if is_loopback(rendezvous_host):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((rendezvous_host, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()
