"""``PipelineModel``: this process's stages of a split model, trained by one schedule.

Every process of the job calls the same methods with the same global batch; each uses what its
stages need (the first stage the inputs, the last the targets) and the slice of the batch that
belongs to its data-parallel replica. ``train_step`` returns the mean loss on every process.
Running the schedule (and the forward-only pass) is ``stage_runner.py``'s; checkpoints of the
stages and gathering them into the whole model are ``stage_checkpoints.py``'s.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stratagem.comm import Communicator
from stratagem.pipeline.pipedream import LossFn, Recorder
from stratagem.pipeline.schedules import SYNCHRONOUS
from stratagem.pipeline.settings import PipelineSettings
from stratagem.pipeline.shared import Holders, SharedCopies, SharedParameter
from stratagem.pipeline.stage_checkpoints import StageCheckpoints
from stratagem.pipeline.stage_pieces import StagePieces
from stratagem.pipeline.stage_runner import StageRunner

__all__ = ["LossFn", "PipelineModel", "StepStats"]


@dataclass
class StepStats:
    """Seconds of the last ``train_step``: its wall time and this rank's computing time."""

    wall_seconds: float = 0.0
    busy_seconds: float = 0.0

    @property
    def bubble_fraction(self) -> float:
        return 1.0 - self.busy_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0


