"""A coordinating chief's reads of its parameters are reads of the ps.

TF's chief reads a variable from the ps that holds it. Here the chief keeps local copies of the
parameters it created in ``ParameterServerStrategy.scope()``, while the workers train the ps's
values through scheduled functions; so each module that registered a parameter in the chief's
scope gets a hook before its forward and its ``state_dict`` that brings the copies up to date
(``ClusterCoordinator.refresh``: a pull when a function ended since the last one, else a
comparison). ``join()`` and ``fetch()`` refresh too, for reads that pass no module
(``p.detach()``, ``torch.save(model)``).

The hook is this process's own: a module described for a worker travels without it
(``stratagem.shipping`` leaves out a ``StaysHere`` hook), a copy of the module
(``deepcopy``) shares it, and a pickled module (``torch.save`` of a whole module) carries an
inert one.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from stratagem.shipping.portable import StaysHere

_watched: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


class ReadHook(StaysHere):
    """Calls ``refresh`` before a forward (a forward pre-hook) and a ``state_dict`` (a
    state-dict pre-hook); inert when ``refresh`` is None (an unpickled copy)."""

    def __init__(self, refresh: Callable[[], None] | None) -> None:
        self._refresh = refresh

    def __call__(self, module: torch.nn.Module, *args: Any) -> None:
        if self._refresh is not None:
            self._refresh()

    def __deepcopy__(self, memo: dict[int, Any]) -> ReadHook:
        return self  # a copy's reads refresh the same chief's variables: harmless, and cheap

    def __reduce__(self) -> tuple[type, tuple[None]]:
        return ReadHook, (None,)  # the refresh (the coordinator) stays in this process


def watch(module: torch.nn.Module, refresh: Callable[[], None]) -> None:
    """Have ``module``'s forward and ``state_dict`` call ``refresh`` first (once per module)."""
    if module in _watched:
        return
    hook = ReadHook(refresh)
    module.register_forward_pre_hook(hook)
    module.register_state_dict_pre_hook(hook)
    _watched.add(module)
