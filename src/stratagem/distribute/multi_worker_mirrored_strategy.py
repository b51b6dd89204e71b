"""MultiWorkerMirroredStrategy: synchronous data parallelism, one process per worker.

1. The cluster comes from TF_CONFIG (or STRATAGEM_CONFIG), torchrun's or SLURM's variables;
   creating the strategy joins the others (a roll call) and starts a process group: gloo on
   CPU, NCCL on CUDA.
2. Scope: parameters and buffers live on this worker's device; at the scope's exit the chief's
   initial values are broadcast after a check that every worker built the same tensors.
3. Backward: gradients are summed over the workers by a ``GradientReducer``, bucket by bucket
   while backward runs, or in one pack when backward ends where the workers fill one host's
   cores (``CommunicationOptions``: ``bytes_per_pack``, ``compression``); inside
   ``accumulate_gradients()`` passes only accumulate. Under ``torch.compile`` dynamo's
   DDPOptimizer splits each graph at bucket boundaries while ``run`` runs.
4. ``run``/``reduce``/``gather``/datasets come from the Strategy base over the communicator.
   The chief and the workers take part; an evaluator runs alone; a ps task is refused.
"""

from __future__ import annotations

import socket
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from stratagem.cluster import ClusterResolver
from stratagem.comm import ReduceOp
from stratagem.comm.bucketing import ONE_PACK, GradientReducer
from stratagem.comm.communicator import Communicator
from stratagem.comm.elastic_member import (
    agent_keeps_survivors,
    await_decision,
    continue_without,
    offer_in_place,
)
from stratagem.comm.process_group import ProcessGroupCommunicator
from stratagem.comm.stragglers import StragglerWatch
from stratagem.comm.stragglers import enabled as stragglers_enabled
from stratagem.config.threading import usable_cpus
from stratagem.distribute.capabilities import DefersGradients
from stratagem.distribute.communication_options import (
    CommunicationImplementation,
    CommunicationOptions,
)
from stratagem.distribute.extended import StrategyExtended
from stratagem.distribute.machinery.worker_job import WorkerJob
from stratagem.distribute.machinery.worker_setup import broadcast_initial_values
from stratagem.distribute.strategy import Strategy


def _backend(options: CommunicationOptions, device: torch.device) -> str:
    impl = options.implementation
    if impl is CommunicationImplementation.NCCL and device.type != "cuda":
        warnings.warn(
            "CommunicationImplementation.NCCL needs CUDA, but this worker computes on the CPU; "
            "using RING (gloo) instead",
            stacklevel=3,
        )
        return "gloo"
    if impl is CommunicationImplementation.RING or device.type != "cuda":
        return "gloo"
    return "cpu:gloo,cuda:nccl"


@dataclass
class _BucketPlan:
    """What dynamo reads of the active DDP module to split a compiled graph at its buckets."""

    bucket_bytes_cap: int


def one_pack_fits(comm: Communicator) -> bool:
    """Whether every process of ``comm`` runs on one host whose cores their intra-op threads
    fill, where one pack beats overlapped buckets (``comm.bucketing`` says why). Every process
    calls this together and gets the same answer (the buckets must pair up)."""
    mine = [socket.gethostname(), torch.get_num_threads(), usable_cpus()]
    everyone = comm.all_gather_object(mine, what="each process's host and threads (packing)")
    hosts = {host for host, _, _ in everyone}
    threads = sum(n for _, n, _ in everyone)
    return len(hosts) == 1 and threads >= min(cores for _, _, cores in everyone)


class MultiWorkerMirroredStrategy(Strategy):
    """``sg.distribute.MultiWorkerMirroredStrategy(communication_options=None)``."""

    def __init__(
        self,
        communication_options: CommunicationOptions | None = None,
        cluster_resolver: ClusterResolver | None = None,
        *,
        gradient_aggregation: ReduceOp | str = ReduceOp.SUM,
    ) -> None:
        super().__init__(
            MultiWorkerMirroredExtended(
                self,
                communication_options,
                cluster_resolver,
                gradient_aggregation=gradient_aggregation,
            )
        )


def _straggler_watch(comm: Communicator) -> StragglerWatch | None:
    """The straggler watch of a world (``comm.stragglers``): none in a world of one or with
    ``STRATAGEM_STRAGGLERS=0``."""
    return StragglerWatch(comm) if comm.world_size > 1 and stragglers_enabled() else None


