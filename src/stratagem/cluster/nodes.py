"""A job over several machines from one command: ``stratagem run --nnodes N --node-rank R``.

The user runs the same command on every machine. Every launcher computes the same placement of
the job's tasks from the command (``Placement``): its own ``-n`` workers, the ps tasks round-robin
over the nodes (ps j on node j mod N, or on the ``--ps-nodes`` listed), the chief and the
evaluator on node 0 (or ``--chief-node``, ``--evaluator-node``). Each node's launcher picks free
ports for its own tasks, then the launchers meet at ``--master-addr:--master-port``, where node
0's launcher listens: each node sends its address, its ports by role and its role options; node
0 checks that every node was given the same role options and answers every node with all the
entries, from which every launcher builds the same cluster ({chief, worker, ps, evaluator}
addresses; node R's workers follow those of nodes 0..R-1) and the TF_CONFIG of its own tasks.
The meeting is plain JSON lines over TCP, size-limited and checked field by field (nothing is
unpickled), so the launcher still imports no torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import math
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stratagem.cluster.job_secret import (
    INSECURE_VARIABLE,
    SECRET_FILE_VARIABLE,
    SECRET_VARIABLE,
    given_secret,
    insecure_requested,
    key_for,
)
from stratagem.cluster.tasks import (
    TASK_TYPES,
    LaunchError,
    Task,
    build_tf_configs,
    free_ports,
    listen_address,
    plural,
    task_env,
)

#: Where node 0's launcher listens when no --master-port is given (torchrun's default too).
DEFAULT_MASTER_PORT = 29500
#: How long launchers wait for each other: machines of a job are often started minutes apart
#: (``stratagem run --join-timeout``; torchrun's ``--rdzv-conf join_timeout``).
DEFAULT_TIMEOUT_S = 300.0
#: The launcher's exit code when the nodes did not all meet in time: GNU ``timeout``'s, apart
#: from a usage error's 2, so that a script or scheduler can tell "start later" from "wrong".
JOIN_TIMEOUT_EXIT_CODE = 124


class JoinTimeoutError(LaunchError):
    """The nodes of a job did not all meet within ``--join-timeout``."""


class NodeLostError(LaunchError):
    """Node 0's launcher, which holds the meeting and decides restarts, was lost mid-job."""


class LinkLostError(LaunchError):
    """A launcher's connection closed or failed before its message came."""


@dataclass(frozen=True)
class LostLink:
    """A node other than 0 lost its control link to node 0's launcher in ``attempt`` without
    node 0's word (``why``): it meets node 0 again, whose port refusing it is proof that node
    0's launcher is gone (it listens for the whole job), while no answer is a cut link."""

    why: str
    attempt: int


_MAX_MESSAGE_BYTES = 64 << 10
_REPORT_EVERY_S = 10.0


@dataclass(frozen=True)
class Nodes:
    """This launcher's place in a job of ``nnodes`` machines."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int = DEFAULT_MASTER_PORT
    timeout_s: float = DEFAULT_TIMEOUT_S
    #: Where the job's tasks other than workers go (the same on every node): the nodes that take
    #: the ps tasks in turn (empty: every node, 0..N-1), the chief's node, the evaluator's node.
    ps_nodes: tuple[int, ...] = ()
    chief_node: int = 0
    evaluator_node: int = 0

    def check(self) -> None:
        """Raise ``LaunchError`` for values no job can run with."""
        if self.nnodes < 1:
            raise LaunchError(f"--nnodes must be at least 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise LaunchError(
                f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes}; "
                f"expected 0..{self.nnodes - 1}"
            )
        if not self.master_addr or any(c.isspace() for c in self.master_addr):
            raise LaunchError(
                f"--master-addr must be node 0's host name or IP address, got {self.master_addr!r}"
            )
        if not 1 <= self.master_port <= 65535:
            raise LaunchError(f"--master-port must be 1..65535, got {self.master_port}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise LaunchError(
                f"--join-timeout must be a number of seconds above 0, got {self.timeout_s}"
            )
        last = self.nnodes - 1
        for flag, rank in (
            ("--chief-node", self.chief_node),
            ("--evaluator-node", self.evaluator_node),
        ):
            if not 0 <= rank <= last:
                raise LaunchError(
                    f"{flag} {rank} is out of range for --nnodes {self.nnodes}; expected 0..{last}"
                )
        bad = [r for r in self.ps_nodes if not 0 <= r <= last]
        if bad:
            raise LaunchError(
                f"--ps-nodes {_ranks(self.ps_nodes)} names node {bad[0]}, out of range for "
                f"--nnodes {self.nnodes}; expected node ranks 0..{last}"
            )
        if len(set(self.ps_nodes)) != len(self.ps_nodes):
            raise LaunchError(
                f"--ps-nodes {_ranks(self.ps_nodes)} names a node twice; expected each node once"
            )

    @property
    def name(self) -> str:
        return f"node {self.node_rank} of {self.nnodes}"


def address_towards(master_addr: str) -> str:
    """This machine's address on the route to ``master_addr`` (no packet is sent: a UDP
    connect only routes); ``localhost`` when node 0 is this machine's loopback."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master_addr, 9))
            address = probe.getsockname()[0]
    except OSError:
        return socket.gethostname()
    return "localhost" if address.startswith("127.") else address


