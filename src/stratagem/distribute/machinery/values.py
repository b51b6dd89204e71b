"""Values that differ per replica, and how ``strategy.run`` spreads and gathers them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.utils import _pytree as pytree


class PerReplica:
    """One value per local replica (``sg.distribute.PerReplica``); ``.values`` in replica order."""

    __slots__ = ("values",)

    def __init__(self, values: Sequence[Any]) -> None:
        self.values = tuple(values)

    def __len__(self) -> int:
        return len(self.values)

    def __repr__(self) -> str:
        inner = ",\n  ".join(f"{i}: {v!r}" for i, v in enumerate(self.values))
        return f"PerReplica({{\n  {inner}\n}})"


def _is_per_replica(x: Any) -> bool:
    return isinstance(x, PerReplica)


def select_replica(structure: Any, replica: int, num_replicas: int) -> Any:
    """The structure as replica ``replica`` sees it: each PerReplica leaf → its own value."""

    def pick(leaf: Any) -> Any:
        if isinstance(leaf, PerReplica):
            if len(leaf.values) != num_replicas:
                raise ValueError(
                    f"a PerReplica value holds {len(leaf.values)} values but the strategy "
                    f"runs {num_replicas} local replicas"
                )
            return select_replica(leaf.values[replica], replica, num_replicas)
        return leaf

    return pytree.tree_map(pick, structure, is_leaf=_is_per_replica)


def regroup(results: Sequence[Any]) -> Any:
    """Per-replica results of one structure → that structure with PerReplica leaves."""
    if len(results) == 1:
        return results[0]
    flat0, spec0 = pytree.tree_flatten(results[0])
    columns = [flat0]
    for i, r in enumerate(results[1:], start=1):
        flat, spec = pytree.tree_flatten(r)
        if spec != spec0:
            raise ValueError(
                f"replica {i} returned a different structure than replica 0: {spec} vs {spec0}"
            )
        columns.append(flat)
    leaves = [
        None if all(c[k] is None for c in columns) else PerReplica([c[k] for c in columns])
        for k in range(len(flat0))
    ]
    return pytree.tree_unflatten(leaves, spec0)


def local_results(value: Any) -> tuple[Any, ...]:
    """The local replicas' values of ``value`` (a PerReplica, or one value for every replica)."""
    if isinstance(value, PerReplica):
        return value.values
    return (value,)
