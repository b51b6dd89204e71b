"""Optimizers made before a strategy replaced their parameters (laid out on a mesh, sharded).

A model built in a scope is replaced at the scope's end, or at the first step inside it, by
DTensor parameters; an optimizer created in the scope still holds the old ones. At its first
step the strategy points it at the replacements, which is safe while it holds no state for the
old ones (it has never stepped them); anything else is an error that says what to do.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from stratagem.comm.dtensor_check import is_dtensor


def repoint_optimizer(
    optimizer: torch.optim.Optimizer, replaced: Mapping, *, what_happened: str, remedy: str
) -> None:
    """Replace in ``optimizer`` each parameter found in ``replaced`` (old -> new).

    ``what_happened`` ("MeshStrategy laid the model out on the mesh") and ``remedy`` complete
    the error for parameters that cannot be replaced."""
    stale = 0
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            if is_dtensor(p):
                continue
            new = replaced.get(p)
            if new is None or optimizer.state.get(p):
                stale += 1
            else:
                params[i] = new
    if stale:
        total = sum(len(g["params"]) for g in optimizer.param_groups)
        raise RuntimeError(
            f"this optimizer updates {stale} of its {total} parameters as they were before "
            f"{what_happened}, and they cannot be replaced (not replaced by this strategy, or "
            f"already stepped); {remedy}"
        )