@dataclass(frozen=True)
class Placement:
    """Where the job's tasks go, computed alike by every node from the role options that every
    node is given (and checks at the meeting): ``ps`` tasks in all, placed in turn on
    ``nodes.ps_nodes`` (default every node: ps j on node j mod N); a ``chief`` on
    ``nodes.chief_node`` and an ``evaluator`` on ``nodes.evaluator_node`` (default node 0).
    Workers are each node's own ``-n``."""

    nodes: Nodes
    ps: int = 0
    chief: bool = False
    evaluator: bool = False

    def options(self) -> dict[str, Any]:
        """The role options as sent at the meeting, by flag: every node must hold the same."""
        n = self.nodes
        return {
            "--ps": self.ps,
            "--ps-nodes": list(n.ps_nodes),
            "--chief": self.chief,
            "--chief-node": n.chief_node,
            "--evaluator": self.evaluator,
            "--evaluator-node": n.evaluator_node,
        }

    @property
    def ps_nodes(self) -> tuple[int, ...]:
        return self.nodes.ps_nodes or tuple(range(self.nodes.nnodes))

    def ps_node(self, index: int) -> int:
        """The node of ps ``index``."""
        return self.ps_nodes[index % len(self.ps_nodes)]

    def counts_on(self, rank: int, workers: int) -> dict[str, int]:
        """How many tasks of each type node ``rank`` runs, given its ``workers``."""
        n = self.nodes
        return {
            "chief": int(self.chief and n.chief_node == rank),
            "worker": workers,
            "ps": sum(1 for j in range(self.ps) if self.ps_node(j) == rank),
            "evaluator": int(self.evaluator and n.evaluator_node == rank),
        }

    def cluster(self, everyone: list[dict]) -> dict[str, list[tuple[int, str]]]:
        """The whole job's tasks by type, each as (node rank, address), in TF_CONFIG order."""
        ports = {e["node_rank"]: {t: iter(e["ports"][t]) for t in TASK_TYPES} for e in everyone}
        hosts = {e["node_rank"]: e["host"] for e in everyone}

        def take(rank: int, job: str) -> tuple[int, str]:
            return rank, f"{hosts[rank]}:{next(ports[rank][job])}"

        n = self.nodes
        return {
            "chief": [take(n.chief_node, "chief")] if self.chief else [],
            "worker": [
                take(e["node_rank"], "worker") for e in everyone for _ in e["ports"]["worker"]
            ],
            "ps": [take(self.ps_node(j), "ps") for j in range(self.ps)],
            "evaluator": [take(n.evaluator_node, "evaluator")] if self.evaluator else [],
        }


@dataclass
class NodeAttempt:
    """What one meeting of the nodes gave this node: the attempt's number (node 0's: a node
    whose launcher was started again learns it here), its tasks, and, for a job that may be
    restarted, the links the launchers keep open to agree on the attempt's end (node 0: one per
    other node; another node: its link to node 0)."""

    attempt: int
    tasks: list[Task]
    links: dict[int, socket.socket]
    signer: MeetingSigner

    def close(self) -> None:
        for conn in self.links.values():
            conn.close()
        self.links.clear()


