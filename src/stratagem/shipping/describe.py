"""The chief's side of function shipping: a function and what it captures, as a table of
plain data (``Describer``) that a worker's ``Rebuilder`` turns back into a function of its own
copy of the program.

Each global name the function's code loads, closure cell and default is described as: a module
by name; a function by reference (recursively; cycles allowed); a class or builtin by
``module.qualname`` (a class of the program's main file by its body); a tensor or plain data by
value, with lists, tuples, dicts and tuple subclasses of them; a module, optimizer or
``Portable`` by state (``portable``), a library's plain object by its attributes
(``by_attributes``), the same object twice as one; enum members, dtypes and devices by name; or
whatever the caller's ``special`` hook names (the worker's ``resolve_special`` gives its own).
Anything else is a ``TypeError`` naming the function, the captured name and its type.
"""

from __future__ import annotations

import argparse
import collections
import enum
import inspect
import os
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from stratagem.comm import plain_data
from stratagem.shipping import by_attributes
from stratagem.shipping.portable import (
    MODULE_DEFAULTS,
    StaysHere,
    accumulates,
    computes_its_state,
    portable_kind,
    state_of,
    volatile_attributes,
)
from stratagem.shipping.program import (
    class_body,
    code_hash,
    compiled,
    file_hash,
    fn_name,
    global_names,
    is_named,
    program_root,
    reachable,
    resolved,
    slot_names,
    unwrap,
)

if TYPE_CHECKING:
    from stratagem.shipping.unchanged import Reads

Special = Callable[[Any], dict[str, Any] | None]

_PLAIN = (type(None), bool, int, float, str)
_CONTAINERS = frozenset({list, set, dict, collections.OrderedDict})  # walked: their items read
_in_program_cache: dict[tuple[type, Path], bool] = {}
# (code file, module, program root) -> (the file's mode, size and mtime; where it was found)
_where_cache: dict[tuple[str, str, Path], tuple[tuple[int, int, int], dict[str, Any]]] = {}
# A module's hook dictionaries: those of this process's own hooks (``StaysHere``) are
# described without them.
_HOOK_DICTS = {k for k, v in MODULE_DEFAULTS.items() if k.endswith("hooks") and v == {}}
# The types of a module's defaults that are left out when empty (torch's own: exact types).
_EMPTIED = frozenset(type(v) for v in MODULE_DEFAULTS.values() if isinstance(v, dict | set))


