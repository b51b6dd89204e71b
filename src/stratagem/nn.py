"""``sg.nn``: the loss helpers of ``tf.nn`` that distributed training needs.

Loss scaling for synchronous replicas (``sg.nn.compute_average_loss`` and friends).

Gradients are summed across replicas (the seeds' convention), so each replica's loss must be
its share of the *global* mean: the sum of its per-example losses divided by the global batch.
With a weight per token (``sample_weight`` shaped as a rank >= 2 loss, a padding mask), the
share is of the global token mean: divided by the weights' sum over every replica
(``global_count``, one all-reduce of a number), so any split of a padded batch trains as one
process on the whole of it.
"""

from __future__ import annotations

import torch

from stratagem.comm.dtensor_check import is_dtensor
from stratagem.distribute import ReduceOp, get_replica_context


def compute_average_loss(
    per_example_loss: torch.Tensor,
    sample_weight: torch.Tensor | float | None = None,
    global_batch_size: int | None = None,
) -> torch.Tensor:
    """Sum of (weighted) per-example losses divided by the global batch size.

    Without ``global_batch_size``, the true size of the global batch the replica's input came
    from when a distributed dataset recorded it (exact for a last partial batch), else the
    local batch times the replicas in sync, as TF does.

    With a weight per element of a loss of rank >= 2 (``sample_weight`` of its shape: a token
    mask) and no ``global_batch_size``, the sum is divided by the weights' sum over every
    replica instead (the count of real tokens of the global batch): TF divides by the examples.
    """
    if not isinstance(per_example_loss, torch.Tensor):
        raise TypeError(f"per_example_loss must be a tensor, got {type(per_example_loss).__name__}")
    if per_example_loss.dim() == 0:
        raise ValueError(
            "per_example_loss is a scalar; pass one loss per example (reduction='none')"
        )
    if sample_weight is not None:
        weights = torch.as_tensor(sample_weight, device=per_example_loss.device)
        per_example_loss = per_example_loss * weights
        if global_batch_size is None and _per_token(per_example_loss, weights):
            tokens = global_count(weights.sum())
            if tokens == 0:
                return per_example_loss.sum() * 0.0
            return per_example_loss.sum() / tokens
    if global_batch_size is None and is_dtensor(per_example_loss):
        # The losses of the whole global batch laid out on a mesh (sg MeshStrategy): the shape
        # is the global batch's, and the sum stays each replica's partial sum until reduced.
        global_batch_size = per_example_loss.shape[0]
        if global_batch_size == 0:
            return per_example_loss.sum() * 0.0
    elif global_batch_size is None:
        ctx = get_replica_context()
        replicas = ctx.num_replicas_in_sync if ctx is not None else 1
        recorded = ctx.global_batch_size if ctx is not None else None
        global_batch_size = recorded or per_example_loss.shape[0] * replicas
        if global_batch_size == 0:
            return per_example_loss.sum() * 0.0
    elif (
        isinstance(global_batch_size, bool)
        or not isinstance(global_batch_size, int)
        or (global_batch_size < 1)
    ):
        raise ValueError(f"global_batch_size must be a positive int, got {global_batch_size!r}")
    return per_example_loss.sum() / global_batch_size


def _per_token(per_example_loss: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether ``weights`` weigh each element of a loss of rank >= 2 (a token's, not an
    example's: a padding mask)."""
    return per_example_loss.dim() >= 2 and tuple(weights.shape) == tuple(per_example_loss.shape)


def global_count(local: torch.Tensor | float) -> float:
    """The sum over every replica in sync of a number each replica holds (its count of real
    tokens), from inside ``strategy.run``: one all-reduce of one number. A sum over a mesh's
    global batch (a DTensor) is global already; outside ``run``, the number itself."""
    value = torch.as_tensor(local).detach()
    if is_dtensor(value):
        return float(value.full_tensor())
    ctx = get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return float(value)
    return float(ctx.all_reduce(ReduceOp.SUM, value.to(torch.float64)))


def scale_regularization_loss(regularization_loss: torch.Tensor) -> torch.Tensor:
    """Divide a regularization loss by the replicas in sync (it is added on every replica)."""
    ctx = get_replica_context()
    replicas = ctx.num_replicas_in_sync if ctx is not None else 1
    return regularization_loss / replicas


__all__ = ["compute_average_loss", "global_count", "scale_regularization_loss"]