def meet_nodes(
    nodes: Nodes,
    workers: int,
    *,
    host: str,
    restart: int,
    base_env: Mapping[str, str],
    omp_threads: int | None,
    log: Callable[[str], None],
    stopped: Callable[[], bool] = lambda: False,
    ps: int = 0,
    chief: bool = False,
    evaluator: bool = False,
    max_restarts: int = 0,
    server: socket.socket | None = None,
    lost: LostLink | None = None,
) -> NodeAttempt | None:
    """This node's tasks (its ``workers``, and the ps, chief and evaluator tasks ``Placement``
    puts on it), with the TF_CONFIG of the whole job; None when ``stopped()`` turned true while
    the nodes met (the launcher got a signal). For attempt ``restart`` of a job restarted up to
    ``max_restarts`` times (every node must be given the same): with restarts, the meeting's
    connections stay open as the attempt's control links (``stratagem.cluster.agreement``),
    and node 0's attempt number is everyone's. Node 0 meets on ``server`` when given (its
    ``meeting_place``, open for the whole job), else on a port of its own for this meeting;
    another node that ``lost`` its link to node 0 meets it again (``LostLink``)."""
    # Every node's tasks must hold one secret, which only the user can give them all (each
    # launcher alone would make its own); it also signs the launchers' meeting.
    secret = given_secret(base_env)
    if secret is None and not insecure_requested(base_env):
        raise LaunchError(
            f"a job over several machines needs one secret for all its nodes: set "
            f"{SECRET_VARIABLE} (the same value for every node's `stratagem run`; "
            "`python -c 'import secrets; print(secrets.token_hex(32))'` makes one) or "
            f"{SECRET_FILE_VARIABLE}, or {INSECURE_VARIABLE}=1 to let anyone who can reach "
            "the job's ports join it"
        )
    placement = Placement(nodes, ps=ps, chief=chief, evaluator=evaluator)
    counts = placement.counts_on(nodes.node_rank, workers)
    if not any(counts.values()):
        raise LaunchError(
            f"{nodes.name} would run no task: -n 0 and none of the job's ps, chief or evaluator "
            f"is placed on it (--ps-nodes, --chief-node, --evaluator-node); give it workers "
            "or leave it out of the job"
        )
    free = iter(free_ports(sum(counts.values()), listen_address(host)))
    ports = {job: [next(free) for _ in range(counts[job])] for job in TASK_TYPES}
    mine = {
        "node_rank": nodes.node_rank,
        "nnodes": nodes.nnodes,
        "host": host,
        "ports": ports,
        "roles": _options(placement, max_restarts),
    }
    meeting = MeetingSigner(secret)
    links: dict[int, socket.socket] = {}
    try:
        if nodes.node_rank == 0:
            attempt = restart
            with contextlib.ExitStack() as own:
                if server is None:
                    server = own.enter_context(meeting_place(nodes))
                everyone = _host_meeting(
                    nodes, mine, log, stopped, meeting, placement, restart, max_restarts, links,
                    server,
                )  # fmt: skip
        else:
            everyone, attempt = _join_meeting(
                nodes, mine, log, stopped, meeting, placement, max_restarts, links, lost
            )
    except StoppedWaiting:
        return None
    try:
        tasks = _node_tasks(nodes, placement, everyone, base_env, attempt, omp_threads)
    except BaseException:
        for conn in links.values():
            conn.close()
        raise
    return NodeAttempt(attempt, tasks, links, meeting)


def _options(placement: Placement, max_restarts: int) -> dict[str, Any]:
    """The options every node must be given alike, as sent at the meeting."""
    return {**placement.options(), "--max-restarts": max_restarts}


def _node_tasks(
    nodes: Nodes,
    placement: Placement,
    everyone: list[dict],
    base_env: Mapping[str, str],
    restart: int,
    omp_threads: int | None,
) -> list[Task]:
    cluster = placement.cluster(everyone)
    if not cluster["worker"] and not cluster["chief"]:
        raise LaunchError(
            "the job has no worker and no chief: every node was started with -n 0; give some "
            "node workers (-n) or add --chief"
        )
    configs = build_tf_configs({job: [a for _, a in tasks] for job, tasks in cluster.items()})
    return [
        Task(job, i, address, task_env(base_env, configs[job, i], restart, omp_threads))
        for job in TASK_TYPES
        for i, (rank, address) in enumerate(cluster[job])
        if rank == nodes.node_rank
    ]


# --- the meeting -------------------------------------------------------------------------------


class StoppedWaiting(Exception):
    """The launcher was told to stop while the nodes met."""


