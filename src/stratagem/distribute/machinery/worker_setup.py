"""The chief's initial values on every worker, for the strategies of one replica per process
(MultiWorkerMirroredStrategy, FullyShardedStrategy); the job's set-up is ``worker_job``.

Every worker builds the model itself (from its own seed, perhaps), so the chief's values must
reach the others before the first step: the shapes are compared first (a worker that built
another model is named, with the first difference), then the values are broadcast in buckets
of one dtype, a lone contiguous tensor in place.
"""

from __future__ import annotations

import torch

from stratagem.comm import Communicator
from stratagem.errors import RendezvousError

BROADCAST_BUCKET_BYTES = 4 << 20

Signature = list[tuple[tuple[int, ...], str]]


def broadcast_initial_values(
    comm: Communicator, tensors: list[torch.Tensor], *, built: str, what: str
) -> None:
    """The chief's values of ``tensors`` on every process, once every process is found to have
    made the same ones. ``built`` says what each made in the error (``"created {n} tensors in
    strategy.scope()"``: ``{n}`` is the count); ``what`` names the tensors in the check."""
    if comm.world_size == 1:
        return
    signature = [(tuple(t.shape), str(t.dtype)) for t in tensors]
    everyone = comm.all_gather_object(signature, what=f"the shapes of {what}")
    for rank, theirs in enumerate(everyone):
        if theirs != signature:
            raise RendezvousError(
                f"{comm.peer_name(rank)} {built.format(n=len(theirs))} but "
                f"{comm.peer_name(comm.rank)} {built.format(n=len(signature))}; every worker "
                f"must build the same model. First difference: "
                f"{_first_difference(signature, theirs)}"
            )
    with torch.no_grad():
        for group in buckets(tensors, BROADCAST_BUCKET_BYTES):
            label = f"initial values of {len(group)} tensors ({group[0].dtype})"
            if len(group) == 1 and group[0].is_contiguous():
                comm.broadcast(group[0].detach(), 0, what=label)  # in place, no copy
                continue
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            comm.broadcast(flat, 0, what=label)
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def _first_difference(mine: Signature, theirs: Signature) -> str:
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            return f"tensor {i} is {a[0]} {a[1]} here and {b[0]} {b[1]} there"
    return f"one list is longer ({len(mine)} vs {len(theirs)})"


def buckets(tensors: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Tensors of one dtype together, in order, up to ``limit`` bytes a bucket (a larger tensor
    alone)."""
    buckets: list[list[torch.Tensor]] = []
    open_bucket: dict[torch.dtype, tuple[list[torch.Tensor], int]] = {}
    for t in tensors:
        size = t.numel() * t.element_size()
        group, used = open_bucket.get(t.dtype, ([], 0))
        if group and used + size > limit:
            group, used = [], 0
        if not group:
            buckets.append(group)
        group.append(t)
        open_bucket[t.dtype] = (group, used + size)
    return buckets