class Describer:
    """Builds the table of plain data that ``rebuild`` turns back into functions."""

    def __init__(
        self,
        *,
        root: Path | None = None,
        special: Special | None = None,
        special_types: tuple[type, ...] = (object,),
        special_objects: tuple[Any, ...] = (),
        reads: Reads | None = None,
    ) -> None:
        self.root = program_root() if root is None else resolved(str(root))
        self.reads = reads  # where to record what this describe reads (``unchanged.Reads``)
        self.special = special or (lambda value: None)
        # What ``special`` is asked about: instances of these types and these objects (one
        # check in C, not a call per value; ``object``: everything).
        self._special_types = special_types
        self._special_ids = frozenset(id(o) for o in special_objects)
        self.functions: dict[str, dict[str, Any]] = {}  # the table: functions, objects, classes
        self._keys: dict[int, str] = {}
        self._keep: list[Any] = []  # the described objects: their ids stay theirs
        self.accumulators: dict[str, Any] = {}  # table key -> an object whose totals come back

    def function(self, fn: Any, *, what: str) -> dict[str, Any]:
        """A reference to ``fn`` (a capture entry); ``what`` names it in errors."""
        wrapper, fn = fn, unwrap(fn)
        reads = self.reads
        if reads is not None and wrapper is not fn and hasattr(wrapper, "__dict__"):
            reads.dicts.append(vars(wrapper))  # its __wrapped__
        if not isinstance(fn, types.FunctionType):
            return self.value(fn, owner=what, name="the function itself")
        key = self._keys.get(id(fn))
        if key is not None:
            return {"k": "function", "ref": key}
        module, qualname = fn.__module__, fn.__qualname__
        if (
            isinstance(module, str)
            and module != "__main__"
            and reachable(module, qualname) is fn
            and not _in_root(Path(fn.__code__.co_filename), self.root)
        ):
            # A library's function (torch's, ours): the worker's own module holds it, with the
            # module's own globals (which need not be plain data).
            return {"k": "named", "module": module, "qualname": qualname}
        key = str(len(self.functions))
        self._keys[id(fn)] = key
        self._keep.append(fn)
        name = fn_name(fn)
        code = fn.__code__
        desc: dict[str, Any] = {
            "name": fn.__name__,
            "qualname": code.co_qualname,
            "line": code.co_firstlineno,
            "hash": code_hash(code),
            "module": str(fn.__globals__.get("__name__", "__main__")),
        }
        self.functions[key] = desc  # before the captures: a function may capture itself
        if reads is not None:
            reads.objects.append(fn)  # its code, defaults and closure
            reads.cells.extend(fn.__closure__ or ())
            reads.name(fn.__globals__, "__name__")
            for g in global_names(code):
                reads.name(fn.__globals__, g)  # also one not there yet: it may be added
            if fn.__kwdefaults__ is not None:
                reads.dicts.append(fn.__kwdefaults__)
        desc["where"] = self._where(fn, name)
        desc["globals"] = {
            g: self.value(fn.__globals__[g], owner=name, name=g)
            for g in global_names(code)
            if g in fn.__globals__
        }
        cells = fn.__closure__ or ()
        desc["closure"] = [
            self.value(_cell(c, name, v), owner=name, name=v)
            for c, v in zip(cells, code.co_freevars, strict=True)
        ]
        desc["defaults"] = [
            self.value(d, owner=name, name=f"a default of {fn.__name__}")
            for d in fn.__defaults__ or ()
        ]
        desc["kwdefaults"] = {
            k: self.value(d, owner=name, name=f"the default of {k}")
            for k, d in (fn.__kwdefaults__ or {}).items()
        }
        return {"k": "function", "ref": key}

    def _where(self, fn: types.FunctionType, name: str) -> dict[str, Any]:
        """Where the worker finds ``fn``'s code: a file of the program, or an importable
        module, with the file's hash. Kept per file while its size and mtime stay (one stat
        per function described, not a path resolved and compared each time)."""
        filename = fn.__code__.co_filename
        module = str(fn.__globals__.get("__name__", "__main__"))
        try:
            stat = os.stat(filename)
        except (OSError, ValueError):
            stat = None
        mark = None if stat is None else (stat.st_mode, stat.st_size, stat.st_mtime_ns)
        key = (filename, module, self.root)
        known = _where_cache.get(key)
        if known is not None and mark is not None and known[0] == mark:
            return dict(known[1])
        where = self._find_where(fn, name, Path(filename), module)
        if mark is not None:
            _where_cache[key] = (mark, dict(where))
        return where

    def _find_where(
        self, fn: types.FunctionType, name: str, path: Path, module: str
    ) -> dict[str, Any]:
        if path.is_file():
            real = resolved(str(path))
            if real.is_relative_to(self.root):
                return {"file": real.relative_to(self.root).as_posix(), "sha": file_hash(path)}
            if module != "__main__" and getattr(sys.modules.get(module), "__file__", None):
                return {"import": module, "sha": file_hash(path)}
        raise TypeError(
            f"{name} is a function that cannot be sent: its code is in {str(path)!r}, which is "
            f"neither a file of the program (under {self.root.name}/) nor an importable module; "
            "a worker runs only code from its own copy of the program (define the function in "
            "the script or a module of it, not in a REPL or with exec)"
        )

    def value(self, value: Any, *, owner: str, name: str) -> dict[str, Any]:
        """A capture entry for ``value``, read by ``owner`` as ``name``. Values of the exact
        plain types are values, and lists, tuples, dicts and ordered dicts of these exact types
        are walked: neither is offered to ``special`` (most of a table is such, and each offer
        is a call); nor is what is not of ``special_types`` or one of ``special_objects``."""
        kind = type(value)
        if kind in plain_data.EXACT_PLAIN:
            return {"k": "value", "v": value}
        reads = self.reads
        if reads is not None and kind in _CONTAINERS:
            (reads.lists if kind is list or kind is set else reads.dicts).append(value)
        if kind is list or kind is tuple:
            return {"k": kind.__name__, "items": self._sequence(value, owner=owner, name=name)}
        if kind is dict and all(type(k) is str for k in value):
            items = {k: self.value(v, owner=owner, name=f"{name}[{k!r}]") for k, v in value.items()}
            return {"k": "dict", "items": items}
        if kind is dict or kind is collections.OrderedDict:  # keys of plain data (hook handles)
            pairs = [
                [self.value(k, owner=owner, name=f"a key of {name}"),
                 self.value(v, owner=owner, name=f"{name}[{k!r}]")]
                for k, v in value.items()
            ]  # fmt: skip
            return {"k": "pairs", "ordered": kind is not dict, "items": pairs}
        if isinstance(value, self._special_types) or id(value) in self._special_ids:
            special = self.special(value)
            if special is not None:
                if reads is not None:
                    if isinstance(value, torch.Tensor):
                        reads.tensors.append(value)  # described by shape, dtype, trainable
                    elif id(value) not in self._special_ids and hasattr(value, "__dict__"):
                        reads.dicts.append(vars(value))  # an iterator's number, a dataset
                        reads.objects.append(value)
                return {"k": "special", "v": special}
        # The most common captures next, before the chain below: a torch module (asking it
        # for a __wrapped__ goes through its __getattr__ and an AttributeError) and a function.
        if isinstance(value, torch.nn.Module):
            return self._object(value, "module", owner=owner, name=name)
        if kind is types.FunctionType:
            return self.function(value, what=f"{name} of {owner}")
        if isinstance(value, type):  # a class (each object's own: one per object)
            if is_named(value) and not self._in_program(value):
                return {"k": "named", "module": value.__module__, "qualname": value.__qualname__}
            return self._class(value, owner=owner, name=name)
        if isinstance(value, _PLAIN):
            return {"k": "value", "v": value}
        if isinstance(value, torch.Tensor):
            plain_data.check(value, what=f"{name} of {owner}")
            return {"k": "value", "v": value}
        if isinstance(value, types.ModuleType):
            return {"k": "module", "name": value.__name__}
        if isinstance(value, list | tuple):  # a subclass (the exact types are taken above)
            return self._subclassed(value, owner=owner, name=name)
        if type(value) in (set, frozenset):
            items = [self.value(v, owner=owner, name=f"an item of {name}") for v in value]
            return {"k": type(value).__name__, "items": items}
        if type(value) in (argparse.Namespace, types.SimpleNamespace):  # a script's options
            if reads is not None:
                reads.dicts.append(vars(value))
            items = {
                k: self.value(v, owner=owner, name=f"{name}.{k}") for k, v in vars(value).items()
            }
            return {"k": "namespace", "argparse": type(value) is argparse.Namespace, "items": items}
        if isinstance(value, torch.dtype):
            return {"k": "dtype", "name": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"k": "device", "v": str(value)}
        if isinstance(unwrap(value), types.FunctionType):
            return self.function(value, what=f"{name} of {owner}")
        if isinstance(value, enum.Enum) and is_named(type(value)):
            member = f"{type(value).__qualname__}.{value.name}"
            return {"k": "named", "module": type(value).__module__, "qualname": member}
        kind = portable_kind(value)
        if kind is not None:
            return self._object(value, kind, owner=owner, name=name)
        if is_named(value):
            return {"k": "named", "module": value.__module__, "qualname": value.__qualname__}
        cls = type(value)
        refusal = by_attributes.refusal(cls, self.root)
        if refusal is None:
            return self._object(value, "data", owner=owner, name=name)
        raise TypeError(
            f"{owner} is a function that cannot be sent: it captures {name!r}, a "
            f"{cls.__module__}.{cls.__qualname__}. A scheduled function may capture modules, "
            "functions, classes, tensors, plain data (None, bool, int, float, str, lists, tuples "
            "and their subclasses, dicts, sets, argparse namespaces), torch modules and "
            "optimizers, Keras losses, metrics and optimizers (by state), objects of a "
            "library's plain classes by their attributes (a Hugging Face config), per-worker "
            f"iterators and the coordinator's strategy; a {cls.__qualname__} does not travel by "
            f"its attributes: {refusal}"
        )

    def _sequence(self, value: list | tuple, *, owner: str, name: str) -> list[dict[str, Any]]:
        return [self.value(v, owner=owner, name=f"{name}[{i}]") for i, v in enumerate(value)]

    def _subclassed(self, value: list | tuple, *, owner: str, name: str) -> dict[str, Any]:
        """A list or tuple of a subclass (a namedtuple, a ``torch.Size``): its class and its
        items. Only the items travel, so one with attributes of its own is refused."""
        cls = type(value)
        reads = self.reads
        if reads is not None:
            reads.objects.append(value)  # its class
            if isinstance(value, list):
                reads.lists.append(value)
            if hasattr(value, "__dict__"):
                reads.dicts.append(vars(value))  # empty, or the describe refuses it
        extra = list(getattr(value, "__dict__", None) or ()) + slot_names(cls)
        if extra:
            raise TypeError(
                f"{owner} is a function that cannot be sent: it captures {name!r}, a "
                f"{cls.__module__}.{cls.__qualname__} with attributes besides its items "
                f"({sorted(extra)}); only the items of a list or tuple subclass travel"
            )
        described = self.value(cls, owner=owner, name=f"the class of {name}")
        items = self._sequence(value, owner=owner, name=name)
        return {"k": "sequence", "class": described, "items": items}

    # -------------------------------------------------------------- objects and classes

    def _in_program(self, cls: type) -> bool:
        """Whether ``cls`` is defined in a file of the program (not an installed library)."""
        known = _in_program_cache.get((cls, self.root))
        if known is not None:
            return known
        try:
            inside = Path(inspect.getfile(cls)).resolve().is_relative_to(self.root)
        except (TypeError, OSError):
            inside = False
        _in_program_cache[(cls, self.root)] = inside
        return inside

    def _object(self, value: Any, kind: str, *, owner: str, name: str) -> dict[str, Any]:
        """An object by state (``kind``: a module, an optimizer, a portable object or data
        by its attributes): a table entry made once per object (shared and cyclic references
        stay one object on the worker)."""
        key = self._keys.get(id(value))
        if key is not None:
            return {"k": "object", "ref": key}
        key = f"o{len(self.functions)}"
        self._keys[id(value)] = key
        self._keep.append(value)
        desc: dict[str, Any] = {"kind": kind}
        self.functions[key] = desc  # before the state: the state may refer back to it
        desc["class"] = self.value(type(value), owner=owner, name=f"the class of {name}")
        reads = self.reads
        if reads is not None:
            reads.objects.append(value)  # its class
            volatile = volatile_attributes(value) if kind == "portable" else ()
            if volatile:  # each attribute but those, whose values are read again (``Reads``)
                attributes = vars(value)
                reads.sized.append(attributes)
                for k in attributes:
                    if k in volatile:
                        reads.volatile.append((key, value, k))
                    else:
                        reads.name(attributes, k)
            else:
                reads.dicts.append(vars(value))
            if kind == "module":  # the hook dicts (and sets) it leaves out while empty
                for k, v in vars(value).items():
                    if k in MODULE_DEFAULTS and isinstance(v, dict | set):
                        (reads.lists if isinstance(v, set) else reads.dicts).append(v)
            elif kind == "portable" and computes_its_state(value):
                reads.untrusted = f"{type(value).__qualname__} computes its own state"
        if kind == "module":
            # Empty hooks and the like are left out; the worker puts back fresh empty ones.
            # So are this process's own hooks (``StaysHere``: the chief's read hooks).
            state = {}
            for k, v in vars(value).items():
                if k in MODULE_DEFAULTS:
                    if k in _HOOK_DICTS and v:
                        v = _without_local_hooks(k, v)
                    if v is None or (type(v) in _EMPTIED and not v):
                        continue
                state[k] = v
        elif kind == "optimizer":
            state = {k: v for k, v in vars(value).items() if k != "state"}  # state: on the ps
        elif kind == "data":
            state = dict(vars(value))
            for k in state:
                refusal = by_attributes.attribute_refusal(type(value), k)
                if refusal is not None:
                    cls = type(value)
                    raise TypeError(
                        f"{owner} is a function that cannot be sent: it captures {name!r}, a "
                        f"{cls.__module__}.{cls.__qualname__} whose attributes travel, but "
                        f"not this one: {refusal}"
                    )
        else:
            state = state_of(value)
        desc["state"] = {
            k: self.value(v, owner=owner, name=f"{name}.{k}") for k, v in state.items()
        }
        if accumulates(value):
            self.accumulators[key] = value
        return {"k": "object", "ref": key}

    def _class(self, cls: type, *, owner: str, name: str) -> dict[str, Any]:
        """A class of the program's own files, by its class body (the worker runs the body of
        its own copy to make the class)."""
        key = self._keys.get(id(cls))
        if key is not None:
            return {"k": "class", "ref": key}
        if _made_by_namedtuple(cls):  # no class statement to run: its fields instead
            return self._namedtuple(cls, owner=owner, name=name)
        what = f"class {cls.__qualname__} (captured as {name!r} by {owner})"
        try:
            path = Path(inspect.getfile(cls)).resolve()
            line = inspect.getsourcelines(cls)[1]
        except (TypeError, OSError) as e:
            raise TypeError(f"{what} cannot be sent: its source is not in a file ({e})") from None
        if not path.is_relative_to(self.root):
            raise TypeError(f"{what} cannot be sent: {path.name} is not a file of the program")
        body = class_body(compiled(path, file_hash(path)), cls.__qualname__, line)
        if body is None:
            raise TypeError(f"{what} cannot be sent: no class body at line {line} of {path.name}")
        if body.co_freevars:
            raise TypeError(
                f"{what} cannot be sent: it is defined inside a function and reads its locals "
                f"{list(body.co_freevars)}; define it at the top level of the program"
            )
        key = f"c{len(self.functions)}"
        self._keys[id(cls)] = key
        self._keep.append(cls)
        module = str(cls.__module__)
        desc: dict[str, Any] = {
            "kind": "class",
            "name": cls.__name__,
            "qualname": cls.__qualname__,
            "line": line,
            "hash": code_hash(body),
            "module": module,
            "where": {"file": path.relative_to(self.root).as_posix(), "sha": file_hash(path)},
        }
        self.functions[key] = desc
        glob = vars(sys.modules[module]) if module in sys.modules else {}
        if self.reads is not None:
            for g in global_names(body):
                self.reads.name(glob, g)
        # A typing.NamedTuple's class statement names NamedTuple (its __orig_bases__), which
        # makes the namedtuple; run with its resolved base (tuple) it would make a plain tuple.
        bases = vars(cls).get("__orig_bases__", ())
        if typing.NamedTuple not in bases:
            bases = cls.__bases__
        desc["bases"] = [
            self.value(b, owner=owner, name=f"a base of {cls.__qualname__}") for b in bases
        ]
        desc["metaclass"] = (
            None
            if type(cls) is type
            else self.value(type(cls), owner=owner, name=f"the metaclass of {cls.__qualname__}")
        )
        desc["globals"] = {
            g: self.value(glob[g], owner=f"class {cls.__qualname__}", name=g)
            for g in global_names(body)
            if g in glob and glob[g] is not cls
        }
        return {"k": "class", "ref": key}

    def _namedtuple(self, cls: type, *, owner: str, name: str) -> dict[str, Any]:
        """A class ``collections.namedtuple`` made, by its name, fields and defaults (the
        worker makes it with ``collections.namedtuple``)."""
        key = f"c{len(self.functions)}"
        self._keys[id(cls)] = key
        self._keep.append(cls)
        fields: tuple[str, ...] = cls._fields  # type: ignore[attr-defined]
        defaults: dict[str, Any] = cls._field_defaults  # type: ignore[attr-defined]
        self.functions[key] = {
            "kind": "namedtuple",
            "name": cls.__name__,
            "qualname": cls.__qualname__,
            "module": str(cls.__module__),
            "fields": list(fields),
            "defaults": [
                self.value(defaults[f], owner=owner, name=f"the default of {name}.{f}")
                for f in fields
                if f in defaults
            ],
        }
        return {"k": "class", "ref": key}


def _made_by_namedtuple(cls: type) -> bool:
    """Whether ``cls`` is what ``collections.namedtuple`` returned (not a class statement:
    a subclass of one, or a ``typing.NamedTuple``, has a body to run)."""
    own = vars(cls)
    return (
        cls.__bases__ == (tuple,)
        and "_fields" in own
        and "_make" in own
        and "__orig_bases__" not in own
    )


def _in_root(path: Path, root: Path) -> bool:
    return path.is_file() and resolved(str(path)).is_relative_to(root)


def _without_local_hooks(name: str, value: Any) -> Any:
    """A module attribute as described: a hook dictionary without the hooks that belong to
    this process (marked ``StaysHere``); anything else as it is."""
    if name not in _HOOK_DICTS or not isinstance(value, dict):
        return value
    if not any(isinstance(h, StaysHere) for h in value.values()):
        return value
    return type(value)((k, h) for k, h in value.items() if not isinstance(h, StaysHere))


def _cell(cell: types.CellType, owner: str, name: str) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        raise TypeError(
            f"{owner} is a function that cannot be sent: its closure variable {name!r} has no "
            "value yet"
        ) from None
