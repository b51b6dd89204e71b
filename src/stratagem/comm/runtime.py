"""The process-wide communication state: which communicator is live, and what runs on it.

One process belongs to at most one job, so the communicator is process-wide. Layers that must
not import the strategies (checkpoints, for one) learn from here whether this process is the
chief, which distribution it is part of, and how to reach state held by other processes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stratagem.comm.communicator import Communicator, LocalCommunicator

_lock = threading.Lock()
_current: Communicator = LocalCommunicator()
_context: dict[str, Any] = {}


def current_communicator() -> Communicator:
    """The live communicator; a ``LocalCommunicator`` when this process runs alone."""
    return _current


def set_current_communicator(comm: Communicator | None) -> None:
    """Install ``comm`` as the process's communicator (``None`` restores the local one)."""
    global _current
    with _lock:
        _current = comm if comm is not None else LocalCommunicator()


def set_distribution_context(**info: Any) -> None:
    """Record what distributes this process (strategy name, replicas); checkpoints store it."""
    with _lock:
        _context.clear()
        _context.update(info)


def distribution_context() -> dict[str, Any]:
    """What ``set_distribution_context`` recorded, plus the rank and world size."""
    comm = _current
    with _lock:
        info = dict(_context)
    info.setdefault("strategy", "default")
    info["rank"] = comm.rank
    info["world_size"] = comm.world_size
    return info


@dataclass(frozen=True)
class RemoteStateHooks:
    """How checkpoints reach state that lives in other processes (a parameter server's).

    ``before_write(objects)`` runs on the writing process before a checkpoint collects the
    modules and optimizers in ``objects``, to bring their remote state home;
    ``after_restore(objects)`` runs on every process after a restore, to send it back. With
    ``collective``, ``before_write`` is a collective that every process runs (a pipeline's
    stages each hold part of the model, and all take part in bringing it together).
    """

    before_write: Callable[[list[object]], None]
    after_restore: Callable[[list[object]], None]
    collective: bool = False


_remote_state: list[RemoteStateHooks] = []


def add_remote_state_hooks(hooks: RemoteStateHooks) -> None:
    with _lock:
        _remote_state.append(hooks)


def remote_state_hooks() -> list[RemoteStateHooks]:
    with _lock:
        return list(_remote_state)
