"""Whether a call changed the objects a ``Rebuilder`` made: a worker that is sent the same
table again may call the same objects again only if the last call left them as they were built.

A snapshot holds, for every container the rebuilt objects reach (their ``__dict__``, the dicts,
lists and sets in it and in the functions' globals, closure cells, defaults and attributes),
the identity of each item, and each object's class. ``unchanged()`` compares them by identity,
in C (``itertools.chain``, ``map(operator.is_)``): about a sixth of a rebuild's time for a
model and its optimizer. Immutable values (numbers, strings, tuples) can only be replaced, which
the identity shows; a tensor can change in place, so a table holding one is never kept
(``ClusterCoordinator``'s fingerprint), and the tensors the objects hold otherwise are the
ps's variables and the worker's own buffers, which persist from call to call by design. Not
walked: what the rebuild did not make (library modules and their objects, classes, the
strategy, per-worker iterators and datasets), which is shared between calls either way.

An object whose class keeps attributes in ``__slots__`` cannot be watched so: ``watch``
returns None and the objects are built again for each call.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import operator
import types
from collections.abc import Iterable
from typing import Any

import torch

from stratagem.shipping.describe import slot_names

_EMPTY = object()  # an empty closure cell
_NAMESPACES = (argparse.Namespace, types.SimpleNamespace)


class Snapshot:
    """The identities of everything a rebuild made, as they were when ``watch`` was called."""

    def __init__(self, dicts: list[dict], lists: list[list | set], cells: list, objects: list):
        self._dicts = dicts
        self._lists = lists
        self._cells = cells
        self._objects = objects  # functions (their code, defaults, closure) and objects (class)
        self._taken = self._now()

    def _now(self) -> tuple[list, list, list, list, list, list]:
        chain = itertools.chain.from_iterable
        return (
            list(map(len, self._dicts)),
            list(chain(self._dicts)),  # keys, in each dict's own order
            list(chain(map(operator.methodcaller("values"), self._dicts))),
            list(map(len, self._lists)) + list(chain(self._lists)),
            [c.cell_contents if _filled(c) else _EMPTY for c in self._cells],
            list(chain(map(_identity, self._objects))),
        )

    def unchanged(self) -> bool:
        """Whether every container holds the same items (by identity) as when taken."""
        lens, keys, values, lists, cells, objects = self._now()
        then = self._taken
        return (
            lens == then[0]
            and keys == then[1]
            and all(map(operator.is_, values, then[2]))
            and len(lists) == len(then[3])
            and all(map(operator.is_, lists, then[3]))
            and all(map(operator.is_, cells, then[4]))
            and all(map(operator.is_, objects, then[5]))
        )


def watch(built: Iterable[Any], roots: Iterable[Any]) -> Snapshot | None:
    """A snapshot of what a rebuild made: ``built`` (its functions and objects, the
    ``Rebuilder``'s own), reached from ``roots`` (the function and its arguments) and from
    each other through containers; None where something cannot be watched (``__slots__``)."""
    made = {id(o): o for o in built if not isinstance(o, type)}
    dicts: list[dict] = []
    lists: list[list | set] = []
    cells: list = []
    objects: list = []
    seen: set[int] = set()
    stack = [*roots, *made.values()]
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, dict):
            dicts.append(value)
            stack.extend(value.values())
        elif isinstance(value, list | set):
            lists.append(value)
            stack.extend(value)
        elif isinstance(value, tuple | frozenset):
            stack.extend(value)
        elif isinstance(value, torch.Tensor | type | types.ModuleType):
            continue
        elif isinstance(value, types.FunctionType):
            if id(value) not in made:
                continue  # a library's function (its module's): shared, not rebuilt
            objects.append(value)
            stack.append(value.__globals__)
            stack.append(value.__dict__)
            stack.extend(value.__defaults__ or ())
            if value.__kwdefaults__ is not None:
                stack.append(value.__kwdefaults__)
            for cell in value.__closure__ or ():
                cells.append(cell)
                if _filled(cell):
                    stack.append(cell.cell_contents)
        elif id(value) in made or isinstance(value, _NAMESPACES):
            if _has_slots(type(value)):
                return None
            objects.append(value)
            stack.append(vars(value))
    return Snapshot(dicts, lists, cells, objects)


def _identity(obj: Any) -> tuple:
    """What of an object besides its containers a call could replace: a function's code,
    defaults and closure; any object's class."""
    if isinstance(obj, types.FunctionType):
        return (obj.__code__, obj.__defaults__, obj.__kwdefaults__, obj.__closure__)
    return (type(obj),)


def _filled(cell: types.CellType) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:
        return False
    return True


@functools.cache
def _has_slots(cls: type) -> bool:
    """Whether ``cls`` or a base keeps attributes in ``__slots__`` (outside ``__dict__``)."""
    return bool(slot_names(cls))
