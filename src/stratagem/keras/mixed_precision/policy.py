"""Keras's dtype policies: what a model computes in and what its weights are kept in.

``Policy("mixed_bfloat16")`` computes in bfloat16 and keeps float32 weights;
``"mixed_float16"`` likewise in float16 (and ``Model.compile`` then wraps the optimizer in a
``LossScaleOptimizer``, as Keras does); ``"float32"`` (the default), ``"bfloat16"``,
``"float16"`` and ``"float64"`` compute and keep weights in one dtype.

Keras casts inside each layer; here a whole ``torch.nn.Module`` runs under the policy:
``torch.autocast`` on the input's device type for a mixed policy (float32 weights, the
matmuls and convolutions in the compute dtype, the ops autocast keeps in float32 there), and
floating inputs cast to the dtype for a single-dtype policy (whose module must hold weights of
that dtype already). A model reads the global policy once, when ``sg.keras.Model(module)``
wraps the module, as a Keras layer reads it when it is constructed.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.utils import _pytree as pytree

from stratagem.shipping.portable import Portable

_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
_MIXED = ("mixed_float16", "mixed_bfloat16")
VALID_NAMES: tuple[str, ...] = (*_MIXED, *_DTYPES)


class Policy(Portable):
    """A dtype policy (``tf.keras.mixed_precision.Policy``): ``name``, ``compute_dtype`` and
    ``variable_dtype`` (dtype names, as Keras gives them)."""

    def __init__(self, name: str) -> None:
        if isinstance(name, Policy):
            name = name.name
        if not isinstance(name, str):
            raise TypeError(f"Policy(name) takes a string, got {type(name).__name__}: {name!r}")
        if name in _MIXED:
            compute, variable = name.removeprefix("mixed_"), "float32"
        elif name in _DTYPES:
            compute = variable = name
        else:
            raise ValueError(
                f"Cannot convert value {name!r} to a mixed precision Policy; valid policies: "
                f"{', '.join(repr(n) for n in VALID_NAMES)}"
            )
        self._name = name
        self._compute_dtype = compute
        self._variable_dtype = variable

    @property
    def name(self) -> str:
        return self._name

    @property
    def compute_dtype(self) -> str:
        """The dtype layers compute in (``"bfloat16"`` for ``"mixed_bfloat16"``)."""
        return self._compute_dtype

    @property
    def variable_dtype(self) -> str:
        """The dtype weights are kept in (``"float32"`` for the mixed policies)."""
        return self._variable_dtype

    @property
    def torch_compute_dtype(self) -> torch.dtype:
        return _DTYPES[self._compute_dtype]

    @property
    def torch_variable_dtype(self) -> torch.dtype:
        return _DTYPES[self._variable_dtype]

    @property
    def is_mixed(self) -> bool:
        return self._compute_dtype != self._variable_dtype

    def get_config(self) -> dict[str, Any]:
        return {"name": self._name}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Policy:
        return cls(config["name"])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and other.name == self._name

    def __hash__(self) -> int:
        return hash(self._name)

    def __repr__(self) -> str:
        return f'<Policy "{self._name}">'


_DEFAULT = Policy("float32")
_global: Policy | None = None


def global_policy() -> Policy:
    """The policy new models take (``"float32"`` until ``set_global_policy``)."""
    return _global if _global is not None else _DEFAULT


def set_global_policy(policy: Policy | str | None) -> None:
    """Set the policy models constructed from now on take; None restores ``"float32"``.

    Models already constructed keep theirs (Keras: layers read the policy when constructed).
    """
    global _global
    _global = None if policy is None else Policy(policy)


def policy_of(dtype: Policy | str | None) -> Policy:
    """A model's policy from its ``dtype=`` argument: the global policy when None."""
    return global_policy() if dtype is None else Policy(dtype)


def check_module(policy: Policy, module: torch.nn.Module, what: str) -> None:
    """Refuse a module whose floating weights are not in the policy's variable dtype (only
    for policies other than the default, so that float32 models of any dtype keep working)."""
    if policy == _DEFAULT:
        return
    found = sorted(
        {str(p.dtype).removeprefix("torch.") for p in module.parameters() if p.is_floating_point()}
    )
    expected = policy.variable_dtype
    if any(d != expected for d in found):
        hint = (
            f"build the module in {expected} (module.to(torch.{expected})) before strategy.scope()"
            if not policy.is_mixed
            else "keep the module in float32: autocast computes in the policy's compute dtype"
        )
        raise ValueError(
            f"{what}: policy {policy.name!r} keeps weights in {expected}, but the module's "
            f"floating weights are {found}; {hint}"
        )


def compute_scope(policy: Policy, device_type: str) -> contextlib.AbstractContextManager[Any]:
    """Where a forward pass computes in the policy's compute dtype: ``torch.autocast`` for a
    mixed policy, nothing otherwise."""
    if not policy.is_mixed:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=policy.torch_compute_dtype)


def cast_inputs(policy: Policy, inputs: Any) -> Any:
    """Floating input tensors in a single-dtype policy's dtype (a float64 or bfloat16 model
    fed float32 arrays); left alone for mixed policies (autocast casts per op) and float32."""
    if policy.is_mixed or policy == _DEFAULT:
        return inputs
    dtype = policy.torch_compute_dtype

    def cast(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
            return t.to(dtype)
        return t

    return pytree.tree_map(cast, inputs)


def as_float32(outputs: Any) -> Any:
    """Outputs in float32 where they are a lower floating dtype: the loss and the metrics are
    computed in float32 (Keras casts ``y_pred`` up before the loss)."""

    def up(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16):
            return t.float()
        return t

    return pytree.tree_map(up, outputs)