class PipelineModel:
    """This rank's model chunks, the schedule that trains them, and their checkpoints."""

    def __init__(
        self,
        pieces: StagePieces,
        settings: PipelineSettings,
        *,
        rank: int,
        comm: Communicator,
        loss_fn: LossFn,
        split_points: Sequence[int | str],
        recorder: Recorder | None = None,
        shared: Sequence[SharedParameter] = (),
        shared_groups: Mapping[Holders, dist.ProcessGroup | None] | None = None,
    ) -> None:
        """``pieces``: this rank's chunks and its parameters under the whole model's names
        (slices of a Sequential, or traced stages); ``split_points``: how the model was cut
        (layer indices, or module paths), recorded in checkpoints; ``shared``: the whole
        model's parameters that several stages hold (their copies are kept one parameter),
        ``shared_groups`` the group of each set of holding stages' ranks in this replica
        (``PipelineStrategy.pipeline`` makes them)."""
        layout = settings.layout
        self.layout = layout
        self.rank = rank
        self.stage = layout.stage_of(rank)
        self.replica = layout.replica_of(rank)
        self.schedule_name = settings.schedule
        self.num_microbatches = settings.num_microbatches
        self.loss_fn = loss_fn
        self.split_points = list(split_points)
        self.drain_each_step = settings.drain_each_step
        self.stats = StepStats()
        self._comm = comm
        self._chunk_indices = settings.layout.chunks_of(self.stage)
        self._replica_group = settings.replica_group
        # This rank's parameters under the unsplit model's names ("2.weight", "lm_head.weight"):
        # the optimizer's parameters and the checkpoint's keys.
        self.module = pieces.module
        if layout.num_replicas > 1:
            self._broadcast_from_first_replica()
        shared_copies = SharedCopies(
            self.module,
            shared,
            layout=layout,
            stage=self.stage,
            replica=self.replica,
            groups=shared_groups or {},
        )
        # After the replicas' broadcast: then every copy in every replica is the owner's.
        with comm.named_faults(
            "the broadcast of shared parameters", what=f"stage {self.stage}'s shared copies"
        ):
            shared_copies.broadcast_from_owners()
        self._runner = StageRunner(
            pieces,
            settings,
            stage=self.stage,
            replica=self.replica,
            loss_fn=loss_fn,
            recorder=recorder,
            shared=shared_copies,
        )
        self._checkpoints = StageCheckpoints(
            self.module,
            layout=layout,
            stage=self.stage,
            replica=self.replica,
            split_points=self.split_points,
            schedule_name=settings.schedule,
            comm=comm,
            flush=self._runner.flush,
            shared=shared,
        )

    # ------------------------------------------------------------------ parameters

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (give them to the optimizer)."""
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters, named as in the unsplit model."""
        return self.module.named_parameters()

    def state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> Any:
        return self.module.load_state_dict(state)

    @property
    def is_first_stage(self) -> bool:
        return self._runner.is_first_stage

    @property
    def is_last_stage(self) -> bool:
        return self._runner.is_last_stage

    def __repr__(self) -> str:
        chunks = ", ".join(str(i) for i in self._chunk_indices)
        return (
            f"PipelineModel(stage={self.stage}/{self.layout.num_stages}, replica={self.replica}/"
            f"{self.layout.num_replicas}, chunks=[{chunks}], schedule={self.schedule_name!r}, "
            f"num_microbatches={self.num_microbatches}, layers={list(self.module._modules)})"
        )

    def _broadcast_from_first_replica(self) -> None:
        # Replicas of a stage must start identical whatever each process's seed was.
        src = self.layout.rank_of(self.stage, 0)
        with torch.no_grad():
            for t in [*self.module.parameters(), *self.module.buffers()]:
                dist.broadcast(t, src, group=self._replica_group)

    # ------------------------------------------------------------------ training

    def _replica_slice(self, batch: torch.Tensor | None, what: str) -> torch.Tensor | None:
        if batch is None:
            return None
        n, r, m = batch.shape[0], self.layout.num_replicas, self.num_microbatches
        if n % (r * m) != 0:
            raise ValueError(
                f"the {what} batch of {n} does not split into {r} replica(s) x "
                f"{m} micro-batches: the global batch must be a multiple of "
                f"num_replicas * num_microbatches = {r * m}"
            )
        share = n // r
        return batch[self.replica * share : (self.replica + 1) * share]

    def compute_gradients(self, x: torch.Tensor | None, y: torch.Tensor | None) -> float:
        """Gradients of the mean loss over the batch in this rank's ``.grad``; the mean loss.

        Synchronous schedules only: PipeDream applies each micro-batch's gradients as soon as
        they exist (use ``train_step``).
        """
        if self.schedule_name not in SYNCHRONOUS:
            raise ValueError(
                f"compute_gradients needs a synchronous schedule {SYNCHRONOUS}; "
                f"schedule={self.schedule_name!r} updates the weights after every micro-batch: "
                "call train_step(x, y, optimizer)"
            )
        x, y = self._replica_slice(x, "input"), self._replica_slice(y, "target")
        start = time.perf_counter()
        losses, _, busy = self._schedule(x, y, None, keep_outputs=False)
        loss = self._mean_loss(losses)
        # The wall time ends after the loss's all-reduce, where every stage meets: so each
        # stage's step spans the same period, its idle tail included.
        wall = time.perf_counter() - start
        self.stats = StepStats(wall, busy if busy is not None else wall)
        return loss

    def train_step(
        self, x: torch.Tensor | None, y: torch.Tensor | None, optimizer: torch.optim.Optimizer
    ) -> float:
        """One training step on a global batch; the mean loss over its micro-batches."""
        if self.schedule_name in SYNCHRONOUS:
            loss = self.compute_gradients(x, y)
            optimizer.step()
            return loss
        x, y = self._replica_slice(x, "input"), self._replica_slice(y, "target")
        start = time.perf_counter()
        losses, _, busy = self._schedule(
            x, y, optimizer, keep_outputs=False, drain=self.drain_each_step
        )
        loss = self._mean_loss(losses)
        wall = time.perf_counter() - start  # after the stages meet, as in compute_gradients
        self.stats = StepStats(wall, busy if busy is not None else wall)
        return loss

    def train_replica_batch(
        self,
        x: torch.Tensor | None,
        targets: torch.Tensor | None,
        optimizer: torch.optim.Optimizer,
    ) -> torch.Tensor | None:
        """One training step on this replica's part of the batch, already cut (its size a
        multiple of ``num_microbatches``); the last stage's outputs, None on other stages.

        What ``Model.fit`` runs: no loss is sent around (the model's metrics are read later,
        all at once); ``targets`` are whatever the ``loss_fn`` of this pipeline takes.
        """
        n = (x if x is not None else targets).shape[0]  # type: ignore[union-attr]
        if n % self.num_microbatches:
            raise ValueError(
                f"a replica's batch of {n} does not split into {self.num_microbatches} "
                "micro-batches"
            )
        _, outputs, _ = self._schedule(x, targets, optimizer, keep_outputs=True)
        if self.schedule_name in SYNCHRONOUS:
            optimizer.step()
        return outputs

    def flush(self) -> None:
        """PipeDream without ``drain_each_step``: run the backwards (and updates) of the
        micro-batches still in flight. Every process calls it; nothing to do otherwise. ``save``
        and ``restore`` flush first."""
        with self._named_faults():
            self._runner.flush()

    def _schedule(self, *args: Any, **kwargs: Any) -> tuple:
        """``StageRunner.run``: torch's schedule sends and receives by itself, so a lost or
        stuck stage is named here rather than by a bare gloo error."""
        with self._named_faults():
            return self._runner.run(*args, **kwargs)

    def _named_faults(self) -> contextlib.AbstractContextManager[None]:
        return self._comm.named_faults(
            "the schedule's sends and receives", what=f"stage {self.stage}'s micro-batches"
        )

    def _mean_loss(self, losses: list[float]) -> float:
        """The mean loss over micro-batches and replicas, on every rank (one small all-reduce)."""
        mine = sum(losses) / len(losses) if losses and self.is_last_stage else 0.0
        value = torch.tensor([mine], dtype=torch.float64)
        self._comm.all_reduce(value, what="the pipeline's loss")
        return float(value) / self.layout.num_replicas

    # ------------------------------------------------------------------ inference

    @torch.no_grad()
    def predict(self, x: torch.Tensor | None) -> torch.Tensor:
        """The model's outputs for ``x`` (a whole batch), on every rank of this pipeline.

        Each replica runs the whole batch given to it (no slicing: predictions are not a
        training step). Forward only, one transfer per stage boundary.
        """
        out = self.forward(x, to_every_stage=True)
        assert out is not None
        return out

    @torch.no_grad()
    def forward(self, x: torch.Tensor | None, *, to_every_stage: bool) -> torch.Tensor | None:
        """The model's outputs for ``x`` through this replica's stages, forward only, one
        transfer per stage boundary: on the last stage, and on every stage with
        ``to_every_stage`` (else None there)."""
        return self._runner.forward(x, to_every_stage=to_every_stage)

    # ------------------------------------------------------------------ the whole model

    def gather_module(self, whole: nn.Module) -> None:
        """Load every stage's current layers into ``whole`` (the unsplit model this pipeline
        was cut from, or one like it) on every process. Collective: every process calls it."""
        self._checkpoints.gather_module(whole)

    def gather_optimizer_state(self, whole: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Give ``optimizer`` (over all of ``whole``'s parameters) every stage's state for its
        parameters, on every process. Collective: every process calls it."""
        self._checkpoints.gather_optimizer_state(whole, optimizer)

    # ------------------------------------------------------------------ checkpoints

    def save(
        self,
        path: str,
        optimizer: torch.optim.Optimizer | None = None,
        **tensors: torch.Tensor,
    ) -> str:
        """Save every stage (and its optimizer state) into the checkpoint directory ``path``.

        Collective: every process calls it. Replica 0 of each stage writes
        ``stage-S.pt`` (its layers under the unsplit model's names, its optimizer's state, and
        ``tensors`` such as ``epoch=``), atomically; the stage files of one save together are
        the whole model's state dict. Returns when every stage has written.
        """
        return self._checkpoints.save(path, optimizer, tensors)

    def restore(
        self,
        path: str,
        optimizer: torch.optim.Optimizer | None = None,
        **tensors: torch.Tensor,
    ) -> None:
        """Restore this rank's stages (and optimizer, and ``tensors`` in place) from ``save``."""
        self._checkpoints.restore(path, optimizer, tensors)
