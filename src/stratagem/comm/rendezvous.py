"""How the processes of a job meet: the TCPStore, and a roll call that names who is missing.

torch's own rendezvous waits silently and then reports a bare timeout. Here every process
signs in under its rank with a description of the cluster it believes in, so a missing peer,
two processes claiming one rank, or two different cluster descriptions are reported by name.

A task the launcher restarted alone (a coordinator cluster's worker, ``--restart-workers``)
signs in again with a higher ``incarnation``: it takes its rank back only from an incarnation
whose process has ended (its liveness port refuses), by an atomic swap of its record, in a
store sealed with the job's secret. A second live claim of a rank is refused.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from stratagem.cluster import progress
from stratagem.cluster.address import format_address
from stratagem.cluster.tasks import INCARNATION_VARIABLE
from stratagem.comm.binding import bind_address, bind_hint
from stratagem.comm.liveness import refuses
from stratagem.comm.sealed_store import sealed
from stratagem.errors import RendezvousError

# Poll interval while waiting for peers; short enough to feel instant, long enough not to spin.
_POLL_S = 0.05
# A task waiting for its peers says so after FIRST_REPORT_S (a quick start says nothing), then at
# most every REPORT_EVERY_S, so a hand-started worker is never silent for long.
FIRST_REPORT_S = 1.0
REPORT_EVERY_S = 10.0


class _Reporter:
    """Calls ``report`` with a progress line when one is due: first after ``first_s``, then
    every ``every_s``; the line is only built when due."""

    def __init__(self, report: Callable[[str], None], first_s: float, every_s: float) -> None:
        self._report = report
        self._start = time.monotonic()
        self._next = self._start + first_s
        self._every = every_s

    def due(self, now: float) -> bool:
        return now >= self._next

    def maybe(self, line: Callable[[float], str]) -> None:
        now = time.monotonic()
        if self.due(now):
            self._report(line(now - self._start))
            self._next = now + self._every


@dataclass(frozen=True)
class Member:
    """What one process says about itself when it signs in."""

    rank: int
    world_size: int
    name: str
    cluster: str  # a canonical description of the cluster this process was given
    pid: int
    host: str
    liveness: str  # host:port of its liveness server
    incarnation: int = 1  # 2 and up: the launcher restarted this task alone (it rejoins)


def listen_socket(host: str, port: int, *, owner: str) -> socket.socket:
    """Bind the store's listening socket ourselves, so a taken port gets a clear error.

    It listens on ``host``'s own address (``comm.binding``): a local job on loopback only, a
    job on a routable host on that host's address, every interface only when asked.
    """
    try:
        family, bind_host = bind_address(host, port)
    except OSError as e:
        raise RendezvousError(
            f"{owner} cannot listen on {host}:{port}: {host!r} does not resolve ({e})"
        ) from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((bind_host, port))
        sock.listen(1024)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise RendezvousError(
                f"port {port} is already in use, so {owner} cannot host the rendezvous at "
                f"{host}:{port}; stop the process that holds it or give {owner} a free port"
            ) from None
        raise RendezvousError(
            f"{owner} cannot listen on {host}:{port} (address {bind_host}): "
            f"{e.strerror or e}{bind_hint(host, bind_host)}"
        ) from None
    return sock


def wait_for_port(
    host: str,
    port: int,
    deadline: float,
    *,
    owner: str,
    me: str,
    report: Callable[[str], None] = progress.info,
) -> None:
    """Wait until something listens at host:port, or raise naming who should be listening.

    c10d retries by itself, but prints a C++ stack trace at every retry; a plain socket probe
    keeps the log clean while the rendezvous host is still starting. While waiting, ``report``
    is told who is awaited (see ``FIRST_REPORT_S``).
    """
    reporter = _Reporter(report, FIRST_REPORT_S, REPORT_EVERY_S)
    total = deadline - time.monotonic()
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as e:
            last = e
        if time.monotonic() >= deadline:
            raise RendezvousError(
                f"{me} could not reach the rendezvous of {owner} at {host}:{port} within the "
                f"rendezvous timeout ({last}); is {owner} running, and is the address right?"
            )
        reporter.maybe(
            lambda waited: (
                f"{me} waiting for the job's processes ({waited:.0f}s of {total:.0f}s):"
                f" missing: {owner}, which hosts the rendezvous at {host}:{port}"
            )
        )
        time.sleep(_POLL_S * 4)


def open_store(
    host: str,
    port: int,
    *,
    is_server: bool,
    timeout_s: float,
    owner: str,
    me: str,
    secret: bytes | None,
) -> dist.Store:
    """Host (``is_server``) or join the job's TCPStore at host:port, sealed with the job's
    ``secret`` (``comm.sealed_store``; None: a job the user runs insecure)."""
    td = datetime.timedelta(seconds=timeout_s)
    if is_server:
        sock = listen_socket(host, port, owner=owner)
        # TCPStore takes over the socket; keep our object from closing it when collected.
        fd = sock.detach()
        base = dist.TCPStore(
            host, port, None, True, td, wait_for_workers=False, master_listen_fd=fd
        )
    else:
        wait_for_port(host, port, time.monotonic() + timeout_s, owner=owner, me=me)
        base = dist.TCPStore(host, port, None, False, td)
    return sealed(base, secret, where=f"{owner} ({format_address(host, port)})")


def _encode(m: Member) -> str:
    return json.dumps(m.__dict__, sort_keys=True)


# The fields of a sign-in and their types: a record is JSON of exactly these, nothing else.
_MEMBER_FIELDS: dict[str, type] = {
    f.name: int if f.type == "int" else str for f in dataclasses.fields(Member)
}
_MAX_RECORD_BYTES = 64 << 10


def _decode(raw: bytes, *, key: str, me: str) -> Member:
    """A peer's sign-in record, or a ``RendezvousError`` saying what is wrong with it."""

    def refuse(why: str) -> RendezvousError:
        return RendezvousError(
            f"{me} found a sign-in record under {key!r} that is not one: {why}. Every process "
            "of a job must run the same stratagem; something else wrote into the rendezvous"
        )

    if len(raw) > _MAX_RECORD_BYTES:
        raise refuse(f"it is {len(raw)} bytes, more than {_MAX_RECORD_BYTES}")
    try:
        data = json.loads(bytes(raw).decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise refuse(f"it is not JSON ({e})") from None
    if not isinstance(data, dict) or set(data) != set(_MEMBER_FIELDS):
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise refuse(f"it has {got}, expected the fields {sorted(_MEMBER_FIELDS)}")
    for name, kind in _MEMBER_FIELDS.items():
        if type(data[name]) is not kind:
            raise refuse(f"{name} is {data[name]!r}, expected a {kind.__name__}")
    return Member(**data)


def decode_member(raw: bytes, *, key: str, me: str) -> Member:
    """A sign-in record read from the rendezvous under ``key``, checked as the roll call does."""
    return _decode(raw, key=key, me=me)


def roll_call(
    store: dist.Store,
    me: Member,
    *,
    timeout_s: float,
    peer_name: Callable[[int], str],
    report: Callable[[str], None] = progress.info,
    first_report_s: float = FIRST_REPORT_S,
    report_every_s: float = REPORT_EVERY_S,
    ended: Callable[[str], bool] = refuses,
) -> list[Member]:
    """Sign in and wait for every rank; name the missing, the duplicated and the mismatched.

    Returns the members in rank order. Mismatches are reported as soon as both sides have
    signed in, not at the end of the timeout. While some are missing, ``report`` gets a line
    naming who has arrived and who is missing, after ``first_report_s`` and then at most every
    ``report_every_s``. A restarted task (``me.incarnation`` > 1) takes its rank back first
    (``reclaim``); ``ended(address)`` says whether a liveness address refuses (its process is
    gone).
    """
    if me.incarnation > 1:
        reclaim(store, me, ended=ended)
    else:
        claims = store.add(f"claim/{me.rank}", 1)
        if claims > 1:
            raise RendezvousError(
                f"two processes claim {me.name} (rank {me.rank} of {me.world_size}); "
                f"this one is pid {me.pid} on {me.host}: give each task its own index (a "
                "coordinator's worker restarted by hand after its process ended says so with "
                f"{INCARNATION_VARIABLE}=2, 3, ...)"
            )
        store.set(f"member/{me.rank}", _encode(me))
    deadline = time.monotonic() + timeout_s
    reporter = _Reporter(report, first_report_s, report_every_s)
    seen: dict[int, Member] = {me.rank: me}
    keys = [f"member/{rank}" for rank in range(me.world_size)]
    # Asking after each rank is N round trips per poll, N² over a job's processes: a poll asks
    # once whether everyone has signed in; rank by rank only when a progress line is due (from
    # FIRST_REPORT_S on; that also catches a mismatch whose world never completes).
    while True:
        if store.check(keys):
            unseen = [r for r in range(me.world_size) if r not in seen]
            for rank, raw in zip(unseen, store.multi_get([keys[r] for r in unseen])):
                other = _decode(raw, key=keys[rank], me=me.name)
                _check_agreement(me, other)
                seen[rank] = other
            _check_bigger_world(store, me)
            return [seen[r] for r in range(me.world_size)]
        if reporter.due(time.monotonic()):
            for rank in range(me.world_size):
                if rank in seen or not store.check([keys[rank]]):
                    continue
                other = _decode(store.get(keys[rank]), key=keys[rank], me=me.name)
                _check_agreement(me, other)
                seen[rank] = other
            _check_bigger_world(store, me)
        if time.monotonic() >= deadline:
            missing = [peer_name(r) for r in range(me.world_size) if r not in seen]
            raise RendezvousError(
                f"{me.name} waited {timeout_s:g}s for the job's other processes; "
                f"missing: {', '.join(missing)} ({len(seen)} of {me.world_size} arrived). "
                "Start every task, or raise the timeout with STRATAGEM_RENDEZVOUS_TIMEOUT."
            )
        reporter.maybe(lambda waited: _progress_line(me, seen, waited, timeout_s, peer_name))
        time.sleep(_POLL_S)


def _check_bigger_world(store: dist.Store, me: Member) -> None:
    """A member with a bigger world than ours signs in under a rank we never poll."""
    key = f"member/{me.world_size}"
    if store.check([key]):
        _check_agreement(me, _decode(store.get(key), key=key, me=me.name))


def reclaim(store: dist.Store, me: Member, *, ended: Callable[[str], bool] = refuses) -> Member:
    """A restarted task takes its rank back: the earlier incarnation's record, replaced.

    Refused (``RendezvousError``) when no earlier incarnation signed in (a restart joins a
    running job only), when the record already holds this incarnation or a later one (two
    restarts of one task), when the earlier process still answers at its liveness address (a
    duplicate live claim), or when another process swapped the record first. The swap is one
    ``compare_set``: of two racing restarts, one wins. In a job with a secret the store is
    sealed, so only a process holding the secret can read the record or write one that others
    accept. Returns the earlier incarnation's record.
    """
    key = f"member/{me.rank}"
    what = f"{me.name} (pid {me.pid} on {me.host}, restarted as incarnation {me.incarnation})"
    if not store.check([key]):
        raise RendezvousError(
            f"{what} finds no earlier incarnation of rank {me.rank} in the rendezvous: a task "
            "restarted alone rejoins a running job, whose other tasks are still there"
        )
    raw = bytes(store.get(key))
    previous = _decode(raw, key=key, me=me.name)
    _check_agreement(me, previous)
    if previous.incarnation >= me.incarnation:
        raise RendezvousError(
            f"two processes claim {me.name} as incarnation {me.incarnation}: {what}, and "
            f"incarnation {previous.incarnation} (pid {previous.pid} on {previous.host}) "
            "signed in already; restart a task once"
        )
    if not ended(previous.liveness):
        raise RendezvousError(
            f"{what} claims rank {me.rank}, but its incarnation {previous.incarnation} (pid "
            f"{previous.pid} on {previous.host}) still answers at {previous.liveness}: a task "
            "is restarted only after its process ended"
        )
    mine = _encode(me).encode("utf-8")
    if bytes(store.compare_set(key, raw, mine)) != mine:
        raise RendezvousError(
            f"{what} lost the race for rank {me.rank}: another process re-claimed it first"
        )
    return previous


def _progress_line(
    me: Member,
    seen: dict[int, Member],
    waited: float,
    timeout_s: float,
    peer_name: Callable[[int], str],
) -> str:
    """``worker 0 (h:1) waiting for the job's processes (10s of 60s): 1 of 2 arrived: ...``."""
    arrived = "; ".join(f"{peer_name(r)} pid {seen[r].pid} on {seen[r].host}" for r in sorted(seen))
    missing = ", ".join(peer_name(r) for r in range(me.world_size) if r not in seen)
    return (
        f"{me.name} waiting for the job's processes ({waited:.0f}s of {timeout_s:g}s): "
        f"{len(seen)} of {me.world_size} arrived: {arrived}; missing: {missing}"
    )


def _check_agreement(me: Member, other: Member) -> None:
    if other.world_size != me.world_size:
        raise RendezvousError(
            f"world-size mismatch: {me.name} was started for {me.world_size} "
            f"process{'' if me.world_size == 1 else 'es'} but "
            f"{other.name} (pid {other.pid} on {other.host}) for {other.world_size}; "
            "every task must be given the same cluster"
        )
    if other.cluster != me.cluster:
        raise RendezvousError(
            f"cluster mismatch: {me.name} was given {me.cluster} but {other.name} "
            f"(pid {other.pid} on {other.host}) was given {other.cluster}; "
            "every task must be given the same cluster"
        )
