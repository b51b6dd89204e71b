"""PipelineStrategy: pipeline parallelism, one stage per process, optionally data-parallel too.

1. The cluster is resolved and the process group started as for MultiWorkerMirroredStrategy
   (``stratagem run -n N``, TF_CONFIG, torchrun, SLURM); the job must have
   ``num_stages x num_replicas`` processes. Rank ``r`` runs stage ``r % num_stages`` of replica
   ``r // num_stages`` (``stratagem.pipeline.layout``).
2. ``strategy.pipeline(model, loss_fn)`` cuts an ``nn.Sequential`` at ``split_points`` (layer
   indices or names) or balanced by parameter count or measured time, keeps this rank's stage,
   and returns a ``PipelineModel`` whose ``train_step(x, y, optimizer)`` runs the schedule:
   ``"GPipe"``, ``"1F1B"``, ``"Interleaved1F1B"`` (torch.distributed.pipelining), or
   ``"PipeDream"`` (asynchronous 1F1B with weight stashing, ``stratagem.pipeline.pipedream``).
3. With ``num_replicas > 1`` each stage's gradients are averaged over its replicas.

A world of one process with one stage is the null version: the same calls, micro-batches run
one after another in this process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from stratagem.cluster import ClusterResolver, check_task_types, resolve_cluster
from stratagem.comm import Communicator, LocalCommunicator, set_distribution_context
from stratagem.comm.process_group import Timeouts, connect
from stratagem.pipeline.layout import PipelineLayout
from stratagem.pipeline.model import LossFn, PipelineModel
from stratagem.pipeline.pipedream import Recorder
from stratagem.pipeline.schedules import SYNCHRONOUS
from stratagem.pipeline.split import SplitPoints, resolve_split_points, split_sequential

SCHEDULES = (*SYNCHRONOUS, "PipeDream")


class PipelineStrategy:
    """``sg.distribute.experimental.PipelineStrategy(num_stages=None, schedule="1F1B", ...)``.

    ``num_stages``: stages per pipeline (default: the job's processes / ``num_replicas``);
    ``num_microbatches``: micro-batches per global batch (it must divide it);
    ``schedule``: one of ``SCHEDULES``; ``split_points``: layer indices or names starting each
    stage after the first, or ``"parameters"`` / ``"time"`` to balance (default parameters);
    ``num_replicas``: data-parallel copies of the pipeline; ``stages_per_rank``: model chunks
    per process for ``"Interleaved1F1B"`` (default 2); ``weight_stashing``: PipeDream only.
    """

    def __init__(
        self,
        num_stages: int | None = None,
        *,
        schedule: str = "1F1B",
        num_microbatches: int = 4,
        split_points: SplitPoints = None,
        num_replicas: int = 1,
        stages_per_rank: int | None = None,
        weight_stashing: bool = True,
        cluster_resolver: ClusterResolver | None = None,
        timeout_seconds: float | None = None,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r}: expected one of {SCHEDULES}")
        if (
            isinstance(num_microbatches, bool)
            or not isinstance(num_microbatches, int)
            or num_microbatches < 1
        ):
            raise ValueError(f"num_microbatches must be an int >= 1, got {num_microbatches!r}")
        if stages_per_rank is None:
            stages_per_rank = 2 if schedule == "Interleaved1F1B" else 1
        if stages_per_rank != 1 and schedule != "Interleaved1F1B":
            raise ValueError(
                f"stages_per_rank={stages_per_rank} needs schedule='Interleaved1F1B' (got "
                f"{schedule!r}, which runs one stage per process)"
            )
        resolver = cluster_resolver if cluster_resolver is not None else resolve_cluster()
        check_task_types(resolver.cluster_spec(), ("chief", "worker"), type(self).__name__)
        world = resolver.world_size if resolver.rank is not None else 1
        if num_stages is None:
            if not isinstance(num_replicas, int) or num_replicas < 1 or world % num_replicas:
                raise ValueError(
                    f"num_replicas={num_replicas!r} does not divide the job's {world} processes"
                )
            num_stages = world // num_replicas
        layout = PipelineLayout(num_stages, num_replicas, stages_per_rank)
        layout.check_world(world)
        if schedule in ("1F1B", "Interleaved1F1B") and num_microbatches < num_stages:
            raise ValueError(
                f"schedule={schedule!r} needs num_microbatches >= num_stages, got "
                f"num_microbatches={num_microbatches} for {num_stages} stages (use 'GPipe', or "
                "more micro-batches)"
            )
        self._layout = layout
        self._schedule = schedule
        self._num_microbatches = num_microbatches
        self._split_points = split_points
        self._weight_stashing = weight_stashing
        self._resolver = resolver
        timeouts = Timeouts.from_env(timeout_seconds)
        self._timeout = timeouts.operation
        comm: Communicator
        if world == 1:
            comm = LocalCommunicator()
        else:
            comm = connect(resolver, backend="gloo", timeouts=timeouts)
        self._comm = comm
        self.rank = comm.rank
        self._pipeline_group: dist.ProcessGroup | None = None
        self._replica_group: dist.ProcessGroup | None = None
        if world > 1 and layout.num_replicas > 1:
            # Every rank creates every group, in the same order (torch.distributed's rule).
            for r in range(layout.num_replicas):
                group = dist.new_group(layout.pipeline_ranks(r))
                if r == layout.replica_of(self.rank):
                    self._pipeline_group = group
            for s in range(layout.num_stages):
                group = dist.new_group(layout.replica_ranks(s))
                if s == layout.stage_of(self.rank):
                    self._replica_group = group
        set_distribution_context(
            strategy=type(self).__name__,
            num_replicas_in_sync=layout.num_replicas,
            num_stages=layout.num_stages,
            schedule=schedule,
        )

    # ------------------------------------------------------------------ properties

    @property
    def num_stages(self) -> int:
        return self._layout.num_stages

    @property
    def num_replicas_in_sync(self) -> int:
        """Data-parallel copies of the pipeline (1 without data parallelism)."""
        return self._layout.num_replicas

    @property
    def stage_index(self) -> int:
        return self._layout.stage_of(self.rank)

    @property
    def replica_index(self) -> int:
        return self._layout.replica_of(self.rank)

    @property
    def layout(self) -> PipelineLayout:
        return self._layout

    @property
    def cluster_resolver(self) -> ClusterResolver:
        return self._resolver

    @property
    def schedule(self) -> str:
        return self._schedule

    @property
    def num_microbatches(self) -> int:
        return self._num_microbatches

    def __repr__(self) -> str:
        return (
            f"PipelineStrategy(num_stages={self.num_stages}, num_replicas="
            f"{self.num_replicas_in_sync}, schedule={self._schedule!r}, num_microbatches="
            f"{self._num_microbatches}, rank={self.rank})"
        )

    # ------------------------------------------------------------------ the pipeline

    def split_points_for(
        self, model: nn.Module, sample_input: torch.Tensor | None = None
    ) -> list[int]:
        """The layer indices where the chunks after the first start, for this model."""
        points = resolve_split_points(
            model, self._layout.num_chunks, self._split_points, sample_input
        )
        if self._comm.world_size > 1 and self._split_points == "time":
            # Timings differ between processes; every rank must cut the same way: rank 0's.
            points = self._comm.all_gather_object(points, what="the measured split points")[0]
        return points

    def pipeline(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        *,
        sample_input: torch.Tensor | None = None,
        recorder: Recorder | None = None,
    ) -> PipelineModel:
        """Split ``model`` and keep this process's stage(s); every process calls it alike.

        ``loss_fn(outputs, targets)`` is a mean over its micro-batch (``F.cross_entropy``);
        ``sample_input`` (one micro-batch) is needed with ``split_points="time"``.
        """
        layout = self._layout
        points = self.split_points_for(model, sample_input)
        chunks = split_sequential(model, points)
        stage = layout.stage_of(self.rank)
        mine = [(c, chunks[c]) for c in layout.chunks_of(stage)]
        return PipelineModel(
            mine,
            layout=layout,
            rank=self.rank,
            comm=self._comm,
            schedule=self._schedule,
            num_microbatches=self._num_microbatches,
            loss_fn=loss_fn,
            weight_stashing=self._weight_stashing,
            timeout=self._timeout,
            pipeline_group=self._pipeline_group,
            replica_group=self._replica_group,
            split_points=points,
            recorder=recorder,
        )
