"""A job over several machines from one command: ``stratagem run --nnodes N --node-rank R``.

The user runs the same command on every machine. Each node's launcher picks free ports for its
own K workers, then the launchers meet at ``--master-addr:--master-port``, where node 0's
launcher listens: each node sends its address and ports, node 0 answers every node with the
whole job's worker list, and every launcher builds the TF_CONFIG of its own tasks from it (node
R's tasks are workers R*K .. R*K+K-1). The meeting is plain JSON lines over TCP, size-limited
and checked field by field (nothing is unpickled), so the launcher still imports no torch.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import socket
import time
from collections.abc import Callable, Mapping
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


def make_node_tasks(
    nodes: Nodes,
    workers: int,
    *,
    host: str,
    restart: int,
    base_env: Mapping[str, str],
    omp_threads: int | None,
    log: Callable[[str], None],
    stopped: Callable[[], bool] = lambda: False,
) -> list[Task] | None:
    """This node's ``workers`` tasks, with the TF_CONFIG of the whole job (all nodes' workers);
    None when ``stopped()`` turned true while the nodes met (the launcher got a signal)."""
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
    ports = free_ports(workers, listen_address(host))
    mine = {"node_rank": nodes.node_rank, "nnodes": nodes.nnodes, "host": host, "ports": ports}
    meeting = _Meeting(secret)
    try:
        if nodes.node_rank == 0:
            everyone = _host_meeting(nodes, mine, log, stopped, meeting)
        else:
            everyone = _join_meeting(nodes, mine, log, stopped, meeting)
    except _Stopped:
        return None
    addresses = [f"{n['host']}:{p}" for n in everyone for p in n["ports"]]
    configs = build_tf_configs({"worker": addresses})
    first = sum(len(n["ports"]) for n in everyone[: nodes.node_rank])
    return [
        Task(
            "worker",
            i,
            addresses[i],
            task_env(base_env, configs["worker", i], restart, omp_threads),
        )
        for i in range(first, first + workers)
    ]


# --- the meeting -------------------------------------------------------------------------------


class _Stopped(Exception):
    """The launcher was told to stop while the nodes met."""


class _Meeting:
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


def _host_meeting(
    nodes: Nodes,
    mine: dict,
    log: Callable[[str], None],
    stopped: Callable[[], bool],
    meeting: _Meeting,
) -> list[dict]:
    """Node 0: listen, collect every node's entry, answer each with all of them (or an error)."""
    address = listen_address(nodes.master_addr)
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        server.bind((address, nodes.master_port))
    except OSError as e:
        server.close()
        raise LaunchError(
            f"node 0 cannot listen on --master-addr {nodes.master_addr}:{nodes.master_port} "
            f"({e.strerror or e}); give a free --master-port"
        ) from None
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
        server.listen(nodes.nnodes)
        server.settimeout(0.2)
        while len(entries) < nodes.nnodes:
            if stopped():
                raise _Stopped
            now = time.monotonic()
            if now >= deadline:
                raise JoinTimeoutError(
                    f"node 0 waited {nodes.timeout_s:g} s (--join-timeout) at {nodes.master_addr}:"
                    f"{nodes.master_port} for the other nodes; missing: "
                    f"{_missing(entries, nodes.nnodes)}. Run the same command with each "
                    "--node-rank on every machine"
                )
            if now >= next_report:
                log(_progress(entries, nodes.nnodes, now - deadline + nodes.timeout_s))
                next_report = now + _REPORT_EVERY_S
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            try:
                entry = _read_entry(conn, nodes, deadline, meeting)
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
            meeting.send(conn, {"nodes": everyone})
        log(f"{_all_nodes(nodes.nnodes)} arrived: {_names(entries)}")
        return everyone
    finally:
        for conn in peers.values():
            conn.close()
        server.close()


