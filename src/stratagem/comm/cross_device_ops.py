"""Reductions across the devices of one process (``sg.distribute.*`` cross-device ops).

MirroredStrategy keeps one copy of each variable per device. After backward, each replica's
gradients are reduced onto the primary copy, the optimizer updates it, and the other copies are
refreshed from it; these classes do the reduction. Several tensors are packed into one flat
buffer per replica first (``num_packs`` buffers), as TF does, so that many small gradients cost
a few large copies instead of many small ones.

- ``ReductionToOneDevice``: copy every replica's buffer to one device and add them there.
- ``HierarchicalCopyAllReduce``: add in a binary tree (pairs of devices, then pairs of pairs),
  so no device receives more than log2(n) buffers; meant for GPUs without NCCL.
- ``NcclAllReduce``: ``torch.cuda.nccl`` on CUDA devices; on anything else it falls back to
  ``ReductionToOneDevice`` and says so once.
"""

from __future__ import annotations

import abc
import warnings
from collections.abc import Sequence

import torch

from stratagem.comm.reduce_op import ReduceOp


def _combine(op: ReduceOp, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if op in (ReduceOp.SUM, ReduceOp.MEAN):
        return a.add_(b)
    if op is ReduceOp.MAX:
        return torch.maximum(a, b, out=a)
    return torch.minimum(a, b, out=a)


class CrossDeviceOps(abc.ABC):
    """Reduces per-replica values that live on the devices of one process."""

    def __init__(self, num_packs: int = 1) -> None:
        if not isinstance(num_packs, int) or num_packs < 1:
            raise ValueError(f"num_packs must be a positive int, got {num_packs!r}")
        self.num_packs = num_packs

    def reduce(
        self, reduce_op: ReduceOp | str, values: Sequence[torch.Tensor], destination: torch.device
    ) -> torch.Tensor:
        """Reduce one value given per replica; the result lives on ``destination``."""
        return self.batch_reduce(reduce_op, [values], destination)[0]

    def batch_reduce(
        self,
        reduce_op: ReduceOp | str,
        value_lists: Sequence[Sequence[torch.Tensor]],
        destination: torch.device,
    ) -> list[torch.Tensor]:
        """Reduce several values at once; ``value_lists[k]`` holds value k of every replica."""
        op = ReduceOp.parse(reduce_op)
        if not value_lists:
            return []
        n = len(value_lists[0])
        for k, values in enumerate(value_lists):
            if len(values) != n:
                raise ValueError(
                    f"value {k} is given for {len(values)} replicas but value 0 for {n}"
                )
            shapes = {tuple(v.shape) for v in values}
            if len(shapes) != 1:
                raise ValueError(f"value {k} has different shapes across replicas: {shapes}")
        results: list[torch.Tensor] = [torch.empty(0)] * len(value_lists)
        # Pack tensors of one dtype into flat buffers, one per replica.
        by_dtype: dict[torch.dtype, list[int]] = {}
        for k, values in enumerate(value_lists):
            by_dtype.setdefault(values[0].dtype, []).append(k)
        for indices in by_dtype.values():
            for pack in _split(indices, self.num_packs):
                flats = [torch.cat([value_lists[k][r].reshape(-1) for k in pack]) for r in range(n)]
                reduced = self._reduce_flat(op, flats, destination)
                if op is ReduceOp.MEAN:
                    reduced.div_(n)
                offset = 0
                for k in pack:
                    like = value_lists[k][0]
                    results[k] = reduced[offset : offset + like.numel()].view(like.shape)
                    offset += like.numel()
        return results

    @abc.abstractmethod
    def _reduce_flat(
        self, op: ReduceOp, flats: list[torch.Tensor], destination: torch.device
    ) -> torch.Tensor:
        """Reduce one flat buffer per replica into a new tensor on ``destination``."""

    def check_devices(
        self, devices: Sequence[torch.device], names: Sequence[str] | None = None
    ) -> None:
        """Say now, not at the first step, if this op cannot run on these devices."""
        return None

    def broadcast(
        self, tensor: torch.Tensor, devices: Sequence[torch.device]
    ) -> list[torch.Tensor]:
        """A copy of ``tensor`` on each device (the tensor itself where it already lives)."""
        return [tensor if tensor.device == d else tensor.to(d, copy=True) for d in devices]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_packs={self.num_packs})"


def _split(items: list[int], parts: int) -> list[list[int]]:
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


class ReductionToOneDevice(CrossDeviceOps):
    """Copy every replica's value to one device and reduce there (works on any device)."""

    def __init__(self, reduce_to_device: str | torch.device | None = None) -> None:
        super().__init__(num_packs=1)
        self.reduce_to_device = torch.device(reduce_to_device) if reduce_to_device else None

    def _reduce_flat(
        self, op: ReduceOp, flats: list[torch.Tensor], destination: torch.device
    ) -> torch.Tensor:
        target = self.reduce_to_device or destination
        acc = flats[0].to(target, copy=True)
        for other in flats[1:]:
            _combine(op, acc, other.to(target))
        return acc.to(destination)


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """Reduce in a binary tree of devices: pairs, then pairs of pairs (any device type)."""

    def _reduce_flat(
        self, op: ReduceOp, flats: list[torch.Tensor], destination: torch.device
    ) -> torch.Tensor:
        level = [f.clone() for f in flats]
        while len(level) > 1:
            nxt = []
            for i in range(0, len(level), 2):
                if i + 1 < len(level):
                    nxt.append(_combine(op, level[i], level[i + 1].to(level[i].device)))
                else:
                    nxt.append(level[i])
            level = nxt
        return level[0].to(destination)


class NcclAllReduce(CrossDeviceOps):
    """NCCL on distinct CUDA devices; elsewhere, ``ReductionToOneDevice`` with a warning."""

    def __init__(self, num_packs: int = 1) -> None:
        super().__init__(num_packs)
        self._fallback = ReductionToOneDevice()
        self._warned = False

    @staticmethod
    def _distinct_cuda(devices: Sequence[torch.device]) -> bool:
        cuda = [d for d in devices if d.type == "cuda"]
        return len(cuda) == len(devices) and len({d.index for d in cuda}) == len(cuda)

    def check_devices(
        self, devices: Sequence[torch.device], names: Sequence[str] | None = None
    ) -> None:
        if not self._distinct_cuda(devices):
            self._warn_fallback(names or [str(d) for d in devices])

    def _warn_fallback(self, names: Sequence[str]) -> None:
        if not self._warned:
            self._warned = True
            kinds = ", ".join(names)
            warnings.warn(
                f"NcclAllReduce needs one distinct CUDA device per replica, but the replicas "
                f"are on {kinds}; reducing with ReductionToOneDevice instead",
                stacklevel=4,
            )

    def _reduce_flat(
        self, op: ReduceOp, flats: list[torch.Tensor], destination: torch.device
    ) -> torch.Tensor:
        devices = [f.device for f in flats]
        if not (self._distinct_cuda(devices) and torch.cuda.nccl.is_available(flats)):
            self._warn_fallback([str(d) for d in devices])
            return self._fallback._reduce_flat(op, flats, destination)
        nccl_op = {ReduceOp.SUM: 0, ReduceOp.MEAN: 0, ReduceOp.MAX: 2, ReduceOp.MIN: 3}[op]
        flats = [f.contiguous() for f in flats]
        torch.cuda.nccl.reduce(flats, root=0, op=nccl_op)
        return flats[0].to(destination)