class MeetingSigner:
    """The launchers' messages, signed with the job's secret (HMAC-SHA256 over the JSON) when
    there is one: a launcher without it cannot join the job or change what the others hear."""

    def __init__(self, secret: bytes | None) -> None:
        self._key = None if secret is None else key_for(secret, "node-meeting")

    def _proof(self, body: str) -> str:
        assert self._key is not None
        return hmac.new(self._key, body.encode("utf-8"), hashlib.sha256).hexdigest()

    def send(self, conn: socket.socket, message: dict) -> None:
        body = json.dumps(message, sort_keys=True)
        wire = {"body": body, "proof": self._proof(body)} if self._key is not None else message
        _send(conn, wire)

    def read(self, conn: socket.socket, deadline: float, source: str, **kw: Any) -> dict:
        wire = _read_message(conn, deadline, source, **kw)
        if self._key is None:
            return wire
        body, proof = wire.get("body"), wire.get("proof")
        if not (isinstance(body, str) and isinstance(proof, str)) or not hmac.compare_digest(
            proof, self._proof(body)
        ):
            raise LaunchError(
                f"{source} sent a message that fails the job secret's check: every node's "
                f"`stratagem run` needs the same {SECRET_VARIABLE}"
            )
        return _read_message_body(body, source)


@contextlib.contextmanager
def meeting_place(nodes: Nodes) -> Iterator[socket.socket]:
    """Node 0's listening socket at ``--master-addr:--master-port``, closed on leaving. A job
    that may restart keeps it open from its first meeting to its end, so that a node that
    comes back finds it there: connections made between meetings wait in its backlog."""
    address = listen_address(nodes.master_addr)
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        server.bind((address, nodes.master_port))
        server.listen(max(nodes.nnodes, 8))
    except OSError as e:
        server.close()
        raise LaunchError(
            f"node 0 cannot listen on --master-addr {nodes.master_addr}:{nodes.master_port} "
            f"({e.strerror or e}); give a free --master-port"
        ) from None
    try:
        yield server
    finally:
        server.close()


def _host_meeting(
    nodes: Nodes,
    mine: dict,
    log: Callable[[str], None],
    stopped: Callable[[], bool],
    meeting: MeetingSigner,
    placement: Placement,
    attempt: int,
    max_restarts: int,
    links: dict[int, socket.socket],
    server: socket.socket,
) -> list[dict]:
    """Node 0: collect every node's entry on ``server``, answer each with all of them and the
    attempt's number (or an error). With restarts, each node's connection is kept in ``links``
    (by node rank) once answered; without, it is closed."""
    entries: dict[int, dict] = {0: mine}
    peers: dict[int, socket.socket] = {}
    deadline = time.monotonic() + nodes.timeout_s
    if nodes.nnodes > 1:
        log(
            f"node 0 waiting up to {nodes.timeout_s:g} s (--join-timeout) at "
            f"{nodes.master_addr}:{nodes.master_port} for {plural(nodes.nnodes - 1, 'other node')}"
        )
    next_report = time.monotonic() + 1.0
    try:
        server.settimeout(0.2)
        while len(entries) < nodes.nnodes:
            if stopped():
                raise StoppedWaiting
            now = time.monotonic()
            if now >= deadline:
                error = (
                    f"node 0 waited {nodes.timeout_s:g} s (--join-timeout) at {nodes.master_addr}:"
                    f"{nodes.master_port} for the other nodes{_which(attempt)}; missing: "
                    f"{_missing(entries, nodes.nnodes)}. Run the same command with each "
                    "--node-rank on every machine"
                )
                # The nodes that came hear it now, not at their own (later) deadline.
                for conn in peers.values():
                    meeting.send(conn, {"error": error, "join_timeout": True})
                raise JoinTimeoutError(error)
            if now >= next_report:
                log(_progress(entries, nodes.nnodes, now - deadline + nodes.timeout_s))
                next_report = now + _REPORT_EVERY_S
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            try:
                entry = _read_entry(conn, nodes, deadline, meeting, placement, max_restarts)
            except LinkLostError as e:
                # A launcher that gave up before this meeting (its connection waited in the
                # backlog): the node, if it runs, connects again.
                log(f"node 0 set aside a connection that ended before its entry came ({e})")
                conn.close()
                continue
            except LaunchError as e:
                meeting.send(conn, {"error": str(e)})
                conn.close()
                raise
            rank = entry["node_rank"]
            if rank in entries:
                error = (
                    f"two launchers claim node {rank} (the second from {entry['host']}); "
                    "give each machine its own --node-rank"
                )
                meeting.send(conn, {"error": error})
                conn.close()
                raise LaunchError(error)
            entries[rank] = entry
            peers[rank] = conn
        everyone = [entries[r] for r in range(nodes.nnodes)]
        for conn in peers.values():
            meeting.send(conn, {"nodes": everyone, "attempt": attempt})
        log(f"{_all_nodes(nodes.nnodes)} arrived{_which(attempt)}: {_names(entries)}")
        if max_restarts:
            links.update(peers)
            peers = {}
        return everyone
    finally:
        for conn in peers.values():
            conn.close()


