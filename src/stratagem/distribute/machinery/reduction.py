"""The arithmetic of ``strategy.reduce`` and ``strategy.gather``: local replicas' values
combined on one device (the strategy's cross-device op), then across processes (its
communicator). Every strategy with replicas shares it; the contract's methods only validate
and pick the values."""

from __future__ import annotations

import torch

from stratagem.comm import Communicator, ReduceOp
from stratagem.comm.cross_device_ops import CrossDeviceOps


def reduce_values(
    op: ReduceOp,
    values: list[torch.Tensor],
    axis: int | None,
    *,
    num_replicas: int,
    cross_device_ops: CrossDeviceOps,
    comm: Communicator,
    destination: torch.device,
) -> torch.Tensor:
    """``op`` over every replica's value (``values``: this process's), and along ``axis``
    first; MEAN divides by the replicas, or by the elements along ``axis``."""
    combine = ReduceOp.SUM if op is ReduceOp.MEAN else op
    if axis is None:
        count = torch.tensor(float(num_replicas))
        parts = values
    else:
        dims = {v.dim() for v in values}
        if any(not -d <= axis < d for d in dims):
            raise ValueError(f"axis {axis} is out of range for values of rank {sorted(dims)}")
        count = torch.tensor(float(sum(v.shape[axis] for v in values)))
        if op in (ReduceOp.SUM, ReduceOp.MEAN):
            parts = [v.sum(axis) for v in values]
        else:
            reducer = torch.amax if op is ReduceOp.MAX else torch.amin
            parts = [reducer(v, axis) for v in values if v.shape[axis] > 0]
            if not parts:
                raise ValueError(f"cannot take {op.name} along axis {axis} of empty values")
    local = cross_device_ops.reduce(combine, parts, destination).clone()
    if op is ReduceOp.MEAN and not local.is_floating_point():
        local = local.double()
    comm.all_reduce(local, combine, what=f"strategy.reduce({op.name})")
    if op is not ReduceOp.MEAN:
        return local
    if axis is not None:
        comm.all_reduce(count, ReduceOp.SUM, what="strategy.reduce(MEAN) counts")
    return local / count.to(local.device, local.dtype)


def gather_values(values: list[torch.Tensor], axis: int, comm: Communicator) -> torch.Tensor:
    """Every replica's value concatenated along ``axis`` (``values``: this process's, on one
    device); sizes along it may differ between processes (padded to travel, cut after)."""
    local = torch.cat(values, dim=axis)
    if comm.world_size == 1:
        return local
    axis = axis % local.dim()
    size = torch.tensor([local.shape[axis]], dtype=torch.int64)
    sizes = [int(s) for s in comm.all_gather(size, what="strategy.gather sizes")]
    pad = max(sizes) - local.shape[axis]
    if pad:
        shape = list(local.shape)
        shape[axis] = pad
        local = torch.cat([local, local.new_zeros(shape)], dim=axis)
    pieces = comm.all_gather(local.contiguous(), what="strategy.gather")
    return torch.cat([p.narrow(axis, 0, s) for p, s in zip(pieces, sizes)], dim=axis)
