"""What a step on a mesh runs under: plain tensors replicated, unshardable operators named.

``replicated_plain_tensors()``: DTensor treats every plain tensor made inside ``forward``
(position ids, rotary tables, attention masks: the same on every process) as replicated on the
mesh of the DTensors it meets (torch's ``implicit_replication``), and an empty key/value cache
(``torch.tensor([])``) is left for ``torch.cat`` to skip. ``shardable_attention(device_type)``
makes ``scaled_dot_product_attention`` use a kernel DTensor can shard (on CPU the math kernel;
CUDA's fused kernels are left to SDPA). ``named_operator_errors()`` turns DTensor's refusal of an
operator without a sharding rule into a ``ShardingRuleError`` naming the operator, the module it
ran in when known, and what to do; so too its refusal to reshape a batch the mesh cuts unevenly
(``torch.chunk``'s cut: 11 over 2 is 6 + 5), where the error says to give batches that divide.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from stratagem.dtensor.errors import ShardingRuleError

__all__ = [
    "named_operator_errors",
    "replicated_plain_tensors",
    "shardable_attention",
    "sharding_rule_error",
]


@contextlib.contextmanager
def replicated_plain_tensors() -> Iterator[None]:
    """Plain tensors meeting DTensors are taken as replicated, and ``torch.cat`` skips a 1-D
    empty one among DTensors as it does among plain tensors. The previous setting is restored
    on exit (torch's own context manager always resets it to off, which would end an enclosing
    one early). The setting is per thread, like autograd's on CPU, which runs backward on the
    thread that calls it."""
    previous = torch._C._get_dtensor_allow_implicit_replication()
    torch._C._set_dtensor_allow_implicit_replication(True)
    try:
        with _SkipEmptyInCat():
            yield
    finally:
        torch._C._set_dtensor_allow_implicit_replication(previous)


_CATS = (torch.cat, torch.concat, torch.concatenate)


class _SkipEmptyInCat(TorchFunctionMode):
    """``torch.cat([torch.tensor([]), keys])`` on a mesh: drop the empty placeholder, as
    torch.cat itself ignores 1-D empty tensors, before DTensor sees it."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _CATS and args:
            tensors = list(args[0])
            if any(isinstance(t, DTensor) for t in tensors):
                kept = [t for t in tensors if not _legacy_empty(t)]
                args = (kept, *args[1:])
        return func(*args, **kwargs)


def _legacy_empty(tensor: object) -> bool:
    return (
        isinstance(tensor, torch.Tensor)
        and not isinstance(tensor, DTensor)
        and tensor.dim() == 1
        and tensor.numel() == 0
    )


@contextlib.contextmanager
def shardable_attention(device_type: str) -> Iterator[None]:
    """On a CPU mesh, SDPA's math kernel for the block (see the module); else SDPA's choice."""
    if device_type != "cpu":
        yield
        return
    with sdpa_kernel([SDPBackend.MATH]):
        yield


# DTensor's words for an operator it cannot shard ("Operator aten.x.default does not have a
# sharding strategy registered."): the operator's name is what we need from it.
_NO_RULE = re.compile(r"Operator (\S+) does not have a sharding strategy registered")

# Fused attention kernels with no sharding rule on some device, and the remedy that avoids
# them: every model of Hugging Face's transformers takes attn_implementation="eager".
_ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "efficient_attention")


# DTensor's refusal to reshape a dimension its mesh cuts unevenly ("Cannot flatten unevenly
# sharded tensor: dimension 0 (size 3) is not evenly divisible by mesh dimension 0 (size 2).").
_UNEVEN = re.compile(
    r"Cannot (?:un)?flatten unevenly sharded tensor: (?:output )?dimension (\d+) \(size (\d+)\) "
    r"is not evenly divisible by mesh dimension (\d+) \(size (\d+)\)"
)
# The operator, where DTensor names it ("Sharding propagation failed for aten.view.default(").
_PROPAGATING = re.compile(r"Sharding propagation failed for ([\w.]+)\(")