def _join_meeting(
    nodes: Nodes,
    mine: dict,
    log: Callable[[str], None],
    stopped: Callable[[], bool],
    meeting: MeetingSigner,
    placement: Placement,
    max_restarts: int,
    links: dict[int, socket.socket],
    lost: LostLink | None = None,
) -> tuple[list[dict], int]:
    """Node R > 0: send our entry to node 0 (retrying until it listens), read the job and the
    attempt's number. With restarts, the connection is kept in ``links`` (as node 0's). After a
    ``lost`` link, node 0's port refusing us ends the job (``NodeLostError``); no answer until
    the join timeout is the link still cut (``JoinTimeoutError``, as node 0's own)."""
    deadline = time.monotonic() + nodes.timeout_s
    next_report = time.monotonic() + 1.0
    where = f"{nodes.master_addr}:{nodes.master_port}"
    if lost is None:
        log(
            f"{nodes.name} waiting up to {nodes.timeout_s:g} s (--join-timeout) for node 0's "
            f"launcher at {where} and the other nodes"
        )
    else:
        log(
            f"{nodes.name} lost its link to node 0's launcher at {where} without its word "
            f"({lost.why}): meeting it again, up to {nodes.timeout_s:g} s (--join-timeout), "
            "as node 0 meets every node again when it loses one"
        )
    while True:
        try:
            conn = socket.create_connection((nodes.master_addr, nodes.master_port), timeout=1.0)
            break
        except OSError as e:
            if stopped():
                raise StoppedWaiting from None
            if lost is not None and isinstance(e, ConnectionRefusedError):
                # Node 0's machine answered, and its launcher listens for the whole job:
                # the launcher is gone, not the link.
                raise NodeLostError(
                    f"node 0's launcher at {where} was lost ({lost.why}) while {nodes.name} "
                    f"waited for its word on attempt {lost.attempt + 1}; a job whose node 0 is "
                    f"gone cannot restart (node 0 holds the meeting, and its port now refuses "
                    f"{nodes.name}: {e}): start the job again on every node"
                ) from None
            now = time.monotonic()
            if now >= deadline:
                if lost is not None:
                    raise JoinTimeoutError(
                        f"{nodes.name} lost its link to node 0's launcher at {where} on attempt "
                        f"{lost.attempt + 1} ({lost.why}) and could not reach it again within "
                        f"{nodes.timeout_s:g} s (--join-timeout) ({e}): the network between "
                        "them is cut, or node 0's machine is down; node 0, if it runs, ends the "
                        f"job too when {nodes.name} has not come back within its --join-timeout"
                    ) from None
                raise JoinTimeoutError(
                    f"{nodes.name} could not reach node 0's launcher at {where} within "
                    f"{nodes.timeout_s:g} s (--join-timeout) ({e}); is node 0 started, and is "
                    "--master-addr right?"
                ) from None
            if now >= next_report:
                log(f"{nodes.name} waiting for node 0's launcher at {where}")
                next_report = now + _REPORT_EVERY_S
            time.sleep(0.2)
    try:
        meeting.send(conn, mine)
        try:
            reply = meeting.read(conn, deadline, f"node 0's launcher at {where}", stopped=stopped)
        except LinkLostError as e:
            if lost is None:
                raise
            raise NodeLostError(  # its launcher ended while we waited in its backlog
                f"node 0's launcher at {where} was lost ({lost.why}) while {nodes.name} "
                f"waited for its word on attempt {lost.attempt + 1}, and ended when "
                f"{nodes.name} came back ({e}); start the job again on every node"
            ) from None
        if "error" in reply:
            if reply.get("join_timeout") is True:
                raise JoinTimeoutError(f"node 0 ended the job: {reply['error']}")
            raise LaunchError(f"node 0 refused {nodes.name}: {reply['error']}")
        everyone, attempt = reply.get("nodes"), reply.get("attempt")
        if (
            not isinstance(everyone, list)
            or len(everyone) != nodes.nnodes
            or type(attempt) is not int
            or not 0 <= attempt <= max_restarts
        ):
            raise LaunchError(
                f"node 0 at {where} answered {reply!r}, expected {plural(nodes.nnodes, 'node')} "
                f"and an attempt number 0..{max_restarts} (--max-restarts)"
            )
        for rank, entry in enumerate(everyone):
            _check_entry(entry, nodes, placement, f"node 0's answer for node {rank}", max_restarts)
            if entry["node_rank"] != rank:
                raise LaunchError(
                    f"node 0 at {where} listed node {entry['node_rank']} as node {rank}"
                )
    except BaseException:
        conn.close()
        raise
    if max_restarts:
        links[0] = conn
    else:
        conn.close()
    log(f"{_all_nodes(nodes.nnodes)} arrived{_which(attempt)}: {_names(dict(enumerate(everyone)))}")
    return everyone, attempt


