"""``WorkerJob``: this process's place in the job, made and checked once by every strategy whose
replicas are processes (and by a ps task's server).

``WorkerJob.set_up`` resolves the cluster (or takes the resolver given), refuses the task types
the strategy cannot use (naming the strategy), picks the device this process computes on (its
local rank's GPU, or the CPU), and reads the timeouts, in that order. ``communicator(backend)``
then makes the job's connection: a local one for a process with no peer to meet (an evaluator,
a job of one), else the process group. What the callers differ in (the task types, GPU or CPU,
the backend) are parameters, never copies of this code.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from stratagem.cluster import ClusterResolver, check_task_types, resolve_cluster
from stratagem.comm import Communicator, LocalCommunicator
from stratagem.comm.process_group import Timeouts, connect, use_local_gpu
from stratagem.distribute.machinery.replica_devices import ReplicaDevice

CPU = ReplicaDevice("cpu:0", torch.device("cpu"))


@dataclass(frozen=True)
class WorkerJob:
    """The resolved cluster, this process's device and the job's timeouts."""

    resolver: ClusterResolver
    device: ReplicaDevice
    timeouts: Timeouts

    @classmethod
    def set_up(
        cls,
        strategy: str,
        task_types: Collection[str] | None,
        cluster_resolver: ClusterResolver | None = None,
        *,
        operation_timeout: float | None = None,
        on_gpu: bool = True,
    ) -> WorkerJob:
        """This process's job, set up by ``strategy`` (the name its errors give):
        ``task_types`` are the jobs the cluster may have (None: any); ``operation_timeout``
        replaces STRATAGEM_OP_TIMEOUT; ``on_gpu=False`` computes on the CPU even where there
        are GPUs."""
        resolver = cluster_resolver if cluster_resolver is not None else resolve_cluster()
        if task_types is not None:
            check_task_types(resolver.cluster_spec(), task_types, strategy)
        device = _local_gpu(resolver) if on_gpu else None
        return cls(resolver, device or CPU, Timeouts.from_env(operation_timeout))

    @property
    def has_peers(self) -> bool:
        """Whether this process meets others in collectives: a chief or worker of a job of
        more than one process (an evaluator, or a job of one, has no peer to meet)."""
        return self.resolver.rank is not None and self.resolver.world_size > 1

    @property
    def world_size(self) -> int:
        """The processes that meet in collectives: the job's, or 1 where there is no peer."""
        return self.resolver.world_size if self.has_peers else 1

    def communicator(self, backend: str | Callable[[torch.device], str] = "gloo") -> Communicator:
        """This process's connection to the job: ``backend`` names the process group's backend
        (or says it for this process's device); a local one where there is no peer."""
        if not self.has_peers:
            return LocalCommunicator()
        name = backend(self.device.torch_device) if callable(backend) else backend
        return connect(self.resolver, backend=name, timeouts=self.timeouts)


def _local_gpu(resolver: ClusterResolver) -> ReplicaDevice | None:
    """This process's local rank's GPU, made the current device; None where there is none."""
    index = use_local_gpu(resolver)
    return None if index is None else ReplicaDevice(f"cuda:{index}", torch.device("cuda", index))
