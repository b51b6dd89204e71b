"""``sg.nn``: the loss helpers of ``tf.nn`` that distributed training needs.

Loss scaling for synchronous replicas (``sg.nn.compute_average_loss`` and friends).

Gradients are summed across replicas (the seeds' convention), so each replica's loss must be
its share of the *global* mean: the sum of its per-example losses divided by the global batch.
"""

from __future__ import annotations

import torch

from stratagem.comm.dtensor_check import is_dtensor
from stratagem.distribute import get_replica_context


def compute_average_loss(
    per_example_loss: torch.Tensor,
    sample_weight: torch.Tensor | float | None = None,
    global_batch_size: int | None = None,
) -> torch.Tensor:
    """Sum of (weighted) per-example losses divided by the global batch size.

    Without ``global_batch_size``, the true size of the global batch the replica's input came
    from when a distributed dataset recorded it (exact for a last partial batch), else the
    local batch times the replicas in sync, as TF does.
    """
    if not isinstance(per_example_loss, torch.Tensor):
        raise TypeError(f"per_example_loss must be a tensor, got {type(per_example_loss).__name__}")
    if per_example_loss.dim() == 0:
        raise ValueError(
            "per_example_loss is a scalar; pass one loss per example (reduction='none')"
        )
    if sample_weight is not None:
        per_example_loss = per_example_loss * sample_weight
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


def scale_regularization_loss(regularization_loss: torch.Tensor) -> torch.Tensor:
    """Divide a regularization loss by the replicas in sync (it is added on every replica)."""
    ctx = get_replica_context()
    replicas = ctx.num_replicas_in_sync if ctx is not None else 1
    return regularization_loss / replicas


__all__ = ["compute_average_loss", "scale_regularization_loss"]