def _read_entry(
    conn: socket.socket,
    nodes: Nodes,
    deadline: float,
    meeting: MeetingSigner,
    placement: Placement,
    max_restarts: int,
) -> dict:
    entry = meeting.read(conn, deadline, "a node's launcher")
    _check_entry(entry, nodes, placement, "a node's launcher", max_restarts)
    return entry


def _which(attempt: int) -> str:
    """`` for attempt 2`` after a restart; nothing for the first."""
    return f" for attempt {attempt + 1}" if attempt else ""


#: An entry's fields and their JSON types: exactly these, nothing else is read.
_ENTRY_FIELDS = {"node_rank": int, "nnodes": int, "host": str, "ports": dict, "roles": dict}
#: The role options an entry carries, by flag, and their JSON types.
_ROLE_FIELDS = {
    "--ps": int,
    "--ps-nodes": list,
    "--chief": bool,
    "--chief-node": int,
    "--evaluator": bool,
    "--evaluator-node": int,
    "--max-restarts": int,
}


def _check_entry(
    entry: object, nodes: Nodes, placement: Placement, source: str, max_restarts: int = 0
) -> None:
    """An entry is exactly {node_rank, nnodes, host, ports, roles}: the job's --nnodes, this
    node's role options, and ports by task type as many as the placement gives that node."""
    if not isinstance(entry, dict) or set(entry) != set(_ENTRY_FIELDS):
        raise LaunchError(f"{source} sent {entry!r}, expected the fields {sorted(_ENTRY_FIELDS)}")
    for key, kind in _ENTRY_FIELDS.items():
        if type(entry[key]) is not kind:
            raise LaunchError(f"{source} sent {key}={entry[key]!r}, expected a {kind.__name__}")
    rank = entry["node_rank"]
    if entry["nnodes"] != nodes.nnodes:
        raise LaunchError(
            f"node {rank} was started with --nnodes {entry['nnodes']} but "
            f"{nodes.name} with --nnodes {nodes.nnodes}; every node needs the same --nnodes"
        )
    if not 0 <= rank < nodes.nnodes:
        raise LaunchError(
            f"{source} claims --node-rank {rank}, out of range for --nnodes {nodes.nnodes}"
        )
    if not entry["host"] or len(entry["host"]) > 255 or any(c.isspace() for c in entry["host"]):
        raise LaunchError(f"{source} sent host={entry['host']!r}, expected a host name or address")
    roles = entry["roles"]
    if (
        set(roles) != set(_ROLE_FIELDS)
        or not all(type(roles[flag]) is kind for flag, kind in _ROLE_FIELDS.items())
        or not all(type(r) is int for r in roles["--ps-nodes"])
    ):
        raise LaunchError(
            f"{source} sent roles={roles!r}, expected {sorted(_ROLE_FIELDS)} with the types "
            f"{ {flag: kind.__name__ for flag, kind in _ROLE_FIELDS.items()} }"
        )
    ours = _options(placement, max_restarts)
    for flag in _ROLE_FIELDS:
        if roles[flag] != ours[flag]:
            raise LaunchError(
                f"node {rank} was started {_option(flag, roles[flag])} but {nodes.name} "
                f"{_option(flag, ours[flag])}; every node needs the same {flag} (the same "
                "command on every machine, but for --node-rank)"
            )
    ports = entry["ports"]
    if set(ports) != set(TASK_TYPES) or not all(
        type(ports[job]) is list and all(type(p) is int and 1 <= p <= 65535 for p in ports[job])
        for job in TASK_TYPES
    ):
        raise LaunchError(
            f"{source} sent ports {ports!r}, expected a list of ports (1..65535) for each of "
            f"{list(TASK_TYPES)}"
        )
    expected = placement.counts_on(rank, len(ports["worker"]))
    got = {job: len(ports[job]) for job in TASK_TYPES}
    if got != expected or not any(got.values()):
        raise LaunchError(
            f"{source} sent ports for {_counted(got)} on node {rank}, expected one port per "
            f"task the placement puts there: {_counted(expected)}"
        )


