"""The synchronous schedules (GPipe, 1F1B, interleaved 1F1B) through torch.distributed.pipelining.

Each local model chunk becomes a ``PipelineStage`` (shapes inferred on the first step); the
schedule splits the batch into micro-batches, runs them, and leaves the summed gradients in the
chunk's own parameters; dividing them by the number of micro-batches makes them, with a mean
loss, the unsplit model's gradients on the whole batch. That division is done here, once per
parameter of this rank, not by torch per chunk: two chunks of one rank that share a parameter
(interleaving a tied model) would divide its gradient twice. A schedule is
built for one batch size (torch fixes the micro-batch shapes at its first step); ``StageRunner``
keeps one per batch size it meets.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

SYNCHRONOUS = ("GPipe", "1F1B", "Interleaved1F1B")


class TorchSchedule:
    """This rank's stages and schedule; counts the seconds spent computing (``busy_seconds``)."""

    def __init__(
        self,
        name: str,
        chunks: list[tuple[int, nn.Module]],
        num_chunks: int,
        num_microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        group: dist.ProcessGroup | None,
    ) -> None:
        device = torch.device("cpu")
        for _, module in chunks:
            p = next(module.parameters(), None)
            if p is not None:
                device = p.device
                break
        self.stages = [
            PipelineStage(module, index, num_chunks, device, group=group)
            for index, module in chunks
        ]
        self.name = name
        self.busy_seconds = 0.0
        for stage in self.stages:
            stage.forward_one_chunk = self._timed(stage.forward_one_chunk)  # type: ignore[method-assign]
            stage.backward_one_chunk = self._timed(stage.backward_one_chunk)  # type: ignore[method-assign]
        self.schedule: Any
        if name == "Interleaved1F1B":
            self.schedule = ScheduleInterleaved1F1B(
                self.stages, num_microbatches, loss_fn=loss_fn, scale_grads=False
            )
        else:
            cls = ScheduleGPipe if name == "GPipe" else Schedule1F1B
            self.schedule = cls(
                self.stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=False
            )
        self.num_microbatches = num_microbatches
        # Each parameter once, however many of this rank's chunks use it.
        unique = {id(p): p for _, module in chunks for p in module.parameters()}
        self._each_parameter = list(unique.values())
        self.is_first = any(s.is_first for s in self.stages)
        self.is_last = any(s.is_last for s in self.stages)

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy_seconds += time.perf_counter() - start

        return timed

    def run(
        self, x: torch.Tensor | None, y: torch.Tensor | None
    ) -> tuple[list[float], torch.Tensor | None]:
        """One step over the batch: the last stage's per-micro-batch losses (else empty) and
        its outputs for the whole batch (else None)."""
        losses: list[torch.Tensor] = []
        args = (x,) if self.is_first else ()
        target = y if self.is_last else None
        # A lost or stuck stage surfaces here as a bare gloo error; the caller's
        # ``named_faults`` (stages.PipelineModel) names the stage and the operation.
        out = self.schedule.step(*args, target=target, losses=losses if self.is_last else None)
        with torch.no_grad():
            for p in self._each_parameter:
                if p.grad is not None:
                    p.grad.div_(self.num_microbatches)
        outputs = out.detach() if self.is_last and isinstance(out, torch.Tensor) else None
        return [float(loss.detach()) for loss in losses], outputs
