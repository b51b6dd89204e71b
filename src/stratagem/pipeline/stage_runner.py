"""Running batches through this rank's stages: a training step by the schedule, or forward only.

A synchronous schedule (GPipe, 1F1B, interleaved 1F1B) runs through torch.distributed.pipelining,
one ``TorchSchedule`` per batch size (traced stages: over the graphs traced for its micro-batch
size); PipeDream runs through this stage's ``PipeDreamStage``; a
pipeline whose stages all live in this process runs its micro-batches one after another. With
several replicas each stage's gradients are averaged over them; then the gradients of parameters
shared with other stages are summed over the stages holding them (``shared.SharedCopies``).
The forward-only pass
(evaluation, prediction) sends activations from stage to stage, one transfer per boundary.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from stratagem.pipeline import p2p
from stratagem.pipeline.pipedream import LossFn, PipeDreamStage, Recorder
from stratagem.pipeline.schedules import SYNCHRONOUS, TorchSchedule
from stratagem.pipeline.settings import PipelineSettings
from stratagem.pipeline.shared import SharedCopies
from stratagem.pipeline.stage_pieces import StagePieces, run_chunks

TAG_PREDICT = 21
TAG_PREDICTION = 22


class StageRunner:
    """Runs this rank's model chunks (``pieces``) by ``schedule``, or forward."""

    def __init__(
        self,
        pieces: StagePieces,
        settings: PipelineSettings,
        *,
        stage: int,
        replica: int,
        loss_fn: LossFn,
        recorder: Recorder | None,
        shared: SharedCopies | None = None,
    ) -> None:
        layout = settings.layout
        self.layout = layout
        self.stage = stage
        self.replica = replica
        self.schedule_name = settings.schedule
        self.num_microbatches = settings.num_microbatches
        self.loss_fn = loss_fn
        self.module: nn.Module = pieces.module
        self._pieces = pieces
        self._timeout = settings.timeout
        self._pipeline_group = settings.pipeline_group
        self._replica_group = settings.replica_group
        self._shared = shared
        self._distributed = layout.world_size > 1
        # Synchronous schedules: one per per-replica batch size (torch fixes shapes at the first
        # step), built when that size first comes. PipeDream sends shapes along: one engine.
        self._schedules: dict[int, TorchSchedule] = {}
        self.engine: PipeDreamStage | None = None
        self._pipelined = self._distributed and layout.num_stages > 1
        if self._pipelined and settings.schedule not in SYNCHRONOUS:
            s, r = stage, replica
            # PipeDream sends one tensor per micro-batch, whatever its size: Sequential slices.
            chunks = pieces.fixed_chunks
            assert chunks is not None, "PipeDream needs stages that run any batch size"
            self.engine = PipeDreamStage(
                chunks[0][1],
                s,
                layout.num_stages,
                prev_rank=layout.rank_of(s - 1, r) if s > 0 else None,
                next_rank=layout.rank_of(s + 1, r) if s < layout.num_stages - 1 else None,
                loss_fn=loss_fn,
                weight_stashing=settings.weight_stashing,
                timeout=settings.timeout,
                replica_group=settings.replica_group,
                num_replicas=layout.num_replicas,
                recorder=recorder,
            )

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.layout.num_stages - 1

    # ------------------------------------------------------------------ training

    def run(
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
        averaged over replicas (and summed over the stages sharing a parameter), in ``.grad``;
        PipeDream updates with ``optimizer`` as it goes (and, without ``drain``, leaves its
        warm-up micro-batches in flight)."""
        if self.is_first_stage and x is None:
            raise ValueError(f"stage {self.stage} is the first: it needs the inputs x")
        if self.is_last_stage and y is None:
            raise ValueError(f"stage {self.stage} is the last: it needs the targets y")
        m = self.num_microbatches
        if self.schedule_name not in SYNCHRONOUS:
            assert optimizer is not None
            if self.engine is None:
                return self._pipedream_locally(x, y, optimizer, keep_outputs)
            busy0 = self.engine.busy_seconds
            xs = list(x.chunk(m)) if self.is_first_stage and x is not None else None
            ys = list(y.chunk(m)) if self.is_last_stage and y is not None else None
            kept: list[torch.Tensor] | None = [] if keep_outputs and self.is_last_stage else None
            losses = self.engine.run(xs, ys, m, optimizer, kept, drain=drain)
            outputs = torch.cat(kept) if kept else None
            return losses, outputs, self.engine.busy_seconds - busy0
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
        if self._shared:
            # Averaged over replicas first: summed over the stages, that is the unsplit
            # parameter's gradient on the global batch (both are linear, so either order).
            self._shared.all_reduce_gradients()
        return losses, outputs if keep_outputs else None, busy

    def flush(self) -> None:
        """PipeDream's micro-batches still in flight: their backwards and updates."""
        if self.engine is not None:
            self.engine.flush()

    def _schedule_for(self, batch_size: int) -> TorchSchedule:
        engine = self._schedules.get(batch_size)
        if engine is None:
            engine = TorchSchedule(
                self.schedule_name,
                self._pieces.chunks_for(batch_size // self.num_microbatches),
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
            out = run_chunks(self._pieces.chunks_for(xm.shape[0]), xm)
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
            out = run_chunks(self._pieces.chunks_for(xm.shape[0]), xm)
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

    # ------------------------------------------------------------------ inference

    def forward(self, x: torch.Tensor | None, *, to_every_stage: bool) -> torch.Tensor | None:
        """The model's outputs for ``x`` through this replica's stages (call it without grad):
        on the last stage, and on every stage with ``to_every_stage`` (else None there).

        Between stages travels what a chunk returns: a tensor, or the tuple a traced stage
        hands on (``p2p.send_values``)."""
        layout, r = self.layout, self.replica
        if not self._distributed or layout.num_stages == 1:
            assert x is not None
            return run_chunks(self._pieces.chunks_for(x.shape[0]), x)
        h: torch.Tensor | tuple[torch.Tensor, ...] | None = x
        for c in layout.chunks_of(self.stage):
            prev_owner = layout.stage_of_chunk(c - 1) if c > 0 else None
            if c > 0 and prev_owner != self.stage:
                h = p2p.recv_values(
                    layout.rank_of(prev_owner, r),  # type: ignore[arg-type]
                    TAG_PREDICT,
                    what=f"predict activations for chunk {c}",
                    timeout=self._timeout,
                )
            if h is None:
                raise ValueError("predict(x): the first stage needs x (pass it on every process)")
            first = h[0] if isinstance(h, tuple) else h
            chunk = dict(self._pieces.chunks_for(first.shape[0]))[c]
            h = chunk(*h) if isinstance(h, tuple) else chunk(h)
            if c + 1 < layout.num_chunks and layout.stage_of_chunk(c + 1) != self.stage:
                dst = layout.rank_of(layout.stage_of_chunk(c + 1), r)
                works, _buffers = p2p.send_values(h, dst, TAG_PREDICT)
                for w in works:
                    w.wait()
        last = layout.stage_of_chunk(layout.num_chunks - 1)
        if self.stage == last:
            assert isinstance(h, torch.Tensor)
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