def _option(flag: str, value: object) -> str:
    """``with --ps 2``, ``without --chief``, ``with --ps-nodes 0,1``, ``without --ps-nodes``."""
    if value is True:
        return f"with {flag}"
    if value is False or value == []:
        return f"without {flag}"
    if isinstance(value, list):
        return f"with {flag} {_ranks(value)}"
    return f"with {flag} {value}"


def _ranks(ranks: Sequence[int]) -> str:
    return ",".join(str(r) for r in ranks)


def _counted(counts: Mapping[str, int]) -> str:
    """``1 chief, 2 workers and 1 ps``; ``no task``."""
    parts = [plural(n, job) for job, n in counts.items() if n]
    if not parts:
        return "no task"
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass  # the peer left: it will report its own failure


def _read_message(
    conn: socket.socket,
    deadline: float,
    source: str,
    stopped: Callable[[], bool] = lambda: False,
) -> dict:
    data = b""
    while not data.endswith(b"\n"):
        if stopped():
            raise StoppedWaiting
        left = deadline - time.monotonic()
        if left <= 0:
            # The deadline is the meeting's (--join-timeout), whichever wait it was spent on.
            raise JoinTimeoutError(
                f"{source} did not answer within the join timeout (--join-timeout)"
            )
        conn.settimeout(min(left, 0.5))  # short waits: a signal to the launcher is seen soon
        try:
            chunk = conn.recv(4096)
        except TimeoutError as e:
            if e.errno is None:  # this wait's own limit, not the connection's
                continue
            # The kernel gave up on the link (keepalive, TCP_USER_TIMEOUT): silence, which a
            # cut link and a machine that went down look alike.
            raise LinkLostError(f"{source} did not answer: the link timed out ({e})") from None
        except OSError as e:
            raise LinkLostError(f"{source} did not answer ({e})") from None
        if not chunk:
            raise LinkLostError(f"{source} closed the connection before answering")
        data += chunk
        if len(data) > _MAX_MESSAGE_BYTES:
            raise LaunchError(f"{source} sent more than {_MAX_MESSAGE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except ValueError as e:
        raise LaunchError(f"{source} sent something that is not JSON ({e})") from None
    return _read_message_body(text, source)


def _read_message_body(text: str, source: str) -> dict:
    try:
        message = json.loads(text)
    except ValueError as e:
        raise LaunchError(f"{source} sent something that is not JSON ({e})") from None
    if not isinstance(message, dict):
        raise LaunchError(f"{source} sent {message!r}, expected a JSON object")
    return message


def _names(entries: Mapping[int, dict]) -> str:
    return ", ".join(
        f"node {r} ({entries[r]['host']}: "
        f"{_counted({job: len(entries[r]['ports'][job]) for job in TASK_TYPES})})"
        for r in sorted(entries)
    )


def _all_nodes(nnodes: int) -> str:
    return f"all {nnodes} nodes" if nnodes != 1 else "the job's one node"


def _missing(entries: Mapping[int, dict], nnodes: int) -> str:
    return ", ".join(f"node {r}" for r in range(nnodes) if r not in entries)


def _progress(entries: Mapping[int, dict], nnodes: int, waited: float) -> str:
    return (
        f"node 0 waiting for the other nodes ({waited:.0f}s): {len(entries)} of {nnodes} "
        f"arrived: {_names(entries)}; missing: {_missing(entries, nnodes)}"
    )
