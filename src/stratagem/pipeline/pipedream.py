"""PipeDream's asynchronous 1F1B with weight stashing, for one stage process.

Each stage alternates one forward and one backward pass (after a warm-up of ``K - s - 1``
forwards on stage ``s`` of ``K``) and updates its weights after *every* micro-batch's backward:
no flush between updates, so a forward runs on the weights of that moment. Each ``run`` (one
training step) drains what is in flight, or with ``drain=False`` leaves the warm-up's
micro-batches in flight into the next ``run``, as in PipeDream, until ``flush()``. Weight
stashing (Harlap et al. 2018) runs each micro-batch's backward with the weight version its
forward used (``torch.func.functional_call`` on a snapshot, one per version), and applies the
gradients to the live weights. With stashing off the stage keeps one version, as naive PipeDream:
backward recomputes from the saved input with the current weights. ``Recorder`` lets a test
watch both passes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from stratagem.pipeline import p2p

TAG_ACTIVATION = 11
TAG_GRADIENT = 12

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Recorder(Protocol):
    """Watches a stage's passes (tests and tracing); called in the stage's process."""

    def forward(
        self, stage: int, micro_batch: int, version: int, module: nn.Module, x: torch.Tensor
    ) -> None: ...

    def backward(
        self,
        stage: int,
        micro_batch: int,
        version: int,
        grad_output: torch.Tensor | None,
        grads: dict[str, torch.Tensor],
    ) -> None: ...


@dataclass
class _InFlight:
    index: int  # the micro-batch's index in the step that brought it
    x: torch.Tensor  # the stage's input (requires grad on every stage but the first)
    out: torch.Tensor | None  # the output (or loss, on the last stage) with its graph, if kept
    weights: dict[str, torch.Tensor] | None  # the stashed weight version, if stashing
    version: int
    target: torch.Tensor | None


def one_f_one_b_order(stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int]]:
    """The 1F1B order of passes on one stage: ``[("F", 0), ("F", 1), ("B", 0), ...]`` (what
    ``PipeDreamStage.run`` does in one step that drains)."""
    warmup = min(num_stages - stage - 1, num_microbatches)
    order = [("F", i) for i in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(num_microbatches - warmup, num_microbatches)]
    return order


class PipeDreamStage:
    """One stage of an asynchronous 1F1B pipeline with (optional) weight stashing."""

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        num_stages: int,
        *,
        prev_rank: int | None,
        next_rank: int | None,
        loss_fn: LossFn,
        weight_stashing: bool = True,
        timeout: float = 60.0,
        replica_group: dist.ProcessGroup | None = None,
        num_replicas: int = 1,
        recorder: Recorder | None = None,
    ) -> None:
        self.module = module
        self.stage = stage
        self.num_stages = num_stages
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.loss_fn = loss_fn
        self.weight_stashing = weight_stashing
        self.timeout = timeout
        self.replica_group = replica_group
        self.num_replicas = num_replicas
        self.recorder = recorder
        self.version = 0  # how many updates this stage's weights have had
        self.busy_seconds = 0.0
        self.max_versions_in_flight = 0
        self._snapshot: tuple[int, dict[str, torch.Tensor]] | None = None
        self._params = dict(module.named_parameters())
        # Micro-batches are numbered across runs: forwarded so far, backwarded so far; the
        # ones in between are in flight (kept across runs with drain=False, as are their sends).
        self._forwards = 0
        self._backwards = 0
        self._in_flight: dict[int, _InFlight] = {}
        self._outbox = p2p.Outbox(timeout)
        self._optimizer: torch.optim.Optimizer | None = None

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def _weights_now(self) -> dict[str, torch.Tensor]:
        """The stash for the current version: a copy, taken once per version."""
        if self._snapshot is None or self._snapshot[0] != self.version:
            copy = {
                n: p.detach().clone().requires_grad_(p.requires_grad)
                for n, p in self._params.items()
            }
            self._snapshot = (self.version, copy)
        return self._snapshot[1]

    def run(
        self,
        inputs: list[torch.Tensor] | None,
        targets: list[torch.Tensor] | None,
        num_microbatches: int,
        optimizer: torch.optim.Optimizer,
        outputs: list[torch.Tensor] | None = None,
        *,
        drain: bool = True,
    ) -> list[float]:
        """Forward ``num_microbatches`` new micro-batches through this stage in 1F1B order, a
        backward after each forward once ``K - s - 1`` are in flight; then, with ``drain``, the
        backwards of those left in flight. The last stage's losses (and, given a list
        ``outputs``, its outputs appended in micro-batch order)."""
        self._optimizer = optimizer
        warmup = self.num_stages - self.stage - 1
        losses: list[float] = []
        for i in range(num_microbatches):
            x = inputs[i] if self.is_first else self._recv(self.prev_rank, TAG_ACTIVATION, i)  # type: ignore[index]
            target = targets[i] if self.is_last else None  # type: ignore[index]
            f = self._forward(i, x, target, self._outbox, losses, outputs)
            self._in_flight[self._forwards] = f
            self._forwards += 1
            versions = {g.version for g in self._in_flight.values()}
            self.max_versions_in_flight = max(self.max_versions_in_flight, len(versions))
            if self._forwards - self._backwards > warmup:
                self._backward_next(optimizer)
        if drain:
            self.flush()
        return losses

    def flush(self) -> None:
        """The backwards of every micro-batch still in flight, and the sends still under way:
        afterwards the weights hold every update. Every stage of the pipeline calls it."""
        while self._backwards < self._forwards:
            assert self._optimizer is not None
            self._backward_next(self._optimizer)
        self._outbox.drain()

    @property
    def in_flight(self) -> int:
        """Micro-batches forwarded whose backward has not run yet."""
        return self._forwards - self._backwards

    def _backward_next(self, optimizer: torch.optim.Optimizer) -> None:
        f = self._in_flight.pop(self._backwards)
        self._backwards += 1
        grad = None if self.is_last else self._recv(self.next_rank, TAG_GRADIENT, f.index)
        self._backward(f.index, f, grad, self._outbox, optimizer)

    def _recv(self, src: int | None, tag: int, i: int) -> torch.Tensor:
        kind = "activations" if tag == TAG_ACTIVATION else "gradients"
        assert src is not None
        return p2p.recv(
            src, tag, what=f"{kind} of micro-batch {i} (stage {self.stage})", timeout=self.timeout
        )

    def _forward(
        self,
        i: int,
        x: torch.Tensor,
        target: torch.Tensor | None,
        outbox: p2p.Outbox,
        losses: list[float],
        outputs: list[torch.Tensor] | None,
    ) -> _InFlight:
        start = time.perf_counter()
        if not self.is_first:
            x = x.requires_grad_()
        if self.recorder is not None:
            self.recorder.forward(self.stage, i, self.version, self.module, x)
        weights = self._weights_now() if self.weight_stashing else None
        if weights is not None:
            out = functional_call(self.module, weights, (x,))
        else:
            with torch.no_grad():  # recomputed at backward time, with the weights of then
                out = self.module(x)
        if self.is_last:
            assert target is not None
            if outputs is not None:
                outputs.append(out.detach())
            loss = self.loss_fn(out, target)
            losses.append(float(loss.detach()))
            kept = loss if weights is not None else None
        else:
            kept = out if weights is not None else None
        self.busy_seconds += time.perf_counter() - start
        if not self.is_last:
            assert self.next_rank is not None
            outbox.send(
                out.detach(), self.next_rank, TAG_ACTIVATION, f"activations of micro-batch {i}"
            )
        return _InFlight(i, x, kept, weights, self.version, target)

    def _backward(
        self,
        i: int,
        f: _InFlight,
        grad_output: torch.Tensor | None,
        outbox: p2p.Outbox,
        optimizer: torch.optim.Optimizer,
    ) -> None:
        start = time.perf_counter()
        weights, out = f.weights, f.out
        if weights is None:
            # No stash: the only weights this stage has are the live ones, maybe newer.
            weights = {
                n: p.detach().requires_grad_(p.requires_grad) for n, p in self._params.items()
            }
            out = functional_call(self.module, weights, (f.x,))
            if self.is_last:
                out = self.loss_fn(out, f.target)  # type: ignore[arg-type]
        assert out is not None
        names = [n for n, w in weights.items() if w.requires_grad]
        wrt = [weights[n] for n in names] + ([] if self.is_first else [f.x])
        grads = torch.autograd.grad(out, wrt, grad_outputs=grad_output, allow_unused=True)
        param_grads = {
            n: g if g is not None else torch.zeros_like(weights[n])
            for n, g in zip(names, grads[: len(names)])
        }
        self.busy_seconds += time.perf_counter() - start
        if not self.is_first:
            assert self.prev_rank is not None
            outbox.send(grads[-1], self.prev_rank, TAG_GRADIENT, f"gradients of micro-batch {i}")
        if self.num_replicas > 1:
            self._average_over_replicas(param_grads)
        if self.recorder is not None:
            self.recorder.backward(self.stage, i, f.version, grad_output, param_grads)
        start = time.perf_counter()
        for n, g in param_grads.items():
            self._params[n].grad = g
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.version += 1
        self.busy_seconds += time.perf_counter() - start

    def _average_over_replicas(self, grads: dict[str, torch.Tensor]) -> None:
        flat = torch.cat([g.reshape(-1) for g in grads.values()])
        dist.all_reduce(flat, group=self.replica_group)
        flat /= self.num_replicas
        offset = 0
        for n, g in grads.items():
            grads[n] = flat[offset : offset + g.numel()].view_as(g)
            offset += g.numel()
