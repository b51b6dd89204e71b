"""Which strategy is current, and in which replica the running code is (thread-local).

TF's two contexts: *cross-replica* (inside ``strategy.scope()``, outside ``run``) and *replica*
(inside the function given to ``strategy.run``, once per replica). Replica threads get their
own context; code outside any strategy sees the default strategy and its single replica.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stratagem.distribute.strategy import Strategy

_local = threading.local()


@dataclass(frozen=True)
class ReplicaContext:
    """Where code inside ``strategy.run`` runs (``sg.distribute.get_replica_context()``)."""

    strategy: Strategy
    replica_id_in_sync_group: int  # global id: worker_index * local replicas + local id
    local_replica_id: int
    # Size of the global batch the replica's input came from, when the input says so: a last
    # partial batch is smaller than the nominal one.
    global_batch_size: int | None = None

    @property
    def num_replicas_in_sync(self) -> int:
        return self.strategy.num_replicas_in_sync

    def all_reduce(self, reduce_op: Any, value: Any) -> Any:
        """Reduce ``value`` across every replica, from inside ``run`` (a sync point)."""
        return self.strategy.extended.replica_all_reduce(self, reduce_op, value)

    def __repr__(self) -> str:
        return (
            f"ReplicaContext(replica {self.replica_id_in_sync_group} of "
            f"{self.num_replicas_in_sync}, {type(self.strategy).__name__})"
        )


def _scopes() -> list[Strategy]:
    stack = getattr(_local, "scopes", None)
    if stack is None:
        stack = _local.scopes = []
    return stack


def push_scope(strategy: Strategy) -> None:
    stack = _scopes()
    if stack and stack[-1] is not strategy:
        raise RuntimeError(
            f"cannot enter the scope of {type(strategy).__name__} inside the scope of "
            f"{type(stack[-1]).__name__}: mixing strategies is not supported"
        )
    stack.append(strategy)


def pop_scope(strategy: Strategy) -> bool:
    """Leave a scope; True when that was the outermost scope of ``strategy`` in this thread."""
    stack = _scopes()
    assert stack and stack[-1] is strategy, "scopes must be exited in the order they were entered"
    stack.pop()
    return strategy not in stack


def scope_strategy() -> Strategy | None:
    """The strategy whose scope this thread is in, if any."""
    stack = _scopes()
    return stack[-1] if stack else None


def current_replica() -> ReplicaContext | None:
    return getattr(_local, "replica", None)


def set_replica(ctx: ReplicaContext | None) -> ReplicaContext | None:
    previous = getattr(_local, "replica", None)
    _local.replica = ctx
    return previous


def get_strategy() -> Strategy:
    """The current strategy: the one whose scope or ``run`` we are in, else the default."""
    ctx = current_replica()
    if ctx is not None:
        return ctx.strategy
    scoped = scope_strategy()
    if scoped is not None:
        return scoped
    from stratagem.distribute.default_strategy import default_strategy

    return default_strategy()


def has_strategy() -> bool:
    """Whether a non-default strategy is current."""
    return current_replica() is not None or scope_strategy() is not None


def get_replica_context() -> ReplicaContext | None:
    """The replica context; None in a cross-replica context (inside a scope, outside run)."""
    ctx = current_replica()
    if ctx is not None:
        return ctx
    if scope_strategy() is not None:
        return None
    from stratagem.distribute.default_strategy import default_strategy

    return ReplicaContext(default_strategy(), 0, 0, None)


def in_cross_replica_context() -> bool:
    return current_replica() is None and scope_strategy() is not None
