"""The reduction operations shared by collectives, cross-device ops and ``strategy.reduce``."""

from __future__ import annotations

import enum

import torch.distributed as dist


class ReduceOp(enum.Enum):
    """How values from several replicas combine (``sg.distribute.ReduceOp``)."""

    SUM = "SUM"
    MEAN = "MEAN"
    MAX = "MAX"
    MIN = "MIN"

    @classmethod
    def parse(cls, op: ReduceOp | str) -> ReduceOp:
        """Accept a ReduceOp or its name in any case; reject anything else with the choices."""
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str) and op.upper() in cls.__members__:
            return cls[op.upper()]
        choices = ", ".join(f"ReduceOp.{m}" for m in cls.__members__)
        raise ValueError(f"unknown reduce op {op!r}; expected one of {choices}")

    def to_dist(self) -> dist.ReduceOp.RedOpType:
        """The torch.distributed op; MEAN is a SUM that the caller divides (gloo has no AVG)."""
        return {
            ReduceOp.SUM: dist.ReduceOp.SUM,
            ReduceOp.MEAN: dist.ReduceOp.SUM,
            ReduceOp.MAX: dist.ReduceOp.MAX,
            ReduceOp.MIN: dist.ReduceOp.MIN,
        }[self]
