"""Parameters shared between pipeline stages (tied embeddings), kept one parameter.

A model whose first and last layers share a parameter (GPT-2's ``lm_head.weight is wte.weight``)
is cut so that the two uses land on different stages: each stage process then holds a copy,
which would train on its own stage's gradient only and drift from the other. As Megatron does
with its embedding group, the copies stay one parameter: they start equal (broadcast from the
stage of its first use, its *owner*, at set-up), and after every step's backward the stages
holding a copy all-reduce (sum) its gradient among themselves, one group of exactly those ranks
per data-parallel replica, so that every copy gets the whole gradient and the same update.
Two chunks of one rank (interleaving) that share it add their gradients up in the one tensor
already: the all-reduce is between ranks. A checkpoint writes the tensor once, in the owner's
stage file.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from stratagem.errors import SharedParameterError
from stratagem.pipeline.stage_layout import PipelineLayout

# A set of stage ranks (within one replica) that hold copies of the same parameters.
Holders = tuple[int, ...]


@dataclass(frozen=True)
class SharedParameter:
    """One parameter of the whole model that layers on several stages use.

    ``names``: every name it has in the whole model, in the order of the chunks using them
    (module order for a Sequential); ``stages``: the stages holding a copy, ascending;
    ``owner``: the stage of ``names[0]``, whose copy starts the others and whose stage file
    holds it in a checkpoint.
    """

    names: tuple[str, ...]
    stages: Holders
    owner: int

    def describe(self) -> str:
        """``'wte.weight' (also 'lm_head.weight') on stages 0 and 1``."""
        also = ", ".join(repr(n) for n in self.names[1:])
        stages = [str(s) for s in self.stages]
        where = f"{', '.join(stages[:-1])} and {stages[-1]}"
        return f"{self.names[0]!r} (also {also}) on stages {where}"


def find_shared_parameters(
    model: nn.Module, split_points: Sequence[int], layout: PipelineLayout
) -> list[SharedParameter]:
    """The parameters of ``model`` (the whole ``nn.Sequential``, before the split) that the cut
    at ``split_points`` puts on more than one stage, found by identity, in module order."""
    layers = list(model._modules)
    chunk_of_name = {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        layer = name.split(".", 1)[0]
        if layer in layers:  # (a parameter of the Sequential itself is on no stage)
            chunk_of_name[name] = bisect.bisect_right(split_points, layers.index(layer))
    return shared_between_stages(model, chunk_of_name, layout)


def shared_between_stages(
    model: nn.Module, chunk_of_name: Mapping[str, int], layout: PipelineLayout
) -> list[SharedParameter]:
    """The parameters of ``model`` whose names ``chunk_of_name`` puts on more than one stage,
    found by identity, in module order. Each one's names are ordered by chunk (module order
    within one), so its owner, the stage of ``names[0]``, holds its first use."""
    names_by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_by_id.setdefault(id(p), []).append(name)
    shared = []
    for names in names_by_id.values():
        placed = sorted((n for n in names if n in chunk_of_name), key=chunk_of_name.__getitem__)
        stages = tuple(sorted({layout.stage_of_chunk(chunk_of_name[n]) for n in placed}))
        if len(stages) > 1:
            ordered = (*placed, *(n for n in names if n not in chunk_of_name))
            owner = layout.stage_of_chunk(chunk_of_name[placed[0]])
            shared.append(SharedParameter(ordered, stages, owner))
    return shared


def check_schedule(shared: Sequence[SharedParameter], schedule: str) -> None:
    """Refuse a schedule that cannot keep a shared parameter one parameter (PipeDream)."""
    if not shared or schedule != "PipeDream":
        return
    which = "; ".join(s.describe() for s in shared)
    raise SharedParameterError(
        f"schedule='PipeDream' cannot train a parameter shared between pipeline stages: "
        f"{which}. PipeDream updates each stage after every micro-batch, at different times "
        "on different stages, and with weight stashing keeps each stage's own weight versions, "
        "so the stages' copies would not stay one parameter. Use a synchronous schedule "
        "('GPipe', '1F1B' or 'Interleaved1F1B': the stages holding a copy all-reduce its "
        "gradient every step), or choose split_points that keep every layer using it on one "
        "stage, or untie it in the model"
    )


class SharedCopies:
    """This rank's copies of parameters shared with other stages, in buckets of one set of
    holding stages (and one dtype), each with the group of those stages' ranks in this
    replica. Every holder calls the same methods in the same order (collectives)."""

    def __init__(
        self,
        module: nn.Module,
        shared: Sequence[SharedParameter],
        *,
        layout: PipelineLayout,
        stage: int,
        replica: int,
        groups: Mapping[Holders, dist.ProcessGroup | None],
    ) -> None:
        by_name = dict(module.named_parameters(remove_duplicate=False))
        buckets: dict[tuple[Holders, torch.dtype], list[tuple[nn.Parameter, int]]] = {}
        for s in shared:
            if stage not in s.stages:
                continue
            p = next(by_name[n] for n in s.names if n in by_name)
            owner = layout.rank_of(s.owner, replica)
            buckets.setdefault((s.stages, p.dtype), []).append((p, owner))
        self._buckets = [(groups[stages], entries) for (stages, _), entries in buckets.items()]

    def __bool__(self) -> bool:
        return bool(self._buckets)

    @torch.no_grad()
    def broadcast_from_owners(self) -> None:
        """Every copy takes its owner's value: the copies start as one parameter whatever each
        process's seed was."""
        for group, entries in self._buckets:
            for p, owner in entries:
                dist.broadcast(p, owner, group=group)

    def all_reduce_gradients(self) -> None:
        """Each copy's gradient becomes the sum over the stages holding one (each stage's
        gradient is that of its own uses): the unsplit parameter's gradient, on every copy."""
        for group, entries in self._buckets:
            params = [p for p, _ in entries if p.requires_grad]
            if not params:
                continue
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            offset = 0
            for p in params:
                p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
                offset += p.numel()
