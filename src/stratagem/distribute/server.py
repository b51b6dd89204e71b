"""``sg.distribute.Server``: what a ps task or a coordinator's worker task runs (TF's
``tf.distribute.Server(server_or_cluster_def, job_name=None, task_index=None, protocol=None,
config=None, start=True)``).

On a ``ps`` task it serves the task's variable shards (``ps.task_server.PsTaskServer``) until
every worker is done; on a ``worker`` task of a cluster with a ``chief`` it serves the chief's
``ClusterCoordinator`` (``coordinator.worker.WorkerServer``). The cluster comes from a resolver,
a cluster spec with ``job_name`` and ``task_index``, or the environment (TF_CONFIG).
``protocol`` and ``config`` are accepted and ignored: the transport is always ``comm.messages``.
``join()`` serves until the job is done, then ends the process with ``SystemExit(0)``
(``finally`` blocks and ``atexit`` handlers run): the code after it, as after TF's ``join()``
that never returns, is not run on a worker or ps task.
"""

from __future__ import annotations

from typing import Any, NoReturn

from stratagem.cluster import (
    ClusterResolver,
    SimpleClusterResolver,
    is_coordinated,
    resolve_cluster,
)
from stratagem.distribute.coordinator.worker import WorkerServer
from stratagem.distribute.ps.task_server import PsTaskServer


class Server:
    """``sg.distribute.Server(server_or_cluster_def=None, job_name=None, task_index=None,
    protocol=None, config=None, start=True)``; ``server_or_cluster_def`` may be a cluster
    resolver (also as ``cluster_resolver=``), a cluster spec or its dict."""

    def __init__(
        self,
        server_or_cluster_def: Any = None,
        job_name: str | None = None,
        task_index: int | None = None,
        protocol: str | None = None,
        config: Any = None,
        start: bool = True,
        *,
        cluster_resolver: ClusterResolver | None = None,
    ) -> None:
        del protocol, config  # accepted for TF's signature; one transport here
        if cluster_resolver is not None:  # stratagem's earlier keyword, still accepted
            server_or_cluster_def = cluster_resolver
        if isinstance(server_or_cluster_def, ClusterResolver):
            resolver = server_or_cluster_def
        elif server_or_cluster_def is None:
            resolver = resolve_cluster()
        else:
            resolver = SimpleClusterResolver(
                server_or_cluster_def, task_type=job_name, task_id=task_index or 0
            )
        if job_name is not None and resolver.task_type != job_name:
            raise ValueError(
                f"sg.distribute.Server(job_name={job_name!r}) in a process that is "
                f"{resolver.describe()}"
            )
        spec = resolver.cluster_spec()
        if resolver.task_type == "worker" and not is_coordinated(spec):
            raise ValueError(
                f"sg.distribute.Server on {resolver.describe()}: a worker serves the chief's "
                "ClusterCoordinator, and this cluster has no chief. Without a chief every "
                "worker creates the ParameterServerStrategy and runs the loop itself"
            )
        if resolver.task_type not in ("ps", "worker"):
            raise ValueError(
                "sg.distribute.Server runs on a ps task, or on a worker task of a cluster with a "
                f"chief; this process is {resolver.describe()}"
            )
        self._resolver = resolver
        self._impl: PsTaskServer | WorkerServer | None = None
        if start:
            self.start()

    def start(self) -> None:
        """Listen and join the job (done by the constructor unless ``start=False``)."""
        if self._impl is None:
            if self._resolver.task_type == "ps":
                self._impl = PsTaskServer(self._resolver)
            else:
                self._impl = WorkerServer(self._resolver)

    def join(self) -> NoReturn:
        """Serve until the job is done (ps: every worker finished; worker: the chief said
        goodbye or ended), then end the process with exit status 0.

        TF's ``server.join()`` never returns, and TF scripts rely on it: the chief's code
        often follows ``if task_type in ("worker", "ps"): server.join()`` with no ``else``.
        Returning would run the chief's code on this task (another process claiming the
        chief's place, or a second training loop), so the rest of the script is skipped, as
        creating the strategy on a ps task does."""
        self.start()
        assert self._impl is not None
        self._impl.join()
        raise SystemExit(0)  # the job is done: the rest of the script is not this task's
