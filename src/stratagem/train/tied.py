"""Tied tensors in what is saved: one tensor that a module holds under several names (tied
embeddings: GPT-2's ``lm_head.weight is transformer.wte.weight``) is written once, under its
first name in module order, beside a record of its other names (its *aliases*), as Hugging Face
writes a tied model; a load gives every alias that same tensor again.

Ties are found by identity: only the tensor says that two names are one parameter (their values
are equal in any copy). Checkpoints (``sharded.py``: DCP) and saved models
(``keras/saving.py``: safetensors) use this module.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import TypeVar

import torch

T = TypeVar("T")


def tied_names(module: torch.nn.Module) -> dict[str, str]:
    """``{alias: name}``: each further name of a parameter or buffer that ``module`` holds
    under several names, mapped to its first name in module order (the one that is written)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    named = itertools.chain(
        module.named_parameters(remove_duplicate=False),
        module.named_buffers(remove_duplicate=False),
    )
    for name, tensor in named:
        if tensor is None:
            continue
        written = first.setdefault(id(tensor), name)
        if written != name:
            aliases[name] = written
    return aliases


def without_aliases(state: Mapping[str, T], aliases: Mapping[str, str]) -> dict[str, T]:
    """``state`` without the aliases' entries: each tied tensor once, under its first name."""
    return {key: value for key, value in state.items() if key not in aliases}


def with_aliases(state: Mapping[str, T], aliases: Mapping[str, str], what: str) -> dict[str, T]:
    """``state`` with an entry for each alias: the value of the name it is tied to."""
    missing = sorted({name for name in aliases.values() if name not in state})
    if missing:
        raise ValueError(
            f"{what} records tied names {dict(aliases)} but holds no value for {missing}; "
            "expected the tied tensor under its first name"
        )
    return {**state, **{alias: state[name] for alias, name in aliases.items()}}


def tie(module: torch.nn.Module, aliases: Mapping[str, str], what: str) -> None:
    """Make each alias of ``module`` the very tensor of the name it is tied to: a module rebuilt
    from a program (``torch.export``) holds a separate copy under each name, which training
    would let drift apart. ``what`` names the source of ``aliases`` in errors."""
    for alias, name in aliases.items():
        target = _tensor_at(module, name, what)
        owner_path, _, leaf = alias.rpartition(".")
        current = _tensor_at(module, alias, what)
        if current is target:
            continue
        if current.shape != target.shape or current.dtype != target.dtype:
            raise ValueError(
                f"{what} says {alias!r} is tied to {name!r}, but the module holds "
                f"{list(current.shape)} {current.dtype} at {alias!r} and "
                f"{list(target.shape)} {target.dtype} at {name!r}; expected one tensor"
            )
        owner = module.get_submodule(owner_path)
        if leaf in owner._parameters:
            # Registered anew (not written into ``_parameters``): a strategy's scope sees it.
            setattr(owner, leaf, target)
        else:
            owner._buffers[leaf] = target  # keeps the buffer's persistence as it is


def _tensor_at(module: torch.nn.Module, name: str, what: str) -> torch.Tensor:
    owner_path, _, leaf = name.rpartition(".")
    try:
        owner = module.get_submodule(owner_path)
    except AttributeError:
        owner = None
    tensor = None
    if owner is not None:
        tensor = owner._parameters.get(leaf, owner._buffers.get(leaf))
    if tensor is None:
        raise ValueError(
            f"{what} ties {name!r}, which {type(module).__name__} has no parameter or buffer "
            "of; expected the module that was saved"
        )
    return tensor
