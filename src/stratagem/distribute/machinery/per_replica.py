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


def local_results(value: Any, num_replicas: int | None = None) -> tuple[Any, ...]:
    """The local replicas' values of ``value``, a tuple with one per replica, as TF's
    ``experimental_local_results``: a PerReplica's values; for a nested structure (a tuple,
    dict... holding PerReplica leaves), one copy of the structure per replica, each with the
    replica's own leaves (a leaf that is not a PerReplica is the same in every copy); any
    other value: ``(value,)``. ``num_replicas`` is the number of local replicas (by default,
    the length of the structure's PerReplica leaves)."""
    if isinstance(value, PerReplica):
        return value.values
    leaves = pytree.tree_leaves(value, is_leaf=_is_per_replica)
    if not _is_nested(value):
        return (value,)
    counts = {len(leaf.values) for leaf in leaves if isinstance(leaf, PerReplica)}
    if len(counts) > 1 or (num_replicas is not None and counts - {num_replicas}):
        raise ValueError(
            f"the structure's PerReplica values hold {sorted(counts)} values each, for "
            f"{num_replicas} local replicas"
        )
    n = num_replicas if num_replicas is not None else next(iter(counts), 1)
    return tuple(
        pytree.tree_map(
            lambda leaf, i=i: leaf.values[i] if isinstance(leaf, PerReplica) else leaf,
            value,
            is_leaf=_is_per_replica,
        )
        for i in range(n)
    )


def _is_nested(value: Any) -> bool:
    """TF's ``nest.is_nested``: a tuple, list, dict (or namedtuple) is a structure."""
    return isinstance(value, tuple | list | dict)