class MultiWorkerMirroredExtended(StrategyExtended, DefersGradients):
    """One replica per process; gradients all-reduced in buckets during backward."""

    def __init__(
        self,
        container: Strategy,
        communication_options: CommunicationOptions | None,
        cluster_resolver: ClusterResolver | None,
        *,
        gradient_aggregation: ReduceOp | str,
    ) -> None:
        options = communication_options or CommunicationOptions()
        if not isinstance(options, CommunicationOptions):
            raise TypeError(
                "communication_options must be sg.distribute.experimental.CommunicationOptions, "
                f"got {options!r}"
            )
        job = WorkerJob.set_up(
            type(container).__name__,
            ("chief", "worker", "evaluator"),
            cluster_resolver,
            operation_timeout=options.timeout_seconds,
        )
        device = job.device
        # An evaluator, or a cluster of one, gets a local communicator.
        comm = job.communicator(lambda torch_device: _backend(options, torch_device))
        super().__init__(
            container,
            [device],
            comm=comm,
            cluster_resolver=job.resolver,
            gradient_aggregation=gradient_aggregation,
            sync_timeout=job.timeouts.operation,
        )
        # bytes_per_pack=0, TF's "automatic": one pack where the processes fill one host's
        # cores, else DDP's overlapped buckets (comm.bucketing explains and measures).
        one_pack = (
            options.bytes_per_pack == 0
            and device.torch_device.type == "cpu"
            and comm.world_size > 1
            and one_pack_fits(comm)
        )
        sizes = (
            {"first_bucket_bytes": ONE_PACK, "bucket_bytes": ONE_PACK}
            if one_pack
            else {"bucket_bytes": options.bytes_per_pack or (4 << 20)}  # after its 1 MiB first
        )
        self._reducer = GradientReducer(
            comm,
            **sizes,
            average=self.gradient_aggregation is ReduceOp.MEAN,
            compression=options.compression,
        )
        # DDPOptimizer starts with a first bucket of torch's default size (1 MiB, as ours) and
        # refuses later buckets smaller than it. None where there is nothing to cut: a world of
        # one reduces nothing, and one pack overlaps nothing (dynamo compiles one graph).
        self._bucket_plan = (
            None
            if one_pack or comm.world_size == 1
            else _BucketPlan(max(self._reducer.bucket_bytes, self._reducer.first_bucket_bytes))
        )
        self._previous_ddp_module: object = None
        # Each run that synchronised the workers is a step the straggler watch times.
        self._stragglers = _straggler_watch(comm)
        self._collectives_before_run = 0

    @property
    def straggler_watch(self) -> StragglerWatch | None:
        """Names a worker persistently slower than the others (``comm.stragglers``); None in a
        world of one or with ``STRATAGEM_STRAGGLERS=0``."""
        return self._stragglers

    @property
    def gradient_reducer(self) -> GradientReducer:
        """The bucketed all-reduce of this worker's gradients (``OverlapProbe`` watches it)."""
        return self._reducer

    @override
    def adopt(self, tensors: list[tuple[torch.Tensor, bool]]) -> None:
        broadcast_initial_values(
            self._comm,
            [t for t, _ in tensors],
            built="created {n} tensors in strategy.scope()",
            what="the new parameters",
        )
        if self._comm.world_size > 1:
            self._reducer.add_parameters([t for t, is_param in tensors if is_param])
        # A world of one has nothing to reduce: no hooks, no copies into buckets and back (a
        # Python call per parameter in every backward, and two copies of every gradient).

    @override
    def _before_run(self) -> None:
        self._collectives_before_run = self._comm.traffic.collectives
        # torch's own ``replicate`` (composable DDP) sets the same class attribute in its
        # forward: dynamo reads it when it compiles a frame, and splits the graph at buckets
        # of this size (``torch._dynamo.backends.distributed.DDPOptimizer``).
        if self._bucket_plan is not None:
            self._previous_ddp_module = DistributedDataParallel._active_ddp_module
            DistributedDataParallel._active_ddp_module = self._bucket_plan

    @override
    def _leave_run(self) -> None:
        if self._bucket_plan is not None:
            DistributedDataParallel._active_ddp_module = self._previous_ddp_module
            self._previous_ddp_module = None

    @override
    def _after_run(self) -> None:
        self._reducer.flush(deferred=False)
        # Every worker runs the same collectives, so every worker counts the same steps.
        if self._stragglers is not None and (
            self._comm.traffic.collectives > self._collectives_before_run
        ):
            self._stragglers.step_done()

    @override
    def offer_in_place(self) -> bool:
        # Every worker holds the whole state, so the workers left can go on alone.
        comm = self._comm
        if not (isinstance(comm, ProcessGroupCommunicator) and comm.elastic):
            return False
        if not agent_keeps_survivors():  # over several machines, every change restarts
            return False
        offer_in_place(comm.job_store, round=comm.round, rank=comm.rank)
        return True

    @override
    def rejoin(self, state: Sequence[torch.Tensor], committed: int) -> str:
        comm = self._comm
        assert isinstance(comm, ProcessGroupCommunicator)
        decision = await_decision(
            comm.job_store, after=comm.round, timeout_s=comm.timeouts.rendezvous
        )
        continue_without(comm, round=decision.round, lost=decision.lost)
        offer_in_place(comm.job_store, round=comm.round, rank=comm.rank)  # for the next change
        self._reducer.forget_step()
        self._stragglers = _straggler_watch(comm)  # the new world's figures
        # The commit point is the optimizer step after the all-reduce: a survivor may have
        # committed the step the others failed in. The one with the most steps holds the
        # newest state, and every other takes it.
        counts = [
            int(c)
            for c in comm.all_gather(
                torch.tensor([committed], dtype=torch.int64), what="the steps each one committed"
            )
        ]
        newest = max(counts)
        if min(counts) < newest:
            holder = counts.index(newest)
            with torch.no_grad():
                for tensor in state:
                    comm.broadcast(tensor, holder, what="the newest state, from its holder")
        return decision.why

    @override
    def defer_gradient_reduction(self, defer: bool) -> None:
        self._reducer.deferring = defer

    @override
    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._reducer.flush()
