"""PipelineStrategy: pipeline parallelism, one stage per process, optionally data-parallel too.

1. Cluster and process group as for MultiWorkerMirroredStrategy; the job has ``num_stages x
   num_replicas`` processes, rank ``r`` running stage ``r % num_stages`` of replica
   ``r // num_stages`` (``stratagem.pipeline.stage_layout``).
2. ``strategy.pipeline(model, loss_fn)`` cuts an ``nn.Sequential`` at ``split_points`` (or
   balanced), or traces any other model and cuts it at module paths (``pipeline.trace``), and
   returns a ``PipelineModel`` whose ``train_step`` runs the schedule: ``"GPipe"``, ``"1F1B"``,
   ``"Interleaved1F1B"`` (torch's) or ``"PipeDream"`` (``pipeline.pipedream``).
3. With ``num_replicas > 1`` each stage's gradients are averaged over its replicas; a parameter
   tied across stages stays one (``pipeline.shared``; PipeDream refuses it).
4. ``sg.keras.Model`` trains through ``keras.pipeline_steps``; checkpoints of its registered
   whole model gather every stage first (``before_checkpoint_write``, a collective).
5. A world of one process and one stage is the null version: micro-batches run one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import override

from stratagem.cluster import ClusterResolver
from stratagem.comm import ReduceOp
from stratagem.comm.process_group import new_groups
from stratagem.distribute.capabilities import DefersGradients, PipelinedSteps
from stratagem.distribute.extended import StrategyExtended
from stratagem.distribute.machinery.worker_job import WorkerJob
from stratagem.distribute.strategy import Strategy
from stratagem.pipeline.pipedream import Recorder
from stratagem.pipeline.schedules import SYNCHRONOUS
from stratagem.pipeline.settings import PipelineSettings
from stratagem.pipeline.shared import (
    Holders,
    SharedParameter,
    check_schedule,
    find_shared_parameters,
    shared_between_stages,
)
from stratagem.pipeline.split import SplitPoints, resolve_split_points, split_sequential
from stratagem.pipeline.stage_layout import PipelineLayout
from stratagem.pipeline.stage_pieces import SequentialPieces, StagePieces
from stratagem.pipeline.stages import LossFn, PipelineModel
from stratagem.pipeline.trace import TracedPieces, check_module_paths, suggest_split_points

SCHEDULES = (*SYNCHRONOUS, "PipeDream")


class PipelineStrategy(Strategy):
    """``sg.distribute.experimental.PipelineStrategy(num_stages=None, schedule="1F1B", ...)``.

    ``num_stages``: stages per pipeline (default: the job's processes / ``num_replicas``);
    ``num_microbatches``: micro-batches per global batch (it must divide it);
    ``schedule``: one of ``SCHEDULES``; ``split_points``: layer indices or names starting each
    stage after the first, or ``"parameters"`` / ``"time"`` to balance (default parameters), for
    an ``nn.Sequential``; for any other model, module paths whose call starts each stage after
    the first (``["transformer.h.1"]``: the model is traced, see ``pipeline``);
    ``num_replicas``: data-parallel copies of the pipeline; ``stages_per_rank``: model chunks
    per process for ``"Interleaved1F1B"`` (default 2); ``weight_stashing``: PipeDream only;
    ``drain_each_step``: PipeDream only, False keeps the warm-up micro-batches in flight from
    one ``train_step`` to the next, as PipeDream does (``pipe.flush()`` drains; ``Model.fit``
    drains every step).
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
        drain_each_step: bool = True,
        cluster_resolver: ClusterResolver | None = None,
        timeout_seconds: float | None = None,
    ) -> None:
        extended = PipelineExtended(
            self,
            num_stages,
            schedule=schedule,
            num_microbatches=num_microbatches,
            split_points=split_points,
            num_replicas=num_replicas,
            stages_per_rank=stages_per_rank,
            weight_stashing=weight_stashing,
            drain_each_step=drain_each_step,
            cluster_resolver=cluster_resolver,
            timeout_seconds=timeout_seconds,
        )
        super().__init__(extended)
        self._pipeline = extended

    # ------------------------------------------------------------------ properties

    @property
    def rank(self) -> int:
        """This process's rank in the job (its stage and replica: ``layout``)."""
        return self._pipeline.communicator.rank

    @property
    def num_stages(self) -> int:
        return self._pipeline.layout.num_stages

    @property
    def stage_index(self) -> int:
        return self._pipeline.layout.stage_of(self.rank)

    @property
    def replica_index(self) -> int:
        return self._pipeline.layout.replica_of(self.rank)

    @property
    def layout(self) -> PipelineLayout:
        return self._pipeline.layout

    @property
    def schedule(self) -> str:
        return self._pipeline.settings.schedule

    @property
    def num_microbatches(self) -> int:
        return self._pipeline.num_microbatches

    def __repr__(self) -> str:
        return (
            f"PipelineStrategy(num_stages={self.num_stages}, num_replicas="
            f"{self.num_replicas_in_sync}, schedule={self.schedule!r}, num_microbatches="
            f"{self.num_microbatches}, rank={self.rank})"
        )

    # ------------------------------------------------------------------ the pipeline

    def split_points_for(
        self,
        model: nn.Module,
        sample_input: torch.Tensor | None = None,
        split_points: SplitPoints = None,
    ) -> list[int]:
        """The layer indices where the chunks after the first start, for this ``nn.Sequential``
        (``split_points``: instead of the strategy's)."""
        return self._pipeline.split_points_for(model, sample_input, split_points)

    def pipeline(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        *,
        sample_input: torch.Tensor | None = None,
        recorder: Recorder | None = None,
        split_points: SplitPoints = None,
    ) -> PipelineModel:
        """Split ``model`` and keep this process's stage(s); every process calls it alike.

        ``loss_fn(outputs, targets)`` is a mean over its micro-batch (``F.cross_entropy``);
        ``split_points`` replaces the strategy's for this model. An ``nn.Sequential`` is cut
        between its layers; any other model is traced by ``torch.export`` and cut where the
        modules named by ``split_points`` are called, which needs ``sample_input`` (one
        micro-batch of inputs: the tracer runs the model on it). ``sample_input`` is needed
        with ``split_points="time"`` too.
        """
        return self._pipeline.pipeline(
            model, loss_fn, sample_input, recorder=recorder, split_points=split_points
        )


