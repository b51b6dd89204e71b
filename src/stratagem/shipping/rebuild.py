"""A worker's side of function shipping: a ``Describer`` table turned back into functions,
objects and classes, from this task's own copy of the program.

The worker compiles **its own copy** of each file a function names (nothing is executed), finds
the code object by qualname and line, checks the hash and builds the function with
``types.FunctionType``; so it runs only code on its own disk, and the chief merely picks which.
Objects are ``cls.__new__(cls)`` of a module, optimizer or ``Portable`` class with the described
state set, or ``object.__new__(cls)`` of a library's plain class with its ``__dict__`` filled
(``by_attributes``, which this worker checks itself): only these kinds are ever made; the
program's classes are built from their class bodies (``__build_class__``), once per worker.
"""

from __future__ import annotations

import argparse
import builtins
import collections
import importlib
import importlib.util
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from stratagem.shipping import by_attributes
from stratagem.shipping.entry_points import is_entry_point
from stratagem.shipping.portable import (
    MODULE_DEFAULTS,
    VOLATILE_TYPES,
    Portable,
    accumulates,
    restart,
    set_state,
    volatile_attributes,
)
from stratagem.shipping.program import (
    class_body,
    code_hash,
    compiled,
    nested,
    program_root,
    reachable,
    resolved,
    same_copy,
)
from stratagem.shipping.unchanged import WARNING_REGISTRY

ResolveSpecial = Callable[[dict[str, Any]], Any]

_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement (or type())

# (program root, where, qualname, line, hash) -> the file and the code found in it: every call
# of a scheduled function rebuilds the same functions, and finding one (its path resolved, its
# file's code objects searched) was a third of the rebuild. The file is checked each time.
_codes: dict[tuple[Any, ...], tuple[Path, types.CodeType]] = {}

# Packages a worker imports a module of when a function needs one it has not imported yet: the
# ones it runs on anyway (importing their modules runs nothing a peer chose).
_OUR_PACKAGES = frozenset({"stratagem", "torch"})


