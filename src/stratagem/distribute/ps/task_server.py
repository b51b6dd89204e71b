"""A ps task's server: ``sg.distribute.Server`` on a ps task serves the task's shards
(``server.ShardStore`` and its ``methods``) until every worker is done or lost, then until every
task connected to it has hung up, naming one that stops answering. A lost worker is watched
again once it comes back (restarted alone, it pushes again)."""

from __future__ import annotations

import sys
import threading
import time

import torch

from stratagem.cluster import ClusterResolver, collective_members, is_coordinated
from stratagem.comm.rpc_world import rpc_members, rpc_name, serve_and_join
from stratagem.distribute.machinery.worker_job import WorkerJob
from stratagem.distribute.ps.shard_store import ShardStore, methods
from stratagem.errors import CollectiveTimeoutError


class PsTaskServer:
    """This ps task, serving its shards (``sg.distribute.Server`` on a ps task).

    ``join()`` blocks until every worker has finished, then returns (TF's ``server.join()``
    never returns; here the ps can exit cleanly when the job is done).
    """

    def __init__(
        self, cluster_resolver: ClusterResolver | None = None, *, job: WorkerJob | None = None
    ) -> None:
        # ``job``: set up already (by ParameterServerStrategy on a ps task); else set up here.
        if job is None:
            job = WorkerJob.set_up("sg.distribute.Server", None, cluster_resolver, on_gpu=False)
        resolver, timeouts = job.resolver, job.timeouts
        if resolver.task_type != "ps":
            raise ValueError(
                f"sg.distribute.Server serves a ps task; this process is {resolver.describe()}"
            )
        # Creating the first torch optimizer imports torch._dynamo (seconds); do it now, while
        # the workers start, rather than inside the first push they wait on.
        torch.optim.SGD([torch.zeros(1, requires_grad=True)])
        spec = resolver.cluster_spec()
        workers = [rpc_name(t, i) for t, i in collective_members(spec)]
        name = rpc_name("ps", resolver.task_id or 0)
        self.store = ShardStore(name, len(workers))
        self._timeout = timeouts.operation
        self._coordinated = is_coordinated(spec)
        address = spec.task_address("ps", resolver.task_id or 0)
        self.server, self._world = serve_and_join(
            resolver,
            me=f"ps {resolver.task_id or 0} ({address})",
            address=address,
            clients=[rpc_name(t, i) for t, i in rpc_members(spec) if t != "ps"],
            methods=methods(self.store, workers),
            operation_timeout=timeouts.operation,
            rendezvous_timeout=timeouts.rendezvous,
        )

    def join(self) -> None:
        """Serve until every worker is done or lost, then until every task connected to this
        ps has hung up (or ended, or stopped answering for the operation timeout)."""
        world = self._world
        workers = world.ranks("chief") + world.ranks("worker")
        index = {rank: i for i, rank in enumerate(workers)}  # the strategy's worker index
        quiet_since: dict[int, float] = {}

        # Twice the operation timeout: a worker whose push waits on the silent one has the
        # first word (it names the worker and what it waits for); the ps's bound is for waits
        # no worker sees, such as the end of an async job.
        patience = 2 * self._timeout

        def silent_too_long(rank: int, doing: str) -> None:
            since = quiet_since.setdefault(rank, time.monotonic())
            if time.monotonic() - since > patience:
                raise CollectiveTimeoutError(
                    f"{world.describe(world.rank)} waits for {world.describe(rank)} to {doing}: "
                    f"it has not answered its liveness probe for {patience:.0f} s (stopped or "
                    "stuck; twice STRATAGEM_OP_TIMEOUT)"
                )

        def coordinating() -> bool:
            # A coordinating chief (the first of ``workers``) decides when a worker that stops
            # answering is lost: it gives that worker's functions to the others, and the job
            # goes on (TF's ps never waits on a worker). Meanwhile the ps waits on it too.
            chief = workers[0]
            return (
                self._coordinated
                and not self.store.has_left(index[chief])
                and world.state(chief) == "alive"
            )

        def watch(rank: int) -> None:
            if self.store.has_left(index[rank]):
                return  # finished, or lost and not back (a restarted one is taken back)
            state = world.state(rank)
            if state == "alive":
                quiet_since.pop(rank, None)
                return
            if state == "silent":
                if rank == workers[0] or not coordinating():
                    silent_too_long(rank, "finish training")
                return
            print(
                f"{world.describe(rank)} ended without saying it was done (lost); "
                "training goes on without it",
                file=sys.stderr,
                flush=True,
            )
            self.store.leave(index[rank], lost=True)

        try:
            # Every worker is watched until all are done: a lost one may come back.
            pause = threading.Event()
            while not self.store.workers_done():
                for rank in workers:
                    watch(rank)
                pause.wait(0.25)
            # The workers' goodbyes are answered; the evaluator may still be reading.
            quiet_since.clear()
            while True:
                ranks = {world.rank_of(n) for n in self.server.open_connections()}
                states = {r: world.state(r) for r in ranks}
                if all(s == "ended" for s in states.values()):
                    break
                for rank in [r for r, s in states.items() if s == "silent"]:
                    silent_too_long(rank, "hang up")
                time.sleep(0.1)
        finally:
            self.server.close()
            world.shutdown()