class PipelineExtended(StrategyExtended, PipelinedSteps, DefersGradients):
    """Stages on processes: no replicas of one model to ``run`` on (see
    ``replica_steps_refused``); whole models whose checkpoints gather the stages. Builds the
    layout and the groups, splits and traces models, and keeps the groups of stages that share
    parameters."""

    def __init__(
        self,
        container: Strategy,
        num_stages: int | None,
        *,
        schedule: str,
        num_microbatches: int,
        split_points: SplitPoints,
        num_replicas: int,
        stages_per_rank: int | None,
        weight_stashing: bool,
        drain_each_step: bool,
        cluster_resolver: ClusterResolver | None,
        timeout_seconds: float | None,
    ) -> None:
        stages_per_rank = _check_arguments(
            schedule, num_microbatches, stages_per_rank, drain_each_step
        )
        job = WorkerJob.set_up(
            type(container).__name__,
            ("chief", "worker"),
            cluster_resolver,
            operation_timeout=timeout_seconds,
            on_gpu=False,
        )
        layout = _layout(job.world_size, num_stages, num_replicas, stages_per_rank)
        if schedule in ("1F1B", "Interleaved1F1B") and num_microbatches < layout.num_stages:
            raise ValueError(
                f"schedule={schedule!r} needs num_microbatches >= num_stages, got "
                f"num_microbatches={num_microbatches} for {layout.num_stages} stages (use "
                "'GPipe', or more micro-batches)"
            )
        comm = job.communicator("gloo")
        # One CPU device per process; gradients are averaged over replicas (each micro-batch's
        # loss is a mean), which Model.compute_loss reads from gradient_aggregation.
        super().__init__(
            container,
            [job.device],
            comm=comm,
            cluster_resolver=job.resolver,
            gradient_aggregation=ReduceOp.MEAN,
        )
        self._layout = layout
        self._split_points = split_points
        pipeline_group, replica_group = _stage_groups(layout, comm.rank, comm.world_size)
        self._settings = PipelineSettings(
            layout=layout,
            schedule=schedule,
            num_microbatches=num_microbatches,
            weight_stashing=weight_stashing,
            drain_each_step=drain_each_step,
            timeout=job.timeouts.operation,
            pipeline_group=pipeline_group,
            replica_group=replica_group,
        )
        # Groups of the stages that share parameters, by their ranks: made once, kept for every
        # model this strategy cuts alike.
        self._shared_groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        # id(module) -> (the whole module, its pipeline): models whose checkpoints gather stages.
        self._whole_models: dict[int, tuple[nn.Module, PipelineModel]] = {}

    @property
    def layout(self) -> PipelineLayout:
        """Which stage and replica each rank runs."""
        return self._layout

    @property
    def settings(self) -> PipelineSettings:
        """How this strategy's pipelines run: the schedule, its options and the groups."""
        return self._settings

    @property
    @override
    def num_replicas_in_sync(self) -> int:
        """Data-parallel copies of the pipeline (1 without data parallelism)."""
        return self._layout.num_replicas

    @override
    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "num_stages": self._layout.num_stages,
            "schedule": self._settings.schedule,
        }

    # ------------------------------------------------------------------ the pipeline

    @property
    @override
    def num_microbatches(self) -> int:
        return self._settings.num_microbatches

    def split_points_for(
        self,
        model: nn.Module,
        sample_input: torch.Tensor | None = None,
        split_points: SplitPoints = None,
    ) -> list[int]:
        """``PipelineStrategy.split_points_for``: where this ``nn.Sequential``'s chunks after
        the first start."""
        spec = split_points if split_points is not None else self._split_points
        points = resolve_split_points(model, self._layout.num_chunks, spec, sample_input)
        if self._comm.world_size > 1 and spec == "time":
            # Timings differ between processes; every rank must cut the same way: rank 0's.
            points = self._comm.all_gather_object(points, what="the measured split points")[0]
        return points

    @override
    def pipeline(
        self,
        module: nn.Module,
        loss_fn: LossFn,
        sample_input: torch.Tensor | None = None,
        *,
        recorder: Recorder | None = None,
        split_points: SplitPoints = None,
    ) -> PipelineModel:
        """``PipelineStrategy.pipeline``: ``module`` split, this process's stage(s) kept."""
        layout = self._layout
        pieces: StagePieces
        points: list[int] | list[str]
        if isinstance(module, nn.Sequential):
            points = self.split_points_for(module, sample_input, split_points)
            chunks = split_sequential(module, points)
            # Found on the whole model, by identity: after the split each stage sees its own uses.
            shared = find_shared_parameters(module, points, layout)
            check_schedule(shared, self._settings.schedule)
            stage = layout.stage_of(self._comm.rank)
            pieces = SequentialPieces([(c, chunks[c]) for c in layout.chunks_of(stage)])
        else:
            spec = split_points if split_points is not None else self._split_points
            points, pieces, shared = self._traced(module, spec, sample_input)
        return PipelineModel(
            pieces,
            self._settings,
            rank=self._comm.rank,
            comm=self._comm,
            loss_fn=loss_fn,
            split_points=points,
            recorder=recorder,
            shared=shared,
            shared_groups=self._groups_sharing(shared),
        )

    def _traced(
        self, model: nn.Module, spec: SplitPoints, sample_input: torch.Tensor | None
    ) -> tuple[list[str], TracedPieces, list[SharedParameter]]:
        """A model that is not a Sequential: traced, cut at module paths; this rank's chunks,
        and the parameters its stages share (tied embeddings), kept one as for a Sequential."""
        layout, name = self._layout, type(model).__name__
        if self._settings.schedule == "PipeDream":
            raise ValueError(
                f"schedule='PipeDream' cannot run {name}, which is not an nn.Sequential: "
                "PipeDream's stages pass one tensor of any batch size, traced stages pass "
                "several of the traced shapes; use 'GPipe', '1F1B' or 'Interleaved1F1B', or "
                "write the model as an nn.Sequential of its stages"
            )
        if spec is None and layout.num_chunks > 1:
            raise ValueError(
                f"{name} is not an nn.Sequential: give split_points, the module paths whose "
                f"call starts each of the {layout.num_chunks - 1} stage(s) after the first "
                f"({suggest_split_points(model, layout.num_chunks)}); balancing by parameters "
                "or time needs an nn.Sequential"
            )
        points = check_module_paths(model, [] if spec is None else spec, layout.num_chunks)
        if sample_input is None:
            raise ValueError(
                f"{name} is not an nn.Sequential, so it is traced (torch.export) to be split "
                "at module paths, which runs it: pass sample_input= (one micro-batch of inputs)"
            )
        stage = layout.stage_of(self._comm.rank)
        pieces = TracedPieces(
            model,
            points,
            sample_input,
            num_chunks=layout.num_chunks,
            mine=layout.chunks_of(stage),
        )
        return points, pieces, shared_between_stages(model, pieces.chunk_of_name(), layout)

    def _groups_sharing(
        self, shared: Sequence[SharedParameter]
    ) -> dict[Holders, dist.ProcessGroup | None]:
        """For each set of stages that hold copies of a shared parameter, the group of their
        ranks in this rank's replica (None: the whole job). Every rank creates every replica's
        groups, in the same order (torch.distributed's rule)."""
        layout, rank, world = self._layout, self._comm.rank, self._comm.world_size
        wanted = [
            (stages, tuple(layout.rank_of(s, r) for s in stages))
            for stages in dict.fromkeys(s.stages for s in shared)
            for r in range(layout.num_replicas)
        ]
        new = [
            ranks
            for ranks in dict.fromkeys(ranks for _, ranks in wanted)
            if len(ranks) < world and ranks not in self._shared_groups
        ]
        if new:
            self._shared_groups.update(zip(new, new_groups(new, timeout=self._settings.timeout)))
        return {stages: self._shared_groups.get(ranks) for stages, ranks in wanted if rank in ranks}

    # ------------------------------------------------------------------ whole models
    @override
    def register_whole_model(self, module: nn.Module, pipe: PipelineModel) -> None:
        """Checkpoints of ``module`` (the whole model, kept on every process) will first gather
        every stage's layers into it, and the optimizer state of optimizers over its parameters,
        on every process: a collective (``before_checkpoint_write``)."""
        self._whole_models[id(module)] = (module, pipe)

    def pipeline_of(self, module: nn.Module) -> PipelineModel | None:
        """This process's stages of a registered whole model (None if it is not one)."""
        entry = self._whole_models.get(id(module))
        return entry[1] if entry is not None and entry[0] is module else None

    @override
    def before_checkpoint_write(self, objects: list[object]) -> None:
        """On every process, in the same order: every stage's layers into each registered
        whole module, and its optimizer state into an optimizer over it, so the chief writes
        the whole model and a restore gives each stage its part."""
        for obj in objects:
            if isinstance(obj, nn.Module):
                pipe = self.pipeline_of(obj)
                if pipe is not None:
                    pipe.gather_module(obj)
            elif isinstance(obj, torch.optim.Optimizer):
                params = {id(p) for group in obj.param_groups for p in group["params"]}
                for module, pipe in self._whole_models.values():
                    if any(id(p) in params for p in module.parameters()):
                        pipe.gather_optimizer_state(module, obj)

    # ------------------------------------------------------------------ the Strategy interface

    @override
    def _splits_global_batches(self) -> bool:
        # Every process gets each whole global batch: the first stage uses the inputs, the
        # last the targets, each replica its part (cut by the pipeline).
        return False

    # ------------------------------------------------------------------ capabilities

    @override
    def replica_steps_refused(self, what: str) -> str:
        return (
            f"PipelineStrategy.{what}: a pipeline's processes hold different stages, not "
            "replicas of one model; train with sg.keras.Model.fit in strategy.scope(), or with "
            "strategy.pipeline(module, loss_fn) and its train_step"
        )

    @override
    def defer_gradient_reduction(self, defer: bool) -> None:
        if defer:
            raise NotImplementedError(
                "PipelineStrategy cannot defer its gradient reduction (accumulate_gradients(), "
                "gradient_accumulation_steps): a pipeline already accumulates the gradients of "
                "its num_microbatches micro-batches and reduces them once per step; raise "
                "num_microbatches (with the batch) instead"
            )

    @override
    def adopt(self, tensors: list[tuple[torch.Tensor, bool]]) -> None:
        """Nothing at the scope's end: every process builds the whole model alike, and
        ``pipeline`` cuts it into stages (checking that the stages start equal)."""

    @override
    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing: the schedule combines the gradients (micro-batches, replicas, shared
        parameters) before it returns."""


def _check_arguments(
    schedule: str, num_microbatches: int, stages_per_rank: int | None, drain_each_step: bool
) -> int:
    """The schedule's options checked, each error naming the value received; returns the
    stages per rank (2 for ``"Interleaved1F1B"`` unless given, else 1)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: expected one of {SCHEDULES}")
    if (
        isinstance(num_microbatches, bool)
        or not isinstance(num_microbatches, int)
        or num_microbatches < 1
    ):
        raise ValueError(f"num_microbatches must be an int >= 1, got {num_microbatches!r}")
    if not drain_each_step and schedule != "PipeDream":
        raise ValueError(
            f"drain_each_step=False needs schedule='PipeDream' (got {schedule!r}, a "
            "synchronous schedule, which drains at the end of every step by definition)"
        )
    if stages_per_rank is None:
        stages_per_rank = 2 if schedule == "Interleaved1F1B" else 1
    if stages_per_rank != 1 and schedule != "Interleaved1F1B":
        raise ValueError(
            f"stages_per_rank={stages_per_rank} needs schedule='Interleaved1F1B' (got "
            f"{schedule!r}, which runs one stage per process)"
        )
    return stages_per_rank


def _layout(
    world: int, num_stages: int | None, num_replicas: int, stages_per_rank: int
) -> PipelineLayout:
    """Stages and replicas over the job's ``world`` processes (checked to fill it)."""
    if num_stages is None:
        if not isinstance(num_replicas, int) or num_replicas < 1 or world % num_replicas:
            raise ValueError(
                f"num_replicas={num_replicas!r} does not divide the job's {world} processes"
            )
        num_stages = world // num_replicas
    layout = PipelineLayout(num_stages, num_replicas, stages_per_rank)
    layout.check_world(world)
    return layout


def _stage_groups(
    layout: PipelineLayout, rank: int, world: int
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This rank's pipeline group (its replica's stages) and replica group (its stage's
    replicas): None without data parallelism. Every rank creates every group, in order."""
    if world == 1 or layout.num_replicas == 1:
        return None, None
    pipelines = [layout.pipeline_ranks(r) for r in range(layout.num_replicas)]
    replicas = [layout.replica_ranks(s) for s in range(layout.num_stages)]
    groups = new_groups([*pipelines, *replicas])
    return groups[layout.replica_of(rank)], groups[len(pipelines) + layout.stage_of(rank)]
