"""The RPC world of a parameter-server job: every task joins ``torch.distributed.rpc``.

Members are the chief, the workers, the ps tasks and an evaluator (TF's order: chief, workers by
index, ps by index, evaluator), named ``"worker:0"``, ``"ps:1"``... They meet at the first
member's address, as the all-reduce strategies do: a roll call on our own TCPStore names any
task that never arrives (a ps address that never answers) instead of TensorPipe's bare store
timeout, and TensorPipe's agent then starts on that same store.

Every member also runs a liveness server (``comm.liveness``), published at the roll call, so a
ps can tell a worker that is gone from one that is busy: a refused connection means the process
has ended. Ending the job rests on that: a worker tells each ps it is done and waits for the
answer, which each ps gives once every worker is done or found gone. Then every member leaves
together through TensorPipe's graceful shutdown (a barrier, quiet), or, when a worker was lost
and would block that barrier forever, each leaves on its own (TensorPipe then logs a warning
for each connection a peer closes).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import warnings
from typing import Any

import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from stratagem.cluster import ClusterResolver
from stratagem.cluster.address import parse_address
from stratagem.cluster.job_secret import job_secret, task_hosts
from stratagem.comm.binding import pin_transport_interfaces
from stratagem.comm.liveness import LivenessServer, advertised_host
from stratagem.comm.rendezvous import Member, open_store, roll_call
from stratagem.errors import RendezvousError

RPC_TASK_TYPES = ("chief", "worker", "ps", "evaluator")


def rpc_members(spec: Any) -> list[tuple[str, int]]:
    """``(task_type, task_id)`` of the RPC members, in rank order."""
    return [
        (job, index)
        for job in RPC_TASK_TYPES
        if job in spec.jobs
        for index in spec.task_indices(job)
    ]


def rpc_name(task_type: str, task_id: int) -> str:
    return f"{task_type}:{task_id}"


class RpcWorld:
    """This process's membership of the job's RPC world (started by the constructor)."""

    def __init__(
        self, resolver: ClusterResolver, *, rendezvous_timeout: float, rpc_timeout: float
    ) -> None:
        spec = resolver.cluster_spec()
        self.members = rpc_members(spec)
        me = (resolver.task_type, resolver.task_id)
        if me not in self.members:
            raise RendezvousError(
                f"{resolver.describe()} is not a member of the job's RPC world (its chief, "
                f"workers and ps tasks: {self.members})"
            )
        self.rank = self.members.index(me)  # type: ignore[arg-type]
        self.world_size = len(self.members)
        self.name = rpc_name(*me)  # type: ignore[arg-type]
        self._spec = spec
        first = self.members[0]
        host, port = parse_address(spec.task_address(*first))
        base = open_store(
            host,
            port,
            is_server=self.rank == 0,
            timeout_s=rendezvous_timeout,
            owner=self.describe(0),
            me=self.describe(self.rank),
            secret=job_secret(task_hosts(spec), me=self.describe(self.rank)),
        )
        store = dist.PrefixStore(f"stratagem-rpc/{resolver.attempt}/", base)
        cluster = json.dumps({j: spec.num_tasks(j) for j in sorted(spec.jobs)}, sort_keys=True)
        own_host = advertised_host(host)
        self._liveness = LivenessServer(own_host)
        # gloo's and TensorPipe's listeners on this task's address too (``comm.binding``).
        pin_transport_interfaces(own_host)
        member = Member(
            rank=self.rank,
            world_size=self.world_size,
            name=self.describe(self.rank),
            cluster=cluster,
            pid=os.getpid(),
            host=socket.gethostname(),
            liveness=self._liveness.address,
        )
        everyone = roll_call(store, member, timeout_s=rendezvous_timeout, peer_name=self.describe)
        self.liveness = {m.rank: m.liveness for m in everyone}
        options = rpc.TensorPipeRpcBackendOptions(
            rpc_timeout=rpc_timeout,
            # Sync-mode pushes park a thread-free future each, but fetches and reads of every
            # worker may arrive at once: leave room beyond TensorPipe's default of 16.
            num_worker_threads=max(16, 4 * self.world_size),
        )
        rpc_store = dist.PrefixStore("agent/", store)
        rpc_store.set_timeout(datetime.timedelta(seconds=rendezvous_timeout))
        # What rpc.init_rpc does after its own rendezvous, on the store we already met on.
        dist_autograd._init(self.rank)
        with warnings.catch_warnings():
            # TensorPipe's start exchanges device maps over a gloo group it builds itself and
            # passes as a ProcessGroup, which torch then warns about in every task; not ours.
            warnings.filterwarnings("ignore", "You are using a Backend", UserWarning)
            rpc._init_rpc_backend(
                rpc.BackendType.TENSORPIPE,
                rpc_store,
                self.name,
                self.rank,
                self.world_size,
                options,
            )
        self._base = base  # the rank-0 store serves the agent until shutdown
        self._rendezvous_timeout = rendezvous_timeout
        self._running = True

    def describe(self, rank: int) -> str:
        """``"ps 0 (localhost:2223)"``: who holds an RPC rank, for error messages."""
        task_type, task_id = self.members[rank]
        name = task_type if task_type == "chief" else f"{task_type} {task_id}"
        return f"{name} ({self._spec.task_address(task_type, task_id)})"

    def names(self, task_type: str) -> list[str]:
        return [rpc_name(t, i) for t, i in self.members if t == task_type]

    def ranks(self, task_type: str) -> list[int]:
        return [r for r, (t, _) in enumerate(self.members) if t == task_type]

    def shutdown(self, graceful: bool) -> None:
        """Leave the RPC world: with every other member (``graceful``), or alone."""
        if self._running:
            self._running = False
            try:
                rpc.shutdown(graceful=graceful, timeout=self._rendezvous_timeout)
            finally:
                self._liveness.close("ok")

    def has_ended(self, rank: int) -> bool:
        """Whether member ``rank``'s process has ended (its liveness server refuses)."""
        return _ended(self.liveness[rank])

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


def _ended(address: str) -> bool:
    """Whether the process behind a liveness address has ended: its port refuses connections.
    A busy or unreachable process (a timeout) counts as alive."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2.0):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