@contextlib.contextmanager
def named_operator_errors(
    dim_names: Sequence[str] = (), batch_dim_name: str | None = None
) -> Iterator[None]:
    """Raise ``ShardingRuleError`` for an operator DTensor cannot shard, or cannot run on a
    tensor the mesh cuts unevenly (see the module). ``dim_names``: the mesh's dimensions, in
    order, to name the one at fault; ``batch_dim_name``: the one global batches are cut along."""
    try:
        yield
    except (NotImplementedError, RuntimeError) as error:
        named = sharding_rule_error(error, sys.exc_info()[2], dim_names, batch_dim_name)
        if named is None:
            raise
        raise named from error


def sharding_rule_error(
    error: BaseException,
    tb: TracebackType | None,
    dim_names: Sequence[str] = (),
    batch_dim_name: str | None = None,
) -> ShardingRuleError | None:
    """The named error for DTensor's "no sharding strategy" ``error``, or for its refusal to
    reshape an unevenly cut dimension; None for any other."""
    uneven = _UNEVEN.search(str(error))
    if uneven is not None:
        return _uneven_error(error, uneven, tb, dim_names, batch_dim_name)
    found = _NO_RULE.search(str(error))
    if found is None:
        return None
    op = found.group(1).rstrip(".")
    where = _module_of(tb)
    place = f" in {where}" if where else ""
    if op.endswith("_backward.default") or "_backward." in op:
        place += " (during backward)"
    if any(kind in op for kind in _ATTENTION_OPS):
        remedy = (
            "This is a fused attention kernel (a CPU mesh step runs scaled_dot_product_attention "
            "with its math kernel; this one was called or forced some other way). Build the "
            "model with its eager attention "
            '(Hugging Face: from_config(config, attn_implementation="eager"), or '
            'config._attn_implementation = "eager"), which computes attention from matmul and '
            "softmax, operators DTensor can shard"
        )
    else:
        remedy = (
            "Lay the weights this operator reads out as replicated (remove their LayoutMap "
            "keys), or compute it on plain tensors (DTensor.full_tensor(), then copy_to_mesh)"
        )
    return ShardingRuleError(
        f"DTensor has no sharding rule for operator {op}{place}, so a model using it cannot "
        f"run on a mesh with these layouts. {remedy}."
    )


def _uneven_error(
    error: BaseException,
    found: re.Match[str],
    tb: TracebackType | None,
    dim_names: Sequence[str],
    batch_dim_name: str | None,
) -> ShardingRuleError:
    dim, size, mesh_dim, parts = (int(g) for g in found.groups())
    named_op = _PROPAGATING.search(str(error))
    op = named_op.group(1) if named_op else "a reshape"
    where = _module_of(tb)
    place = f" in {where}" if where else ""
    axis = dim_names[mesh_dim] if mesh_dim < len(dim_names) else f"dimension {mesh_dim}"
    shares = [len(c) for c in torch.arange(size).chunk(parts)]
    head = (
        f"DTensor cannot run {op}{place} on a tensor whose dimension {dim} (size {size}) the "
        f"mesh cuts unevenly along {axis!r} ({parts} parts: {' + '.join(map(str, shares))}): "
        "it flattens that dimension into another"
    )
    if batch_dim_name is not None and axis == batch_dim_name:
        remedy = (
            f"The step's global batch of {size} does not divide by the {parts} replicas along "
            f"{axis!r}, and this model reshapes across the batch (GPT-2's Conv1D: "
            f"x.view(-1, width)). Give global batches that divide by {parts}: in fit, a "
            f"batch_size and a number of examples that are multiples of {parts} (the last "
            f"batch is what is left over), or a Dataset batched with drop_remainder=True"
        )
    else:
        remedy = (
            f"Lay the tensor out so that its dimension {dim} divides by {parts}, or "
            "redistribute it (DTensor.redistribute) before the operation"
        )
    return ShardingRuleError(f"{head}. {remedy}.")


def _module_of(tb: TracebackType | None) -> str | None:
    """The innermost ``torch.nn.Module`` whose ``forward`` the error came through: its class
    (the frames know the module, not its path in the model)."""
    found = None
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and tb.tb_frame.f_code.co_name == "forward":
            found = owner
        tb = tb.tb_next
    return None if found is None else type(found).__name__
