"""Nested structures of tensors (tuples, lists, dicts) as tf.data sees them.

A dataset element keeps the structure of what it was built from: a tuple stays a tuple, a dict a
dict. These helpers flatten a structure to its leaves (with a readable path per leaf, for error
messages) and pack leaves back into the same structure.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from stratagem.errors import InputError

Path = str


def is_structure(value: Any) -> bool:
    """Whether ``value`` is a container of components rather than one component.

    Tuples and dicts always are. A list is one too, unless it holds only numbers or strings (or
    lists of them), or nothing: ``[1, 2, 3]``, ``["a", "b"]`` and ``[]`` are data, as TensorFlow
    reads them, while ``[x, y]`` of arrays is a pair. ``None`` is a structure with no
    components: TF accepts a ``None`` in an element (``from_tensors((42, None))``, its
    ``NoneTensorSpec`` has no tensors), and every stage passes it through as it is.
    """
    if value is None or isinstance(value, (tuple, dict)):
        return True
    return isinstance(value, list) and not _is_data_list(value)


def _is_data_list(value: list[Any]) -> bool:
    return all(
        isinstance(item, (numbers.Number, np.generic, str, bytes))
        or (isinstance(item, list) and _is_data_list(item))
        for item in value
    )


def is_strings(value: Any) -> bool:
    """Whether ``value`` is a string component: a numpy array of str/bytes, or one string.

    torch has no string tensors, so string components stay numpy arrays (a batch) and Python
    strings (an element), where TensorFlow has ``tf.string`` tensors.
    """
    if isinstance(value, (str, bytes)):
        return True
    return isinstance(value, np.ndarray) and value.dtype.kind in "USO"


def children(value: Any) -> list[tuple[str, Any]]:
    """The (path suffix, child) pairs of one structure level, in iteration order."""
    if value is None:
        return []
    if isinstance(value, dict):
        return [(f"[{key!r}]", child) for key, child in value.items()]
    return [(f"[{i}]", child) for i, child in enumerate(value)]


def flatten_with_paths(value: Any, path: Path = "") -> list[tuple[Path, Any]]:
    """The leaves of ``value`` with their paths (``[0]['image']``), depth first."""
    if not is_structure(value):
        return [(path or "<element>", value)]
    leaves: list[tuple[Path, Any]] = []
    for suffix, child in children(value):
        leaves.extend(flatten_with_paths(child, path + suffix))
    return leaves


def flatten(value: Any) -> list[Any]:
    """The leaves of ``value``, depth first (no paths: this runs once per element)."""
    if not is_structure(value):
        return [value]
    if value is None:
        return []
    items = value.values() if isinstance(value, dict) else value
    leaves: list[Any] = []
    for child in items:
        leaves.extend(flatten(child))
    return leaves


def pack(template: Any, leaves: Iterator[Any]) -> Any:
    """``template``'s structure with its leaves replaced, in order, by those of ``leaves``."""
    if not is_structure(template):
        return next(leaves)
    if template is None:
        return None
    if isinstance(template, dict):
        return {key: pack(child, leaves) for key, child in template.items()}
    packed = [pack(child, leaves) for child in template]
    if isinstance(template, list):
        return packed
    if hasattr(template, "_fields"):  # a namedtuple keeps its type
        return type(template)(*packed)
    return tuple(packed)


def packer(template: Any) -> Callable[[list[Any]], Any]:
    """A function packing a list of leaves into ``template``'s structure, fast for the usual
    shapes (one tensor, a flat tuple or dict), since it runs once per element.
    """
    if not is_structure(template):
        return operator.itemgetter(0)
    if template is None:
        return lambda leaves: None
    members = template.values() if isinstance(template, dict) else template
    if not any(is_structure(child) for child in members):
        if type(template) is tuple:
            return tuple
        if type(template) is list:
            return list
        if type(template) is dict:
            keys = list(template)
            return lambda leaves: dict(zip(keys, leaves))
    return lambda leaves: pack(template, iter(leaves))


def map_structure(fn: Callable[[Path, Any], Any], value: Any) -> Any:
    """``value`` with every leaf replaced by ``fn(path, leaf)``."""
    return pack(value, iter([fn(path, leaf) for path, leaf in flatten_with_paths(value)]))


def map_leaves(fn: Callable[[Any], Any], value: Any) -> Any:
    """``value`` with every leaf replaced by ``fn(leaf)``; the per-element form, without paths."""
    if not is_structure(value):
        return fn(value)
    if value is None:
        return None
    if isinstance(value, dict):
        return {key: map_leaves(fn, child) for key, child in value.items()}
    mapped = [map_leaves(fn, child) for child in value]
    if isinstance(value, list):
        return mapped
    return type(value)(*mapped) if hasattr(value, "_fields") else tuple(mapped)


def to_tensor(path: Path, value: Any) -> torch.Tensor | np.ndarray:
    """One component as a torch tensor; numpy arrays keep their dtype (uint8 stays uint8).

    Strings (a str, a list of them, a numpy array of str or bytes) become a numpy array of
    strings instead: torch has no string dtype.
    """
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (str, bytes)) or (isinstance(value, list) and _holds_strings(value)):
        return np.array(value)
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "US":
            return value
        if value.dtype.kind == "O" and _holds_strings(value.tolist()):
            return value
        if value.dtype.kind not in "biufc":
            raise InputError(
                f"component {path} has numpy dtype {value.dtype}, which has no torch "
                "equivalent; expected a numeric or boolean array"
            )
        if not value.dtype.isnative:
            value = value.astype(value.dtype.newbyteorder("="))
        if not value.flags.writeable:
            value = value.copy()  # torch would warn: it cannot share read-only memory safely
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, np.generic) and value.dtype.kind in "US":
        return np.array(value)
    if isinstance(value, (numbers.Number, np.generic, list)):
        return torch.as_tensor(value)
    raise TypeError(
        f"component {path} is a {type(value).__name__}; expected a torch tensor, a numpy array, "
        "a number, a string, or a list of numbers or strings"
    )


def _holds_strings(items: list[Any]) -> bool:
    """Whether a (nested) list holds strings, and only strings, at its bottom."""
    flat: list[Any] = []
    stack = list(items)
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        else:
            flat.append(item)
    return bool(flat) and all(isinstance(item, (str, bytes)) for item in flat)


def rank(value: torch.Tensor | np.ndarray) -> int:
    return int(value.ndim)
