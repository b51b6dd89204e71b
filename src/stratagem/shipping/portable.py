"""What travels by state: the kinds of object a worker may rebuild, and the ``Portable``
protocol by which a class opts in.

A ``torch.nn.Module`` and a ``torch.optim.Optimizer`` travel by state as ``pickle`` would take
them; any other class must derive from ``Portable`` (Keras losses, metrics, optimizers,
policies, ``sg.keras.Model``). A class that accumulates (a metric) sends back what it
accumulated during a call, and the chief adds it to the original.

This module is the protocol: the only part of function shipping that the classes which travel
import.
"""

from __future__ import annotations

from typing import Any

import torch

# What a volatile attribute may hold (``Portable._sg_volatile``).
VOLATILE_TYPES = frozenset({int, float, str, bool, type(None)})


class Portable:
    """A class whose objects a coordinator's worker may rebuild by state: its attributes minus
    those named in ``_sg_local`` (a lock, a strategy, per-replica state: one process's own),
    which ``_sg_after_rebuild`` remakes there: after each rebuild, and before each call of
    objects a worker kept from its last call (``restart``), so it must remake them whole from
    the other attributes. Keras losses, metrics and optimizers derive from it. An accumulator
    (``_sg_accumulates``, a metric) starts empty on the worker; what it accumulated during a
    call (``_sg_totals``) comes back and is added to the chief's (``_sg_add_totals``)."""

    _sg_local: tuple[str, ...] = ()
    _sg_accumulates = False
    # Attributes whose value, a number or a string, changes from call to call (a step
    # counter): a description the chief keeps reads them again at each call, and a worker
    # sets them from the table on objects it keeps.
    _sg_volatile: tuple[str, ...] = ()

    def _sg_portable_state(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k not in self._sg_local}

    def _sg_from_state(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._sg_after_rebuild()

    def _sg_after_rebuild(self) -> None:
        """Remake what ``_sg_local`` left out (nothing by default)."""

    def _sg_totals(self) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} accumulates nothing")

    def _sg_add_totals(self, totals: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} accumulates nothing")


class StaysHere:
    """An object in a module's hook dictionaries that belongs to this process (the chief's read
    hooks): a module described for a worker travels without it."""


def state_of(obj: Portable) -> dict[str, Any]:
    """What of ``obj`` travels (its attributes minus ``_sg_local``)."""
    return obj._sg_portable_state()


def computes_its_state(obj: Portable) -> bool:
    """Whether ``obj``'s class computes what travels itself (overrides
    ``_sg_portable_state``) rather than taking its attributes: what that reads is unknown."""
    return type(obj)._sg_portable_state is not Portable._sg_portable_state


def volatile_attributes(obj: Portable) -> tuple[str, ...]:
    """The attributes of ``obj`` that change from call to call (``Portable._sg_volatile``)."""
    return obj._sg_volatile


def remade_attributes(obj: Portable) -> frozenset[str] | None:
    """The attributes of ``obj`` that a worker sets anew at each call, whether it rebuilds the
    object or keeps it: those ``_sg_after_rebuild`` remakes (``_sg_local``) and the volatile
    ones (the table's values); None where its class sets its state its own way
    (``_sg_from_state``), so that only a rebuild makes it as described."""
    if type(obj)._sg_from_state is not Portable._sg_from_state:
        return None
    return frozenset(obj._sg_local) | frozenset(obj._sg_volatile)


def restart(obj: Portable, volatile: dict[str, Any]) -> None:
    """Make ``obj``, kept from a worker's last call, what a rebuild from its unchanged
    description would make: the ``volatile`` attributes' new values, then its local state
    remade (an accumulator starts empty again)."""
    obj.__dict__.update(volatile)
    obj._sg_after_rebuild()


def set_state(obj: Portable, state: dict[str, Any]) -> None:
    """Give ``obj`` (made by ``cls.__new__``) the state described on the chief."""
    obj._sg_from_state(state)


def accumulates(obj: Any) -> bool:
    """Whether ``obj`` is an accumulator: its totals come back from the worker."""
    return isinstance(obj, Portable) and obj._sg_accumulates


def totals_of(accumulators: dict[str, Any]) -> dict[str, torch.Tensor]:
    """What each accumulator made on this worker accumulated (sent back with the value)."""
    return {key: obj._sg_totals() for key, obj in accumulators.items()}


def add_totals(accumulators: dict[str, Any], totals: dict[str, Any]) -> None:
    """Add a worker's ``totals_of`` to the chief's accumulators they were described from."""
    for key, value in totals.items():
        obj = accumulators.get(key)
        if obj is None or not isinstance(value, torch.Tensor):
            raise ValueError(f"a worker sent totals for {key!r}, which this call did not send")
        obj._sg_add_totals(value)


# A bare module's attributes: what a described module leaves out when empty (its hooks), and
# the worker puts back as fresh empty ones.
MODULE_DEFAULTS = {
    k: v
    for k, v in vars(torch.nn.Module()).items()
    if v is None or (isinstance(v, dict | set) and not v)
}


def portable_kind(value: Any) -> str | None:
    """How ``value`` travels by state, if it does: a module, an optimizer, or an object whose
    class opts in (``_sg_portable_state``); None for anything else."""
    if isinstance(value, type):
        return None
    if isinstance(value, torch.nn.Module):
        return "module"
    if isinstance(value, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(value, Portable):
        return "portable"
    return None