def _join_meeting(
    nodes: Nodes,
    mine: dict,
    log: Callable[[str], None],
    stopped: Callable[[], bool],
    meeting: _Meeting,
) -> list[dict]:
    """Node R > 0: send our entry to node 0 (retrying until it listens), read the job."""
    deadline = time.monotonic() + nodes.timeout_s
    next_report = time.monotonic() + 1.0
    where = f"{nodes.master_addr}:{nodes.master_port}"
    log(
        f"{nodes.name} waiting up to {nodes.timeout_s:g} s (--join-timeout) for node 0's "
        f"launcher at {where} and the other nodes"
    )
    while True:
        try:
            conn = socket.create_connection((nodes.master_addr, nodes.master_port), timeout=1.0)
            break
        except OSError as e:
            if stopped():
                raise _Stopped from None
            now = time.monotonic()
            if now >= deadline:
                raise JoinTimeoutError(
                    f"{nodes.name} could not reach node 0's launcher at {where} within "
                    f"{nodes.timeout_s:g} s (--join-timeout) ({e}); is node 0 started, and is "
                    "--master-addr right?"
                ) from None
            if now >= next_report:
                log(f"{nodes.name} waiting for node 0's launcher at {where}")
                next_report = now + _REPORT_EVERY_S
            time.sleep(0.2)
    with conn:
        meeting.send(conn, mine)
        reply = meeting.read(conn, deadline, f"node 0's answer at {where}", stopped=stopped)
    if "error" in reply:
        raise LaunchError(f"node 0 refused {nodes.name}: {reply['error']}")
    everyone = reply.get("nodes")
    if not isinstance(everyone, list) or len(everyone) != nodes.nnodes:
        raise LaunchError(
            f"node 0 at {where} answered {reply!r}, expected {plural(nodes.nnodes, 'node')}"
        )
    for rank, entry in enumerate(everyone):
        _check_entry(entry, nodes, f"node 0's answer for node {rank}")
        if entry["node_rank"] != rank:
            raise LaunchError(f"node 0 at {where} listed node {entry['node_rank']} as node {rank}")
    log(f"{_all_nodes(nodes.nnodes)} arrived: {_names(dict(enumerate(everyone)))}")
    return everyone


def _read_entry(conn: socket.socket, nodes: Nodes, deadline: float, meeting: _Meeting) -> dict:
    entry = meeting.read(conn, deadline, "a node's launcher")
    _check_entry(entry, nodes, "a node's launcher")
    return entry


def _check_entry(entry: object, nodes: Nodes, source: str) -> None:
    """An entry is exactly {node_rank, nnodes, host, ports} with the job's --nnodes."""
    fields = {"node_rank": int, "nnodes": int, "host": str, "ports": list}
    if not isinstance(entry, dict) or set(entry) != set(fields):
        raise LaunchError(f"{source} sent {entry!r}, expected the fields {sorted(fields)}")
    for key, kind in fields.items():
        if type(entry[key]) is not kind:
            raise LaunchError(f"{source} sent {key}={entry[key]!r}, expected a {kind.__name__}")
    if entry["nnodes"] != nodes.nnodes:
        raise LaunchError(
            f"node {entry['node_rank']} was started with --nnodes {entry['nnodes']} but "
            f"{nodes.name} with --nnodes {nodes.nnodes}; every node needs the same --nnodes"
        )
    if not 0 <= entry["node_rank"] < nodes.nnodes:
        raise LaunchError(
            f"{source} claims --node-rank {entry['node_rank']}, out of range for --nnodes "
            f"{nodes.nnodes}"
        )
    ports = entry["ports"]
    if not ports or not all(type(p) is int and 1 <= p <= 65535 for p in ports):
        raise LaunchError(f"{source} sent ports {ports!r}, expected one port per task")


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
            raise _Stopped
        left = deadline - time.monotonic()
        if left <= 0:
            raise JoinTimeoutError(f"{source} did not answer within --join-timeout")
        conn.settimeout(min(left, 0.5))  # short waits: a signal to the launcher is seen soon
        try:
            chunk = conn.recv(4096)
        except TimeoutError:
            continue
        except OSError as e:
            raise LaunchError(f"{source} did not answer ({e})") from None
        if not chunk:
            raise LaunchError(f"{source} closed the connection before answering")
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
        f"node {r} ({entries[r]['host']}, {plural(len(entries[r]['ports']), 'task')})"
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