class Rebuilder:
    """Turns a ``Describer`` table back into functions, from this task's own files."""

    def __init__(
        self,
        functions: dict[str, Any],
        *,
        root: Path | None = None,
        resolve_special: ResolveSpecial | None = None,
        classes: dict[tuple, type] | None = None,
    ) -> None:
        self.root = program_root() if root is None else resolved(str(root))
        self.table = functions
        self.resolve_special = resolve_special or _no_special
        self._built: dict[str, Any] = {}  # table key -> the function, object or class made
        # The program's classes made so far, by (file, qualname, line, hash): the worker keeps
        # one across calls, so that an object of a later call is an instance of the same class.
        self._classes = classes if classes is not None else {}
        self.accumulators: dict[str, Any] = {}  # table key -> an accumulator made here

    @property
    def built(self) -> list[Any]:
        """The functions, objects and classes made so far (``unchanged.watch`` watches them)."""
        return list(self._built.values())

    def restarted(self, table: dict[str, Any], changes: dict[str, Any]) -> bool:
        """Make the objects made here, kept after a call that left them as they were built,
        what a rebuild of ``table`` would make: ``table`` is this one, or this one with the
        entries ``changes`` in place of its own where those are ``Portable`` objects made here
        whose volatile attributes alone changed (fit's step counter, ``Portable._sg_volatile``).
        Each ``Portable`` made here then gets its volatile attributes' values from ``table``
        (the call may have changed them) and its local state remade (``portable.restart``: a
        metric starts empty). False, and nothing done, where a change is anything else or a
        volatile attribute's entry is not a plain value."""
        for key, entry in changes.items():
            obj, was = self._built.get(key), self.table.get(key)
            if not isinstance(obj, Portable) or type(entry) is not dict or type(was) is not dict:
                return False
            if entry.keys() != was.keys() or any(entry[f] != was[f] for f in entry if f != "state"):
                return False
            state, before = entry["state"], was["state"]
            if type(state) is not dict or state.keys() != before.keys():
                return False
            allowed = volatile_attributes(obj)
            if any(v != before[k] and k not in allowed for k, v in state.items()):
                return False
        volatile: dict[str, dict[str, Any]] = {}
        for key, obj in self._built.items():
            if not isinstance(obj, Portable):
                continue
            state = table[key]["state"]
            values = volatile[key] = {}
            for name in volatile_attributes(obj):
                entry = state.get(name)
                if entry is None:
                    continue  # local to each process: not described
                if type(entry) is not dict or entry.get("k") != "value":
                    return False
                if type(entry.get("v")) not in VOLATILE_TYPES:
                    return False
                values[name] = entry["v"]
        self.table = table
        for key, values in volatile.items():
            restart(self._built[key], values)
        return True

    def value(self, entry: Any) -> Any:
        if not isinstance(entry, dict) or "k" not in entry:
            raise ValueError(
                "the chief's description of a value the scheduled function uses is malformed "
                f"(expected a dict with its kind under 'k'); got {entry!r}"
            )
        kind = entry["k"]
        if kind == "value":
            return entry["v"]
        if kind == "list":
            return [self.value(v) for v in entry["items"]]
        if kind == "tuple":
            return tuple(self.value(v) for v in entry["items"])
        if kind == "dict":
            return {k: self.value(v) for k, v in entry["items"].items()}
        if kind == "module":
            return self._module(str(entry["name"]))
        if kind == "named":
            if any(part.startswith("__") for part in str(entry["qualname"]).split(".")):
                raise ValueError(
                    f"the chief named {entry['qualname']!r} for the scheduled function; a worker "
                    "looks up no __dunder__ attribute by name (it could reach any object)"
                )
            self._module(str(entry["module"]))
            found = reachable(str(entry["module"]), str(entry["qualname"]))
            if found is None:
                raise ImportError(f"{entry['module']}.{entry['qualname']} is not on this worker")
            return found
        if kind == "function":
            return self.function(str(entry["ref"]))
        if kind == "special":
            return self.resolve_special(entry["v"])
        if kind == "pairs":
            made = ((self.value(k), self.value(v)) for k, v in entry["items"])
            return collections.OrderedDict(made) if entry["ordered"] else dict(made)
        if kind in ("set", "frozenset"):
            items = (self.value(v) for v in entry["items"])
            return set(items) if kind == "set" else frozenset(items)
        if kind == "namespace":
            attributes = {str(k): self.value(v) for k, v in entry["items"].items()}
            made = argparse.Namespace if entry["argparse"] else types.SimpleNamespace
            return made(**attributes)
        if kind == "dtype":
            return dtype_named(str(entry["name"]))
        if kind == "device":
            return torch.device(str(entry["v"]))
        if kind == "object":
            return self.object(str(entry["ref"]))
        if kind == "class":
            return self.cls(str(entry["ref"]))
        if kind == "sequence":
            return sequence_of(self.value(entry["class"]), [self.value(v) for v in entry["items"]])
        raise ValueError(
            f"the chief described a value the scheduled function uses as {kind!r}, a kind this "
            "worker does not know: do the chief and this worker run the same stratagem?"
        )

    def entry_point(self, entry: Any, what: str) -> Callable[..., Any]:
        """The function ``entry`` names, for this worker to call (``what``: "the scheduled
        function"): a function of the program's files, or a library function stratagem marked
        (``entry_points``); anything else is refused before it is made."""
        if isinstance(entry, dict) and entry.get("k") == "function":
            desc = self.table[str(entry["ref"])]
            module, qualname = str(desc["module"]), str(desc["qualname"])
            if "file" in desc.get("where", {}) or self._registered(module, qualname):
                return self.function(str(entry["ref"]))
            named = f"{module}.{qualname}"
        elif isinstance(entry, dict) and entry.get("k") == "named":
            module, qualname = str(entry.get("module")), str(entry.get("qualname"))
            if self._registered(module, qualname):
                return self.value(entry)
            named = f"{module}.{qualname}"
        else:
            named = repr(entry)[:200]
        raise ValueError(
            f"{what} must be a function of the program (or one of stratagem's scheduled "
            f"steps); the chief named {named}, which this worker does not call"
        )

    def _registered(self, module: str, qualname: str) -> bool:
        """Whether stratagem marks ``module.qualname`` as an entry point; only stratagem's own
        modules are imported to learn it (their import registers their entry points)."""
        if module.split(".")[0] == "stratagem" and module not in sys.modules:
            self._module(module)
        return is_entry_point(module, qualname)

    def object(self, key: str) -> Any:
        """The object ``key`` of the table: ``cls.__new__(cls)`` of a module, optimizer or
        portable class, or ``object.__new__(cls)`` of a library's plain class (``data``), with
        the described state (only these kinds are ever made)."""
        built = self._built.get(key)
        if built is not None:
            return built
        desc = self.table[key]
        cls = self.value(desc["class"])
        kind = desc["kind"]
        if kind == "data":
            return self._data(key, cls, desc["state"])
        allowed = {
            "module": isinstance(cls, type) and issubclass(cls, torch.nn.Module),
            "optimizer": isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer),
            "portable": isinstance(cls, type) and issubclass(cls, Portable),
        }
        if not allowed.get(kind, False):
            raise ValueError(f"the chief described a {kind!r} object of {cls!r}: not made here")
        obj = cls.__new__(cls)
        self._built[key] = obj  # first: the state may refer back to it
        state = {k: self.value(v) for k, v in desc["state"].items()}
        if kind == "module":
            for k, default in MODULE_DEFAULTS.items():
                state.setdefault(k, type(default)() if default is not None else None)
            obj.__setstate__(state)  # torch's own, as unpickling a module does
        elif kind == "optimizer":
            obj.__setstate__({**state, "state": collections.defaultdict(dict)})
        else:
            set_state(obj, state)
        if accumulates(obj):
            self.accumulators[key] = obj
        return obj

    def _data(self, key: str, cls: Any, described: dict[str, Any]) -> Any:
        """An object of a library's plain class by its attributes (``by_attributes``): the
        class and every attribute name checked here before anything is made."""
        refusal = by_attributes.refusal(cls, self.root)
        if refusal is not None:
            raise ValueError(
                f"the chief described {cls!r} by its attributes: not made here, {refusal}"
            )
        for name in described:
            refusal = by_attributes.attribute_refusal(cls, name)
            if refusal is not None:
                raise ValueError(f"the chief described a {cls.__qualname__} attribute: {refusal}")
        obj = object.__new__(cls)
        self._built[key] = obj  # first: the state may refer back to it
        vars(obj).update({name: self.value(v) for name, v in described.items()})
        return obj

    def cls(self, key: str) -> type:
        """The program's class ``key``: its body from this task's own copy of the file, run
        with ``__build_class__`` (once per worker)."""
        built = self._built.get(key)
        if built is not None:
            return built
        desc = self.table[key]
        if desc["kind"] == "namedtuple":
            return self._namedtuple(key, desc)
        where = desc["where"]
        cache_key = (where["file"], where["sha"], desc["qualname"], desc["line"], desc["hash"])
        made = self._classes.get(cache_key)
        if made is None:
            path = self._program_path(where, f"class {desc['qualname']}")
            body = class_body(compiled(path, where["sha"]), desc["qualname"], desc["line"])
            if body is None or code_hash(body) != desc["hash"]:
                raise ImportError(
                    f"class {desc['qualname']} (line {desc['line']} of {path.name}) is not in "
                    "this worker's copy of the program, or differs from the chief's"
                )
            glob: dict[str, Any] = {"__builtins__": builtins, "__name__": desc["module"]}
            function = types.FunctionType(body, glob, desc["name"])
            bases = tuple(self.value(b) for b in desc["bases"])
            extra = (
                {} if desc["metaclass"] is None else {"metaclass": self.value(desc["metaclass"])}
            )
            for g, entry in desc["globals"].items():
                glob[g] = self.value(entry)
            made = builtins.__build_class__(function, desc["name"], *bases, **extra)
            made.__qualname__ = desc["qualname"]
            if "." not in desc["qualname"]:
                glob[desc["name"]] = made  # its methods may name it
            self._classes[cache_key] = made
        self._built[key] = made
        return made

    def _namedtuple(self, key: str, desc: dict[str, Any]) -> type:
        """A class ``collections.namedtuple`` made on the chief, made here the same way (it
        checks the names are identifiers); one per worker while its fields and defaults stay."""
        fields = [str(f) for f in desc["fields"]]
        defaults = [self.value(d) for d in desc["defaults"]]
        cache_key = ("namedtuple", desc["module"], desc["qualname"], tuple(fields), repr(defaults))
        made = self._classes.get(cache_key)
        if made is None:
            made = collections.namedtuple(  # type: ignore[misc]
                str(desc["name"]), fields, defaults=defaults, module=str(desc["module"])
            )
            made.__qualname__ = str(desc["qualname"])
            self._classes[cache_key] = made
        self._built[key] = made
        return made

    def _program_path(self, where: dict[str, Any], what: str) -> Path:
        rel = Path(str(where["file"]))
        path = resolved(str(self.root / rel))
        if rel.is_absolute() or not path.is_relative_to(self.root):
            raise ValueError(f"the chief named {rel}, outside the program")
        return same_copy(path, where["sha"], what)

    def function(self, key: str) -> types.FunctionType:
        built = self._built.get(key)
        if built is not None:
            return built
        desc = self.table[key]
        code = self._code(desc)
        freevars = code.co_freevars
        cells = tuple(types.CellType() for _ in freevars)
        # With the registry of the warnings it shows (``warnings`` would add one at its first):
        # kept with the function, so a kept call shows a warning once, as one process would.
        glob: dict[str, Any] = {
            "__builtins__": builtins,
            "__name__": desc["module"],
            WARNING_REGISTRY: {},
        }
        fn = types.FunctionType(code, glob, desc["name"], None, cells or None)
        fn.__qualname__ = desc["qualname"]
        fn.__module__ = desc["module"]
        self._built[key] = fn  # first: a capture of itself finds it
        for g, entry in desc["globals"].items():
            glob[g] = self.value(entry)
        for cell, entry in zip(cells, desc["closure"], strict=True):
            cell.cell_contents = self.value(entry)
        fn.__defaults__ = tuple(self.value(d) for d in desc["defaults"]) or None
        fn.__kwdefaults__ = {k: self.value(d) for k, d in desc["kwdefaults"].items()} or None
        return fn

    def _code(self, desc: dict[str, Any]) -> types.CodeType:
        where = desc["where"]
        key = (self.root, repr(where), desc["qualname"], desc["line"], desc["hash"])
        known = _codes.get(key)
        if known is not None:
            path, code = known
            # Found before in this copy of the file: the copy must still hash as the chief's.
            same_copy(path, where["sha"], f"{desc['qualname']} (line {desc['line']})")
            return code
        path, code = self._find_code(desc, where)
        _codes[key] = (path, code)
        return code

    def _find_code(
        self, desc: dict[str, Any], where: dict[str, Any]
    ) -> tuple[Path, types.CodeType]:
        if "file" in where:
            path = self._program_path(where, f"{desc['qualname']} (line {desc['line']})")
        else:
            module = self._module(str(where["import"]))
            path = resolved(str(getattr(module, "__file__", "") or ""))
            same_copy(path, where["sha"], f"{desc['qualname']} (line {desc['line']})")
        what = f"{desc['qualname']} (line {desc['line']} of {path.name})"
        top = compiled(path, str(where["sha"]))
        for code in nested(top):
            if code.co_qualname == desc["qualname"] and code.co_firstlineno == desc["line"]:
                if code_hash(code) != desc["hash"]:
                    raise ImportError(f"{what}: its code differs from the chief's")
                return path, code
        raise ImportError(f"{what} is not in this worker's copy of the program")

    def _module(self, name: str) -> types.ModuleType:
        module = sys.modules.get(name)
        if module is not None:
            return module
        if name.split(".")[0] in _OUR_PACKAGES:
            return importlib.import_module(name)  # stratagem's or torch's own modules
        spec = importlib.util.find_spec(name)
        origin = Path(spec.origin).resolve() if spec and spec.origin else None
        if origin is None or not origin.is_relative_to(self.root):
            raise ImportError(
                f"the chief's function uses module {name!r}, which this worker has not imported "
                "and which is neither one of the program's own nor stratagem's or torch's: a "
                "worker imports nothing else (import what the chief's objects need at the top "
                "of the program, which a worker runs before it serves: `from transformers "
                "import GPT2LMHeadModel` imports GPT-2's modules)"
            )
        return importlib.import_module(name)


def sequence_of(cls: Any, items: list[Any]) -> list | tuple:
    """A ``cls`` (a list or tuple subclass) of ``items``. A Python class's own code is not
    run (a namedtuple's fields are its items, checked by number); a built-in type of an
    extension (``torch.Size``, ``torch.return_types``) is made by its constructor."""
    if not isinstance(cls, type) or not issubclass(cls, list | tuple):
        raise ValueError(f"a sequence entry names a list or tuple subclass; got {cls!r}")
    if not cls.__flags__ & _HEAP_TYPE:
        return cls(items)
    if issubclass(cls, list):
        made = list.__new__(cls)
        list.extend(made, items)
        return made
    fields = getattr(cls, "_fields", None)
    if isinstance(fields, tuple) and len(fields) != len(items):
        raise ValueError(
            f"{cls.__qualname__} has the fields {list(fields)}; the chief sent {len(items)} items"
        )
    return tuple.__new__(cls, items)


def dtype_named(name: str) -> torch.dtype:
    """``torch.<name>``, which must be a dtype (``"float32"``)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"torch.{name} is not a dtype")
    return dtype


def _no_special(entry: dict[str, Any]) -> Any:
    raise ValueError(f"nothing on this task resolves {entry!r}")
