"""``fit``'s global-token rule for a model's own loss: a language model's padded batches train
as one process on the whole global batch, under any split and any gradient accumulation.

A module whose loss takes Hugging Face's ``num_items_in_batch`` (its ``accepts_loss_kwargs``,
else a ``forward`` naming it, or taking ``**kwargs`` beside HF's ``loss_function``) gets the
micro-batch's count of real tokens over every replica (labels other than -100, after a causal
LM's shift, as HF's Trainer counts them; one all-reduce of a number): its loss is then the sum
over its tokens divided by that count. With ``gradient_accumulation_steps=k``, micro-batch i's
loss is multiplied by N_i / N_1 (N_1 the step's first count) and the summed gradients, before
the update, by k N_1 / N (N the step's total): every real token of the step weighs 1 / N.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from stratagem import nn as sg_nn
from stratagem.distribute import get_replica_context
from stratagem.keras import module_calls

IGNORE_INDEX = -100  # HF's and torch's cross_entropy's label of a token that is not counted


@dataclass
class _StepCounts:
    """One replica's counts of the optimizer step under way."""

    first: float = 1.0  # the step's first micro-batch's global count (at least 1)
    total: float = 0.0  # the step's global count so far
    scale: float = 1.0  # the latest micro-batch's N_i / N_1
    micro_batches: int = 0  # of the step, counted so far


class GlobalTokens:
    """The counts of real tokens of ``fit``'s steps, per local replica."""

    def __init__(self) -> None:
        self._counts: dict[int, _StepCounts] = {}

    @staticmethod
    def applies(module: torch.nn.Module, signature: module_calls.ForwardSignature) -> bool:
        """Whether ``module``'s own loss takes ``num_items_in_batch`` (HF's Trainer's test)."""
        accepts = getattr(module, "accepts_loss_kwargs", None)
        if accepts is not None:
            return bool(accepts)
        if signature.takes("num_items_in_batch"):
            return True
        # HF's Trainer stops at the **kwargs; here the loss function must also name the count:
        # a classifier's (ResNet's ForSequenceClassificationLoss) takes a mean over its own
        # batch whatever the forward is given, and dividing it by a global count would be wrong.
        loss_function = getattr(module, "loss_function", None)
        return signature.takes_any_keyword and _names_count(loss_function)

    def count(
        self, module: torch.nn.Module, labels: torch.Tensor, optimizer: Any, *, training: bool
    ) -> float:
        """The global count of real tokens of this micro-batch (at least 1: a batch of padding
        only has a zero sum), which the module divides its sum by; recorded for the step when
        ``training``."""
        tokens = max(sg_nn.global_count(_real_tokens(module, labels)), 1.0)
        if training:
            counts = self._mine()
            if not optimizer.mid_accumulation:  # the step's first micro-batch
                counts.first, counts.total, counts.micro_batches = tokens, 0.0, 0
            counts.total += tokens
            counts.micro_batches += 1
            counts.scale = tokens / counts.first
        return tokens

    def loss_scale(self) -> float:
        """What this replica's loss of the micro-batch just counted is multiplied by: N_i / N_1
        (1 without accumulation)."""
        return self._mine().scale

    def rescale(self, params: Iterable[torch.nn.Parameter], optimizer: Any) -> None:
        """Before an accumulated step's update: the gradients times k N_1 / N (every
        micro-batch's backward was divided by k and by N_1, not by N)."""
        k = optimizer.gradient_accumulation_steps
        counts = self._mine()
        if not k or counts.micro_batches != k:  # not accumulating, or not the step's last
            return
        factor = k * counts.first / counts.total
        if factor == 1.0:
            return
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(factor)

    def _mine(self) -> _StepCounts:
        ctx = get_replica_context()
        replica = ctx.local_replica_id if ctx is not None else 0
        return self._counts.setdefault(replica, _StepCounts())


def _names_count(loss_function: Any) -> bool:
    """Whether ``loss_function`` takes ``num_items_in_batch`` (HF's token-level losses do)."""
    if not callable(loss_function):
        return False
    try:
        return "num_items_in_batch" in inspect.signature(loss_function).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def _real_tokens(module: torch.nn.Module, labels: torch.Tensor) -> torch.Tensor:
    """The tokens ``module``'s loss counts among ``labels``: those not ``IGNORE_INDEX``, from the
    second on where its loss shifts them (HF's ``ForCausalLMLoss``: position t predicts t+1,
    the first label is no target; an encoder-decoder's labels are not shifted)."""
    loss_function = getattr(module, "loss_function", None)
    config = getattr(module, "config", None)
    shifts = getattr(loss_function, "__name__", None) == "ForCausalLMLoss" and not getattr(
        config, "is_encoder_decoder", False
    )
    counted = labels[..., 1:] if shifts else labels
    return counted.ne(IGNORE_INDEX).sum()


__all__ = ["IGNORE_INDEX", "GlobalTokens"]
