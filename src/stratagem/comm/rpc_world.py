"""The world of a parameter-server job: who its members are, the roll call, who is alive.

Members are the chief, the workers, the ps tasks and an evaluator, in TF's order (in a cluster
with a chief the evaluator is a sidecar, no member), named ``"worker:0"``, ``"ps:1"``... They
meet at the first member's address, with a roll call that names any task that never arrives;
workers then talk to each ps over ``comm.messages`` (never ``torch.distributed.rpc``, which
unpickles what a peer sends). Every member runs a liveness server (``comm.liveness``),
published at the roll call, so a peer that is gone (its port refuses), busy (it answers) or
stuck (silent) can be told apart: a worker's goodbye to each ps, and any wait on a peer, ends
after the operation timeout naming a peer that stopped answering. A worker the launcher
restarted alone (``--restart-workers``; not the first member, the rendezvous's host) signs in
again with a higher incarnation, and ``refresh`` makes its rank alive again in every view.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch.distributed as dist

from stratagem.cluster import ClusterResolver, is_coordinated
from stratagem.cluster.address import parse_address
from stratagem.cluster.job_secret import job_secret, task_hosts
from stratagem.cluster.tasks import task_incarnation
from stratagem.comm import error_report
from stratagem.comm.liveness import LivenessServer, advertised_host
from stratagem.comm.messages import MessageServer
from stratagem.comm.rendezvous import Member, decode_member, open_store, roll_call
from stratagem.errors import RendezvousError

RPC_TASK_TYPES = ("chief", "worker", "ps", "evaluator")


def rpc_members(spec: Any) -> list[tuple[str, int]]:
    """``(task_type, task_id)`` of the RPC members, in rank order. In a cluster with a chief
    (TF2's coordinated training) the evaluator is not one: it is TF's sidecar evaluator, which
    reads the chief's checkpoints (``SidecarEvaluator``) and talks to no task."""
    coordinated = is_coordinated(spec)
    return [
        (job, index)
        for job in RPC_TASK_TYPES
        if job in spec.jobs and not (coordinated and job == "evaluator")
        for index in spec.task_indices(job)
    ]


def rpc_name(task_type: str, task_id: int) -> str:
    return f"{task_type}:{task_id}"


class RpcWorld:
    """This process's membership of the job (joined by the constructor: the roll call)."""

    def __init__(self, resolver: ClusterResolver, *, rendezvous_timeout: float) -> None:
        spec = resolver.cluster_spec()
        self.members = rpc_members(spec)
        me = (resolver.task_type, resolver.task_id)
        if me not in self.members:
            raise RendezvousError(
                f"{resolver.describe()} is not a member of the job's parameter-server world (its "
                f"chief, workers, ps tasks and evaluator: {self.members})"
            )
        self.rank = self.members.index(me)  # type: ignore[arg-type]
        self.world_size = len(self.members)
        self.name = rpc_name(*me)  # type: ignore[arg-type]
        self._spec = spec
        # An error of ours ends this task as one readable block, as it does an all-reduce task.
        error_report.install(self.describe(self.rank))
        # Known before anything listens: a multi-machine job without a secret stops here.
        self.secret = job_secret(task_hosts(spec), me=self.describe(self.rank))
        first = self.members[0]
        host, port = parse_address(spec.task_address(*first))
        base = open_store(
            host,
            port,
            is_server=self.rank == 0,
            timeout_s=rendezvous_timeout,
            owner=self.describe(0),
            me=self.describe(self.rank),
            secret=self.secret,
        )
        store = dist.PrefixStore(f"stratagem-rpc/{resolver.attempt}/", base)
        cluster = json.dumps({j: spec.num_tasks(j) for j in sorted(spec.jobs)}, sort_keys=True)
        # Only workers come back alone: they hold no state the job shares (a coordinator's
        # chief replays their datasets; a between-graph worker pulls the ps's values), except
        # the first member, which hosts the rendezvous; a ps or the chief restarts with the job.
        self._rejoinable = set(self.ranks("worker")) - {0}
        incarnation = task_incarnation(os.environ)
        if incarnation > 1 and self.rank not in self._rejoinable:
            raise RendezvousError(
                f"{self.describe(self.rank)} was restarted alone (incarnation {incarnation}), "
                "but only a worker other than the chief (and than worker 0 without one) can "
                "rejoin a running job; restart the whole job instead (--max-restarts)"
            )
        self._liveness = LivenessServer(advertised_host(host))
        self.me = Member(
            rank=self.rank,
            world_size=self.world_size,
            name=self.describe(self.rank),
            cluster=cluster,
            pid=os.getpid(),
            host=socket.gethostname(),
            liveness=self._liveness.address,
            incarnation=incarnation,
        )
        try:
            everyone = roll_call(
                store, self.me, timeout_s=rendezvous_timeout, peer_name=self.describe
            )
        except BaseException:
            self._liveness.close("failed")  # a refused sign-in leaves nothing listening
            raise
        self.liveness = {m.rank: m.liveness for m in everyone}
        self.pids = {m.rank: m.pid for m in everyone}
        self.incarnations = {m.rank: m.incarnation for m in everyone}
        self._base = base  # the rank-0 store lives until this process leaves
        self._store = store
        self._store_lock = threading.Lock()
        self._running = True

    def describe(self, rank: int) -> str:
        """``"ps 0 (localhost:2223)"``: who holds a rank, for error messages."""
        task_type, task_id = self.members[rank]
        name = task_type if task_type == "chief" else f"{task_type} {task_id}"
        return f"{name} ({self.address(rank)})"

    def address(self, rank: int) -> str:
        """The task address of member ``rank`` (where a ps serves its shards)."""
        return self._spec.task_address(*self.members[rank])

    def names(self, task_type: str) -> list[str]:
        return [rpc_name(t, i) for t, i in self.members if t == task_type]

    def ranks(self, task_type: str) -> list[int]:
        return [r for r, (t, _) in enumerate(self.members) if t == task_type]

    def rank_of(self, name: str) -> int:
        """The rank of the member named ``"worker:1"``."""
        task_type, _, task_id = name.partition(":")
        return self.members.index((task_type, int(task_id)))

    def pid(self, task_type: str, task_id: int) -> int:
        """The process id a member signed in with (tests kill a ps by it)."""
        return self.pids[self.members.index((task_type, task_id))]

    def shutdown(self) -> None:
        """Leave: stop answering liveness probes (peers then see this process as gone)."""
        if self._running:
            self._running = False
            self._liveness.close("ok")

    def state(self, rank: int) -> str:
        """``"alive"`` (its liveness server answers), ``"ended"`` (its port refuses: the
        process is gone) or ``"silent"`` (it accepts but does not answer: stopped or stuck).
        A worker that ended is looked up again: restarted, it is alive again (``refresh``)."""
        state = _state(self.liveness[rank])
        if state == "ended" and self.refresh(rank):
            state = _state(self.liveness[rank])
        return state

    def refresh(self, rank: int) -> bool:
        """Whether a newer incarnation of member ``rank`` signed in (a worker the launcher
        restarted alone); if so, this view now holds its liveness address and pid.

        The record is read from the rendezvous, which the chief (rank 0) hosts: a member other
        than the chief reads it only while the chief answers, as a store whose host is gone
        makes c10d wait and print a C++ trace."""
        if rank not in self._rejoinable or not self._running:
            return False
        if self.rank != 0 and _state(self.liveness[0]) == "ended":
            return False
        key = f"member/{rank}"
        try:
            with self._store_lock:
                raw = bytes(self._store.get(key))
        except (RuntimeError, RendezvousError):  # the store went away meanwhile
            return False
        record = decode_member(raw, key=key, me=self.name)
        if record.rank != rank or record.incarnation <= self.incarnations[rank]:
            return False
        self.liveness[rank] = record.liveness
        self.pids[rank] = record.pid
        self.incarnations[rank] = record.incarnation
        return True

    def has_ended(self, rank: int) -> bool:
        """Whether member ``rank``'s process has ended (its liveness server refuses)."""
        return self.state(rank) == "ended"

    def silent(self, names: list[str]) -> list[str]:
        """Which of the members ``names`` (``"worker:1"``) do not answer their liveness probe:
        their descriptions. Those that ended are not silent: their end is noticed elsewhere."""
        ranks = [self.rank_of(n) for n in names if n != self.name]
        return [self.describe(r) for r in ranks if self.state(r) == "silent"]

    def wait_for(
        self, ranks: list[int], done: Any, stop: threading.Event, poll_s: float = 0.25
    ) -> bool:
        """Poll ``done(rank)`` for each of ``ranks`` until all are done (True) or ``stop`` is
        set (False): a watchdog's loop, over peers that may die without a word."""
        left = set(ranks)
        while left and not stop.is_set():
            left = {rank for rank in left if not done(rank)}
            if left:
                stop.wait(poll_s)
        return not left


def _state(address: str, timeout: float = 2.0) -> str:
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as conn:
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            return "alive" if conn.recv(1) else "ended"
    except ConnectionRefusedError:
        return "ended"
    except OSError:
        return "silent"


def serve_and_join(
    resolver: ClusterResolver,
    *,
    me: str,
    address: str,
    clients: Collection[str],
    methods: Mapping[str, Callable[..., Any]],
    operation_timeout: float,
    rendezvous_timeout: float,
) -> tuple[MessageServer, RpcWorld]:
    """A serving task's start (a ps, a coordinator's worker): its ``MessageServer`` on its own
    ``address``, then its place in the job's world. Listening comes before the roll call: a
    client connects as soon as it has passed it. A waiting reply is announced every quarter of
    the operation timeout (between 0.25 and 5 s)."""
    host, port = parse_address(address)
    server = MessageServer(
        host,
        port,
        name=me,
        secret=job_secret(task_hosts(resolver.cluster_spec()), me=me),
        clients=clients,
        methods=methods,
        handshake_timeout=operation_timeout,
        note_every=min(5.0, max(0.25, operation_timeout / 4)),
    )
    try:
        return server, RpcWorld(resolver, rendezvous_timeout=rendezvous_timeout)
    except BaseException:
        server.close()
        raise
