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

import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from typing_extensions import override

from stratagem.cluster import ClusterResolver, check_task_types, resolve_cluster
from stratagem.comm import Communicator, LocalCommunicator, ReduceOp
from stratagem.comm.process_group import Timeouts, connect, live_connection
from stratagem.distribute.capabilities import DefersGradients, PipelinedSteps
from stratagem.distribute.extended import StrategyExtended
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
        self._split_points = split_points
        timeouts = Timeouts.from_env(timeout_seconds)
        comm: Communicator
        if world == 1:
            comm = LocalCommunicator()
        else:
            comm = connect(resolver, backend="gloo", timeouts=timeouts)
        super().__init__(PipelineExtended(self, layout, schedule, comm, resolver))
        self.rank = comm.rank
        self._comm = comm
        pipeline_group = replica_group = None
        if world > 1 and layout.num_replicas > 1:
            # Every rank creates every group, in the same order (torch.distributed's rule).
            for r in range(layout.num_replicas):
                group = dist.new_group(layout.pipeline_ranks(r))
                if r == layout.replica_of(self.rank):
                    pipeline_group = group
            for s in range(layout.num_stages):
                group = dist.new_group(layout.replica_ranks(s))
                if s == layout.stage_of(self.rank):
                    replica_group = group
            # New groups open new gloo connections: each proves the job's secret.
            job = live_connection()
            if job is not None:
                job.prove_group(pipeline_group)
                job.prove_group(replica_group)
        self._settings = PipelineSettings(
            layout=layout,
            schedule=schedule,
            num_microbatches=num_microbatches,
            weight_stashing=weight_stashing,
            drain_each_step=drain_each_step,
            timeout=timeouts.operation,
            pipeline_group=pipeline_group,
            replica_group=replica_group,
        )
        # Groups of the stages that share parameters, by their ranks: made once, kept for every
        # model this strategy cuts alike.
        self._shared_groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}

    # ------------------------------------------------------------------ properties

    @property
    def num_stages(self) -> int:
        return self._layout.num_stages

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
    def schedule(self) -> str:
        return self._settings.schedule

    @property
    def num_microbatches(self) -> int:
        return self._settings.num_microbatches

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
        spec = split_points if split_points is not None else self._split_points
        points = resolve_split_points(model, self._layout.num_chunks, spec, sample_input)
        if self._comm.world_size > 1 and spec == "time":
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
        layout = self._layout
        pieces: StagePieces
        points: list[int] | list[str]
        if isinstance(model, nn.Sequential):
            points = self.split_points_for(model, sample_input, split_points)
            chunks = split_sequential(model, points)
            # Found on the whole model, by identity: after the split each stage sees its own uses.
            shared = find_shared_parameters(model, points, layout)
            check_schedule(shared, self._settings.schedule)
            stage = layout.stage_of(self.rank)
            pieces = SequentialPieces([(c, chunks[c]) for c in layout.chunks_of(stage)])
        else:
            spec = split_points if split_points is not None else self._split_points
            points, pieces, shared = self._traced(model, spec, sample_input)
        return PipelineModel(
            pieces,
            self._settings,
            rank=self.rank,
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
        stage = layout.stage_of(self.rank)
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
        groups, in the same order (torch.distributed's rule), then proves its own."""
        layout, world = self._layout, self._comm.world_size
        mine: dict[Holders, dist.ProcessGroup | None] = {}
        new: list[dist.ProcessGroup] = []
        for stages in dict.fromkeys(s.stages for s in shared):
            for r in range(layout.num_replicas):
                ranks = tuple(layout.rank_of(s, r) for s in stages)
                if len(ranks) < world and ranks not in self._shared_groups:
                    timeout = datetime.timedelta(seconds=self._settings.timeout)
                    group = dist.new_group(list(ranks), timeout=timeout)
                    self._shared_groups[ranks] = group
                    if self.rank in ranks:
                        new.append(group)
                if self.rank in ranks:
                    mine[stages] = self._shared_groups.get(ranks)
        # New groups open new gloo connections: each proves the job's secret.
        job = live_connection()
        for group in new if job is not None else ():
            job.prove_group(group)
        return mine


class PipelineExtended(StrategyExtended, PipelinedSteps, DefersGradients):
    """Stages on processes: no replicas of one model to ``run`` on (see ``_refuse``); whole
    models whose checkpoints gather the stages."""

    def __init__(
        self,
        container: Strategy,
        layout: PipelineLayout,
        schedule: str,
        comm: Communicator,
        resolver: ClusterResolver,
    ) -> None:
        # One CPU device per process; gradients are averaged over replicas (each micro-batch's
        # loss is a mean), which Model.compute_loss reads from gradient_aggregation.
        super().__init__(
            container,
            ["cpu:0"],
            comm=comm,
            cluster_resolver=resolver,
            gradient_aggregation=ReduceOp.MEAN,
        )
        self._layout = layout
        self._schedule = schedule
        # id(module) -> (the whole module, its pipeline): models whose checkpoints gather stages.
        self._whole_models: dict[int, tuple[nn.Module, PipelineModel]] = {}

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
            "schedule": self._schedule,
        }

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

    @property
    @override
    def num_microbatches(self) -> int:
        return self._pipeline_strategy().num_microbatches

    @override
    def pipeline(self, module: nn.Module, loss_fn: Any, sample_input: Any = None) -> PipelineModel:
        return self._pipeline_strategy().pipeline(module, loss_fn, sample_input=sample_input)

    def _pipeline_strategy(self) -> PipelineStrategy:
        strategy = self.strategy
        assert isinstance(strategy, PipelineStrategy)
        return strategy

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
