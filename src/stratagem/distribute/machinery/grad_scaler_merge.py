"""``torch.amp.GradScaler`` called inside ``strategy.run`` where replicas are threads.

Under MirroredStrategy and CentralStorageStrategy the local replicas are threads of one process
sharing one ``GradScaler`` and one optimizer. There the scaler's ``unscale_``, ``step`` and
``update``, called in a replica context of a strategy with ``MergesReplicas``, are merge calls:
every replica meets, the last to arrive sums the replicas' gradients and makes the call once, on
the summed gradients, and every replica gets its result, so there is one overflow decision for
all (as DDP's one scaler per process gives). Elsewhere the methods are torch's own, unchanged.
Installed once, with the strategies' other global hooks (``scope_hooks.install_hooks``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from stratagem.distribute.capabilities import MergesReplicas
from stratagem.distribute.machinery import context

_MERGED = ("unscale_", "step", "update")
_lock = threading.Lock()
_installed = False


def _merged(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        ctx = context.current_replica()
        extended = ctx.strategy.extended if ctx is not None else None
        if not isinstance(extended, MergesReplicas):
            return original(self, *args, **kwargs)
        results: list[Any] = []

        def once() -> None:
            # In the cross-replica context: the optimizer step inside runs as a step outside
            # strategy.run does (its own merge calls just run).
            previous = context.set_replica(None)
            try:
                extended.reduce_pending_gradients()
                results.append(original(self, *args, **kwargs))
            finally:
                context.set_replica(previous)

        extended.merge_call(f"GradScaler.{name}()", once)
        return results[0] if results else None

    return method


def install() -> None:
    """Wrap ``torch.amp.GradScaler``'s ``unscale_``, ``step`` and ``update`` (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        for name in _MERGED:
            setattr(torch.amp.GradScaler, name, _merged(name, getattr(torch.amp.GradScaler, name)))
        _installed = True


__all__ = ["install"]
