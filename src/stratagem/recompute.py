"""``sg.recompute_grad``: TensorFlow's activation checkpointing, on ``torch.utils.checkpoint``.

``tf.recompute_grad(f)`` returns a function that computes ``f`` without keeping its intermediate
activations and computes it again during backward: memory for compute. Here it is
``torch.utils.checkpoint.checkpoint(f, ..., use_reentrant=False)``: it works with
``torch.compile``, with inputs that need no gradient, and inside every strategy (the
recomputation runs in the thread and torch modes of the backward that needs it, and gradients
still reach each parameter through its own ``AccumulateGrad``, so the bucketed all-reduce hooks
fire as without it). Random operations are replayed with the same random state, as TF's are.
Given an ``nn.Module``, its own ``forward`` is checkpointed in place, so its parameters and
``state_dict`` keys stay as they were; ``sg.keras.remat`` is the same function.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.utils.checkpoint import checkpoint

F = TypeVar("F", bound=Callable[..., Any])


def recompute_grad(f: F) -> F:
    """``tf.recompute_grad(f)``: ``f`` that recomputes its activations during backward.

    ``f`` is a function of tensors (and other values) or an ``nn.Module``, whose ``forward``
    is then wrapped in place and the module returned.
    """
    if isinstance(f, torch.nn.Module):
        if getattr(f.forward, "recomputes_grad", False):
            return f  # already checkpointed: checkpointing twice recomputes twice
        f.forward = _checkpointed(f.forward)
        return f
    if not callable(f):
        raise TypeError(
            f"recompute_grad takes a function or an nn.Module, got {type(f).__name__}: {f!r}"
        )
    return _checkpointed(f)  # type: ignore[return-value]


def _checkpointed(f: Callable[..., Any]) -> Any:
    @functools.wraps(f)
    def recomputed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return f(*args, **kwargs)  # nothing is kept for backward anyway
        return checkpoint(f, *args, use_reentrant=False, **kwargs)

    recomputed.recomputes_grad = True  # type: ignore[attr-defined]
    return recomputed
