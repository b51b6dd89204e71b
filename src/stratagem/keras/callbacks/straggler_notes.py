"""The stragglers a strategy's watch has named that a callback has not shown yet.

A strategy that times its workers' steps (``MultiWorkerMirroredStrategy``) names a worker
persistently slower than the others once, on every worker alike (``comm.stragglers``); its
``extended.straggler_watch.named`` lists them in order. ``ProgbarLogger`` prints each once under
the bar and ``TensorBoard`` writes each once as a text summary, on the chief. Strategies
without a watch have nothing to show.
"""

from __future__ import annotations

from typing import Any


class StragglerNotes:
    """Hands each named straggler's description out once (per callback that owns one)."""

    def __init__(self) -> None:
        self._shown = 0

    def fresh(self, model: Any) -> list[str]:
        """The descriptions named since the last call, in order; none without a watch."""
        strategy = getattr(model, "distribute_strategy", None)
        watch = getattr(getattr(strategy, "extended", None), "straggler_watch", None)
        if watch is None:
            return []
        named = list(watch.named)
        fresh, self._shown = named[self._shown :], len(named)
        return [s.describe() for s in fresh]
