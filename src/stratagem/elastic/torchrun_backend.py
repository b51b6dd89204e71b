"""The rendezvous backend ``"stratagem"`` as torch's registry sees it, without importing torch.

torch imports its ``torchrun.handlers`` entry points while ``torch.distributed.elastic
.rendezvous`` itself is still loading, so the entry point may import nothing of torch's elastic
modules: ``create`` imports ``sealed_rendezvous`` only when torch calls it. ``register()`` and
the entry point hand torch this same ``create``, so registering again changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters


def create(params: RendezvousParameters) -> RendezvousHandler:
    """torch's creator for ``"stratagem"``: ``sealed_rendezvous.create_handler``."""
    from stratagem.elastic.sealed_rendezvous import create_handler

    return create_handler(params)


def handler_creator() -> Callable[[Any], Any]:
    """The ``torchrun.handlers`` entry point: torch calls it and registers what it returns."""
    return create


def register() -> None:
    """Make ``"stratagem"`` one of torch's rendezvous backends (again: no change)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    from stratagem.elastic.sealed_rendezvous import BACKEND

    rendezvous_handler_registry.register(BACKEND, create)
