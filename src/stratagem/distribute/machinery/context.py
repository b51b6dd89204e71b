"""Which strategy is current, and in which replica the running code is (thread-local).

TF's two contexts: *cross-replica* (inside ``strategy.scope()``, outside ``run``) and *replica*
(inside the function given to ``strategy.run``, once per replica). Replica threads get their
own context; code outside any strategy sees the default strategy and its single replica.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

_local = threading.local()


class StrategyLike(Protocol):
    """What the machinery needs of a strategy: ``sg.distribute.Strategy`` (above the
    machinery, in ``distribute/strategy.py``) is one."""

    @property
    def extended(self) -> Any: ...

    @property
    def num_replicas_in_sync(self) -> int: ...


# The default strategy's maker: ``distribute/default_strategy.py`` provides it when imported
# (importing any part of ``stratagem.distribute`` imports it), so this module needs no import
# of the strategies built on it.
_default_maker: Callable[[], StrategyLike] | None = None


def provide_default(maker: Callable[[], StrategyLike]) -> None:
    """Name the maker of the default strategy (what code outside any scope sees)."""
    global _default_maker
    _default_maker = maker


@dataclass(frozen=True)
class ReplicaContext:
    """Where code inside ``strategy.run`` runs (``sg.distribute.get_replica_context()``)."""

    strategy: StrategyLike
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


def _scopes() -> list[StrategyLike]:
    stack = getattr(_local, "scopes", None)
    if stack is None:
        stack = _local.scopes = []
    return stack


def default_strategy() -> StrategyLike:
    """The default strategy (one replica, nothing placed): TF's when no strategy is active."""
    if _default_maker is None:
        raise RuntimeError(
            "the default strategy is not provided yet: import stratagem.distribute (it provides "
            "it) before asking for the current strategy"
        )
    return _default_maker()


def mixing_error(current: StrategyLike, strategy: StrategyLike) -> RuntimeError:
    """TF's error for using ``strategy`` where ``current`` is in scope (its wording first)."""
    return RuntimeError(
        f"Mixing different sg.distribute.Strategy objects: {current!r} is not {strategy!r} "
        f"(mixing strategies is not supported: leave the scope of {type(current).__name__} "
        f"before using {type(strategy).__name__})"
    )


def check_not_mixed(strategy: StrategyLike) -> None:
    """Raise TF's "Mixing different ... Strategy objects" unless ``strategy`` may be used here:
    no other strategy's scope is current in this thread (TF's
    ``_require_cross_replica_or_default_context_extended``)."""
    current = scope_strategy()
    if current is not None and current is not strategy and current is not default_strategy():
        raise mixing_error(current, strategy)


def push_scope(strategy: StrategyLike) -> None:
    """Enter ``strategy``'s scope. The same strategy may nest; another one inside it may not
    (TF's "Mixing different tf.distribute.Strategy objects"), except inside the default
    strategy's scope, which TF does not count as a strategy (``has_strategy()`` is False there).
    The default strategy inside another's scope is TF's "Must not nest" error."""
    stack = _scopes()
    if stack and stack[-1] is not strategy and stack[-1] is not default_strategy():
        if strategy is default_strategy():
            raise RuntimeError(
                f"Must not nest sg.distribute.Strategy scopes: the default strategy's scope "
                f"entered inside the scope of {stack[-1]!r}"
            )
        raise mixing_error(stack[-1], strategy)
    stack.append(strategy)


def pop_scope(strategy: StrategyLike) -> bool:
    """Leave a scope; True when that was the outermost scope of ``strategy`` in this thread."""
    stack = _scopes()
    assert stack and stack[-1] is strategy, "scopes must be exited in the order they were entered"
    stack.pop()
    return strategy not in stack


def scope_strategy() -> StrategyLike | None:
    """The strategy whose scope this thread is in, if any."""
    stack = _scopes()
    return stack[-1] if stack else None


def current_replica() -> ReplicaContext | None:
    return getattr(_local, "replica", None)


def set_replica(ctx: ReplicaContext | None) -> ReplicaContext | None:
    previous = getattr(_local, "replica", None)
    _local.replica = ctx
    return previous


def get_strategy() -> StrategyLike:
    """The current strategy: the one whose scope or ``run`` we are in, else the default."""
    ctx = current_replica()
    if ctx is not None:
        return ctx.strategy
    scoped = scope_strategy()
    if scoped is not None:
        return scoped
    return default_strategy()


def _strategy_scope() -> StrategyLike | None:
    """The scope's strategy unless it is the default one: TF's default strategy's scope keeps
    the default state (``has_strategy()`` False, the default replica context current)."""
    scoped = scope_strategy()
    return None if scoped is None or scoped is default_strategy() else scoped


def has_strategy() -> bool:
    """Whether a non-default strategy is current."""
    return current_replica() is not None or _strategy_scope() is not None


def get_replica_context() -> ReplicaContext | None:
    """The replica context; None in a cross-replica context (inside a scope, outside run)."""
    ctx = current_replica()
    if ctx is not None:
        return ctx
    if _strategy_scope() is not None:
        return None
    return ReplicaContext(default_strategy(), 0, 0, None)


def in_cross_replica_context() -> bool:
    return current_replica() is None and _strategy_scope() is not None
