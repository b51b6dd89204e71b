"""Whether a call changed the objects a ``Rebuilder`` made: a worker that is sent the same
table again may call the same objects again only if the last call left them as they were built.

``watch`` takes a snapshot: for every container the rebuilt objects reach (their ``__dict__``,
the dicts, lists and sets in it, the functions' globals, cells, defaults and attributes), the
identity of each item, and each object's class; a ``Portable``'s attributes by name, but those
the worker sets anew at each call (``Rebuilder.restarted``). ``unchanged()`` compares by
identity. A table holding a tensor is never kept (a tensor can change in place); what the
rebuild did not make (library objects, the strategy, per-worker iterators) and a function's
``__warningregistry__`` are not walked. An object with ``__slots__``, or a ``Portable`` that sets
its own state, cannot be watched: ``watch`` returns None and the objects are built for each
call. The chief uses the same comparison: ``Reads`` records what a ``Describer`` read, and while
it is unchanged the last description of the same function and arguments is kept.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import marshal
import operator
import types
from collections.abc import Iterable
from typing import Any

import torch

from stratagem.shipping.portable import Portable, remade_attributes
from stratagem.shipping.program import slot_names

_EMPTY = object()  # an empty closure cell
_ABSENT = object()  # a name not in the dict it was looked up in
_NAMESPACES = (argparse.Namespace, types.SimpleNamespace)
# The name under which ``warnings`` records, in a function's globals, the warnings it showed
# for that function's lines: the interpreter's bookkeeping, not the program's state.
WARNING_REGISTRY = "__warningregistry__"


def plain_bytes(value: Any) -> bytes | None:
    """Bytes equal for equal plain data, types included (``marshal``'s first format: no
    references, no interning, so equal values give equal bytes; ``1``, ``True`` and ``1.0``
    differ); None where ``value`` holds a tensor, which a call may change in place. Local only:
    these bytes are compared, never loaded."""
    try:
        return marshal.dumps(value, 0)
    except ValueError:
        return None


class Snapshot:
    """The identities of everything a rebuild made (or a describe read), as they were when
    taken: whole containers, single names looked up in a dict (``names``: dicts and keys, a
    function's globals), closure cells, objects (``_identity``), and the shape, dtype and
    trainability of tensors whose description is those (the ps's variables)."""

    def __init__(
        self,
        dicts: list[dict],
        lists: list[list | set],
        cells: list,
        objects: list,
        names: tuple[list[dict], list[str]] = ([], []),
        tensors: list[torch.Tensor] = [],  # noqa: B006 - read only
        sized: list[dict] = [],  # noqa: B006 - read only
    ):
        self._dicts = dicts
        self._lists = lists
        self._cells = cells
        self._objects = objects  # functions (their code, defaults, closure) and objects (class)
        self._names = names
        self._tensors = tensors
        self._sized = sized  # dicts whose items are read by name: their sizes
        self._taken = self._now()

    def _now(self) -> tuple[list, list, list, list, list, list, list, list]:
        chain = itertools.chain.from_iterable
        return (
            list(map(len, self._dicts)) + list(map(len, self._sized)),
            list(chain(self._dicts)),  # keys, in each dict's own order
            list(chain(map(operator.methodcaller("values"), self._dicts))),
            list(map(len, self._lists)) + list(chain(self._lists)),
            [c.cell_contents if _filled(c) else _EMPTY for c in self._cells],
            list(chain(map(_identity, self._objects))),
            list(map(dict.get, *self._names, itertools.repeat(_ABSENT))),
            [(t.shape, t.dtype, t.requires_grad) for t in self._tensors],
        )

    def unchanged(self) -> bool:
        """Whether every container holds the same items (by identity) as when taken."""
        lens, keys, values, lists, cells, objects, names, tensors = self._now()
        then = self._taken
        return (
            lens == then[0]
            and keys == then[1]
            and all(map(operator.is_, values, then[2]))
            and len(lists) == len(then[3])
            and all(map(operator.is_, lists, then[3]))
            and all(map(operator.is_, cells, then[4]))
            and all(map(operator.is_, objects, then[5]))
            and all(map(operator.is_, names, then[6]))
            and tensors == then[7]
        )


class Reads:
    """What a ``Describer`` read, recorded as it describes (its ``reads``): the containers it
    walked (lists, dicts, sets, each described object's ``__dict__``), the names it looked up in
    a function's or a class's module globals (present or not), closure cells, each function's
    code, defaults and closure and each object's class, and each tensor described by its
    shape, dtype and trainability (a variable on the ps). A description is made of these and
    of immutable values (numbers, strings, tuples, dtypes, names), so while ``snapshot()`` is
    unchanged a new describe would make the same table, but for the volatile attributes of a
    ``Portable`` (``volatile``: a step counter), whose values the keeper reads again itself.

    What it does not see, and why that is safe: a tensor's values (a table with a tensor by
    value is never kept: ``kept_descriptions.fingerprint``); a ``Portable`` class that
    computes its own state (``untrusted``: never kept); the program's files (a running
    program's code is loaded; a worker checks each file's hash against its own); which module
    attribute names a library's function or class (libraries do not rebind their own names).
    """

    def __init__(self) -> None:
        self.dicts: list[dict] = []
        self.lists: list[list | set] = []
        self.cells: list = []
        self.objects: list = []
        self.names: tuple[list[dict], list[str]] = ([], [])
        self.tensors: list[torch.Tensor] = []
        self.sized: list[dict] = []  # an object's attributes read by name (``names``)
        # (table key, object, attribute): values not watched, read again at each call and put
        # in the kept table (``Portable._sg_volatile``: a step counter)
        self.volatile: list[tuple[str, Any, str]] = []
        self.untrusted: str | None = None  # why these reads cannot tell (None: they can)

    def name(self, namespace: dict, key: str) -> None:
        self.names[0].append(namespace)
        self.names[1].append(key)

    def snapshot(self) -> Snapshot | None:
        """The snapshot of what was read; None where the reads cannot tell (``untrusted``)."""
        if self.untrusted is not None:
            return None
        dicts = list({id(d): d for d in self.dicts}.values())
        lists = list({id(v): v for v in self.lists}.values())
        objects = list({id(o): o for o in self.objects}.values())
        tensors = list({id(t): t for t in self.tensors}.values())
        return Snapshot(dicts, lists, self.cells, objects, self.names, tensors, self.sized)


def watch(built: Iterable[Any], roots: Iterable[Any]) -> Snapshot | None:
    """A snapshot of what a rebuild made: ``built`` (its functions and objects, the
    ``Rebuilder``'s own), reached from ``roots`` (the function and its arguments) and from
    each other through containers; None where something cannot be watched (``__slots__``)."""
    made = {id(o): o for o in built if not isinstance(o, type)}
    dicts: list[dict] = []
    lists: list[list | set] = []
    cells: list = []
    objects: list = []
    names: tuple[list[dict], list[str]] = ([], [])
    sized: list[dict] = []  # a Portable's attributes, watched by name: their number
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
            glob = value.__globals__
            if id(glob) not in seen:  # watched but for what ``warnings`` writes in it
                seen.add(id(glob))
                dicts.append(glob)
                stack.extend(v for k, v in glob.items() if k != WARNING_REGISTRY)
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
            if not isinstance(value, Portable):
                stack.append(vars(value))
                continue
            # Each attribute by name but those the worker sets anew at each call
            # (``portable.restart``): its local state (a metric's totals), its volatile ones.
            remade = remade_attributes(value)
            if remade is None:
                return None
            attributes = vars(value)
            sized.append(attributes)
            for k, v in attributes.items():
                if k not in remade:
                    names[0].append(attributes)
                    names[1].append(k)
                    stack.append(v)
    return Snapshot(dicts, lists, cells, objects, names, sized=sized)


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
