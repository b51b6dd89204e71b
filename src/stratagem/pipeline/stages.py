"""``PipelineModel``: this process's stages of a split model, trained by one schedule.

Every process of the job calls the same methods with the same global batch; each uses what its
stages need (the first stage the inputs, the last the targets) and the slice of the batch that
belongs to its data-parallel replica. ``train_step`` returns the mean loss on every process.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stratagem.comm import Communicator
from stratagem.pipeline import p2p
from stratagem.pipeline.pipedream import PipeDreamStage, Recorder
from stratagem.pipeline.schedules import SYNCHRONOUS, TorchSchedule
from stratagem.pipeline.stage_layout import PipelineLayout

TAG_PREDICT = 21
TAG_PREDICTION = 22

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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
        chunks: list[tuple[int, nn.Sequential]],
        *,
        layout: PipelineLayout,
        rank: int,
        comm: Communicator,
        schedule: str,
        num_microbatches: int,
        loss_fn: LossFn,
        weight_stashing: bool,
        timeout: float,
        pipeline_group: dist.ProcessGroup | None,
        replica_group: dist.ProcessGroup | None,
        split_points: list[int],
        recorder: Recorder | None = None,
        drain_each_step: bool = True,
    ) -> None:
        self.layout = layout
        self.rank = rank
        self.stage = layout.stage_of(rank)
        self.replica = layout.replica_of(rank)
        self.schedule_name = schedule
        self.num_microbatches = num_microbatches
        self.loss_fn = loss_fn
        self.split_points = split_points
        self.drain_each_step = drain_each_step
        self.stats = StepStats()
        self._comm = comm
        self._chunks = chunks
        self._timeout = timeout
        self._replica_group = replica_group
        # One module holding this rank's layers under the unsplit model's names ("2.weight"):
        # the optimizer's parameters and the checkpoint's keys.
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        for _, chunk in chunks:
            layers.update(chunk._modules)  # type: ignore[arg-type]
        self.module = nn.Sequential(layers)
        self._distributed = layout.world_size > 1
        if layout.num_replicas > 1:
            self._broadcast_from_first_replica()
        self._pipeline_group = pipeline_group
        # Synchronous schedules: one per per-replica batch size (torch fixes shapes at the first
        # step), built when that size first comes. PipeDream sends shapes along: one engine.
        self._schedules: dict[int, TorchSchedule] = {}
        self._engine: PipeDreamStage | None = None
        self._pipelined = self._distributed and layout.num_stages > 1
        if self._pipelined and schedule not in SYNCHRONOUS:
            s, r = self.stage, self.replica
            self._engine = PipeDreamStage(
                chunks[0][1],
                s,
                layout.num_stages,
                prev_rank=layout.rank_of(s - 1, r) if s > 0 else None,
                next_rank=layout.rank_of(s + 1, r) if s < layout.num_stages - 1 else None,
                loss_fn=loss_fn,
                weight_stashing=weight_stashing,
                timeout=timeout,
                replica_group=replica_group,
                num_replicas=layout.num_replicas,
                recorder=recorder,
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
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.layout.num_stages - 1

    def __repr__(self) -> str:
        chunks = ", ".join(str(i) for i, _ in self._chunks)
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
        losses, _, busy = self._run(x, y, None, keep_outputs=False)
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
        losses, _, busy = self._run(x, y, optimizer, keep_outputs=False, drain=self.drain_each_step)
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
        _, outputs, _ = self._run(x, targets, optimizer, keep_outputs=True)
        if self.schedule_name in SYNCHRONOUS:
            optimizer.step()
        return outputs

    def _run(
        self,
        x: torch.Tensor | None,
        y: torch.Tensor | None,
        optimizer: torch.optim.Optimizer | None,
        *,
        keep_outputs: bool,
        drain: bool = True,
    ) -> tuple[list[float], torch.Tensor | None, float | None]:
        """This replica's batch through the schedule: the last stage's per-micro-batch losses,
        its outputs (with ``keep_outputs``) and this rank's seconds computing (None when the
        whole pipeline runs in this process). Synchronous schedules leave the gradients, already
        averaged over replicas, in ``.grad``; PipeDream updates with ``optimizer`` as it goes
        (and, without ``drain``, leaves its warm-up micro-batches in flight)."""
        if self.is_first_stage and x is None:
            raise ValueError(f"stage {self.stage} is the first: it needs the inputs x")
        if self.is_last_stage and y is None:
            raise ValueError(f"stage {self.stage} is the last: it needs the targets y")
        m = self.num_microbatches
        if self.schedule_name not in SYNCHRONOUS:
            assert optimizer is not None
            if self._engine is None:
                return self._pipedream_locally(x, y, optimizer, keep_outputs)
            busy0 = self._engine.busy_seconds
            xs = list(x.chunk(m)) if self.is_first_stage and x is not None else None
            ys = list(y.chunk(m)) if self.is_last_stage and y is not None else None
            kept: list[torch.Tensor] | None = [] if keep_outputs and self.is_last_stage else None
            losses = self._engine.run(xs, ys, m, optimizer, kept, drain=drain)
            outputs = torch.cat(kept) if kept else None
            return losses, outputs, self._engine.busy_seconds - busy0
        self.module.zero_grad(set_to_none=True)
        if not self._pipelined:
            losses, outputs = self._accumulate_locally(x, y, keep_outputs)
            busy = None
        else:
            batch = x if x is not None else y
            assert batch is not None
            engine = self._schedule_for(batch.shape[0])
            busy0 = engine.busy_seconds
            losses, outputs = engine.run(x, y)
            busy = engine.busy_seconds - busy0
        if self.layout.num_replicas > 1:
            self._average_gradients_over_replicas()
        return losses, outputs if keep_outputs else None, busy

    def flush(self) -> None:
        """PipeDream without ``drain_each_step``: run the backwards (and updates) of the
        micro-batches still in flight. Every process calls it; nothing to do otherwise. ``save``
        and ``restore`` flush first."""
        if self._engine is not None:
            self._engine.flush()

    def _schedule_for(self, batch_size: int) -> TorchSchedule:
        engine = self._schedules.get(batch_size)
        if engine is None:
            engine = TorchSchedule(
                self.schedule_name,
                self._chunks,
                self.layout.num_chunks,
                self.num_microbatches,
                self.loss_fn,
                self._pipeline_group,
            )
            self._schedules[batch_size] = engine
        return engine

    def _accumulate_locally(
        self, x: torch.Tensor | None, y: torch.Tensor | None, keep_outputs: bool
    ) -> tuple[list[float], torch.Tensor | None]:
        """One stage in this process: every micro-batch through all chunks, gradients summed."""
        assert x is not None and y is not None
        losses, outputs = [], []
        for xm, ym in zip(x.chunk(self.num_microbatches), y.chunk(self.num_microbatches)):
            out = self.module(xm)
            loss = self.loss_fn(out, ym)
            (loss / self.num_microbatches).backward()
            losses.append(float(loss.detach()))
            if keep_outputs:
                outputs.append(out.detach())
        return losses, torch.cat(outputs) if outputs else None

    def _pipedream_locally(
        self,
        x: torch.Tensor | None,
        y: torch.Tensor | None,
        optimizer: torch.optim.Optimizer,
        keep_outputs: bool,
    ) -> tuple[list[float], torch.Tensor | None, None]:
        """PipeDream with one stage: an update after every micro-batch, nothing in flight."""
        assert x is not None and y is not None
        losses, outputs = [], []
        for xm, ym in zip(x.chunk(self.num_microbatches), y.chunk(self.num_microbatches)):
            optimizer.zero_grad(set_to_none=True)
            out = self.module(xm)
            loss = self.loss_fn(out, ym)
            loss.backward()
            if self.layout.num_replicas > 1:  # one stage, several replicas: data parallelism
                self._average_gradients_over_replicas()
            optimizer.step()
            losses.append(float(loss.detach()))
            if keep_outputs:
                outputs.append(out.detach())
        return losses, torch.cat(outputs) if outputs else None, None

    def _average_gradients_over_replicas(self) -> None:
        params = [p for p in self.module.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self._replica_group)
        flat /= self.layout.num_replicas
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()

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
        layout, r = self.layout, self.replica
        if not self._distributed or layout.num_stages == 1:
            assert x is not None
            return self.module(x)
        owned = dict(self._chunks)
        h = x
        for c in range(layout.num_chunks):
            owner = layout.stage_of_chunk(c)
            if owner != self.stage:
                continue
            prev_owner = layout.stage_of_chunk(c - 1) if c > 0 else None
            if c > 0 and prev_owner != self.stage:
                h = p2p.recv(
                    layout.rank_of(prev_owner, r),  # type: ignore[arg-type]
                    TAG_PREDICT,
                    what=f"predict activations for chunk {c}",
                    timeout=self._timeout,
                )
            if h is None:
                raise ValueError("predict(x): the first stage needs x (pass it on every process)")
            h = owned[c](h)
            if c + 1 < layout.num_chunks and layout.stage_of_chunk(c + 1) != self.stage:
                dst = layout.rank_of(layout.stage_of_chunk(c + 1), r)
                works, _buffers = p2p.send(h, dst, TAG_PREDICT)
                for w in works:
                    w.wait()
        last = layout.stage_of_chunk(layout.num_chunks - 1)
        if self.stage == last:
            assert h is not None
            for s in range(layout.num_stages) if to_every_stage else ():
                if s != last:
                    works, _ = p2p.send(h, layout.rank_of(s, r), TAG_PREDICTION)
                    for w in works:
                        w.wait()
            return h
        if not to_every_stage:
            return None
        return p2p.recv(
            layout.rank_of(last, r), TAG_PREDICTION, what="predictions", timeout=self._timeout
        )

    # ------------------------------------------------------------------ the whole model

    def gather_module(self, whole: nn.Module) -> None:
        """Load every stage's current layers into ``whole`` (the unsplit model this pipeline
        was cut from, or one like it) on every process. Collective: every process calls it."""
        mine = self.module.state_dict() if self.replica == 0 else {}
        merged: dict[str, torch.Tensor] = {}
        for part in self._comm.all_gather_object(mine, what="the pipeline stages' layers"):
            merged.update(part)
        whole.load_state_dict(merged)

    def gather_optimizer_state(self, whole: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Give ``optimizer`` (over all of ``whole``'s parameters) every stage's state for its
        parameters, on every process. Collective: every process calls it."""
        by_name = dict(whole.named_parameters())
        own = {id(p) for p in self.module.parameters()}
        mine = {}
        if self.replica == 0:
            mine = {
                n: optimizer.state[p]
                for n, p in by_name.items()
                if id(p) in own and p in optimizer.state
            }
        for part in self._comm.all_gather_object(mine, what="the pipeline stages' optimizer state"):
            for name, state in part.items():
                p = by_name[name]
                if id(p) not in own:
                    optimizer.state[p] = {
                        k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()
                    }

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
        os.makedirs(path, exist_ok=True)
        self.flush()
        if self.replica == 0:
            state = {
                "model": self.module.state_dict(),
                "optimizer": optimizer.state_dict() if optimizer is not None else None,
                "tensors": {k: v.detach().clone() for k, v in tensors.items()},
                "layout": {
                    "num_stages": self.layout.num_stages,
                    "stages_per_rank": self.layout.stages_per_rank,
                    "split_points": self.split_points,
                    "schedule": self.schedule_name,
                },
            }
            final = os.path.join(path, f"stage-{self.stage}.pt")
            tmp = f"{final}.tmp-{os.getpid()}"
            torch.save(state, tmp)
            os.replace(tmp, final)
        self._comm.barrier(what="the pipeline checkpoint's stage files")
        return path

    def restore(
        self,
        path: str,
        optimizer: torch.optim.Optimizer | None = None,
        **tensors: torch.Tensor,
    ) -> None:
        """Restore this rank's stages (and optimizer, and ``tensors`` in place) from ``save``."""
        self.flush()  # what is in flight belongs to the weights being replaced
        file = os.path.join(path, f"stage-{self.stage}.pt")
        if not os.path.exists(file):
            raise FileNotFoundError(
                f"no pipeline checkpoint for stage {self.stage} at {file!r} (expected the "
                "directory PipelineModel.save wrote)"
            )
        state = torch.load(file, weights_only=True)
        saved = state["layout"]
        mine = {
            "num_stages": self.layout.num_stages,
            "stages_per_rank": self.layout.stages_per_rank,
            "split_points": self.split_points,
        }
        if any(saved[k] != v for k, v in mine.items()):
            raise ValueError(
                f"checkpoint {path!r} was saved by a pipeline with {saved}; this one has {mine}: "
                "restore it with the same stages and split points"
            )
        missing = [k for k in tensors if k not in state["tensors"]]
        if missing or (optimizer is not None and state["optimizer"] is None):
            raise ValueError(
                f"checkpoint {path!r} has no {missing or 'optimizer'} (it saved tensors "
                f"{sorted(state['tensors'])} and {'an' if state['optimizer'] else 'no'} optimizer)"
            )
        self.module.load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for k, t in tensors.items():
                t.copy_(state["tensors"][k])
