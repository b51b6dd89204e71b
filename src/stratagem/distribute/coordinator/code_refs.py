"""Functions sent by reference to code every task has, never by value.

Every task of a job runs the same program. The chief describes a function as *where its code
is* (a file relative to the program root, or an importable module), its ``co_qualname`` and
``co_firstlineno``, and a hash of its code object (bytecode, names and constants, recursively:
``marshal.dumps`` is not used, its reference flags depend on refcounts and differ between
processes). The worker compiles **its own copy** of that file (``compile``: nothing is
executed), finds the code object by qualname and line, checks the hash and builds the function
with ``types.FunctionType``. A worker therefore only runs code on its own disk; the chief merely
picks which.

What the function reads travels as a table of plain data (``describe``): each global name its
code loads, each closure cell and each default is

- a module, by name (the worker imports only modules it has imported already or the program's
  own files);
- a function, by reference (recursively; cycles allowed), or a class or builtin by
  ``module.qualname``;
- a tensor or plain data (``comm.plain_data``), by value; lists, tuples and dicts of these;
- an object *by state*, as ``pickle`` would take it but without running anything the file
  names: a ``torch.nn.Module`` (its ``__dict__``: submodules, flags, buffers), a
  ``torch.optim.Optimizer`` (class, defaults and parameter groups; its state is the ps's) or an
  object whose class opts in with ``_sg_portable_state``/``_sg_from_state`` (Keras losses,
  metrics, optimizer recipes). The worker makes ``cls.__new__(cls)`` of that class (only these
  kinds) and sets the described state; the same object described twice is one object there;
- a class of the program's main file, by its class body (compiled from the worker's copy and
  run with ``__build_class__``, cached per worker so that every call sees one class); other
  classes, enum members, dtypes and devices by name;
- whatever the caller's ``special`` hook names (the coordinator's per-worker iterators, its
  strategy, the ps variables): the worker's ``resolve_special`` gives its own object for it.

Anything else is a ``TypeError`` naming the function, the captured name and its type. An object
whose class has ``_sg_totals``/``_sg_add_totals`` (a metric) is an accumulator: the worker
sends back what it accumulated during the call, and the chief adds that to the original.
"""

from __future__ import annotations

import argparse
import builtins
import collections
import dis
import enum
import hashlib
import importlib
import importlib.util
import inspect
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from stratagem.comm import plain_data

Special = Callable[[Any], dict[str, Any] | None]
ResolveSpecial = Callable[[dict[str, Any]], Any]

_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL"})
_PLAIN = (type(None), bool, int, float, str)
# Packages a worker imports a module of when a function needs one it has not imported yet: the
# ones it runs on anyway (importing their modules runs nothing a peer chose).
_OUR_PACKAGES = frozenset({"stratagem", "torch"})


class Portable:
    """A class whose objects a coordinator's worker may rebuild by state: its attributes minus
    those named in ``_sg_local`` (a lock, a strategy, per-replica state: one process's own),
    which ``_sg_after_rebuild`` remakes there. Keras losses, metrics and optimizers derive from
    it. An accumulator (``_sg_accumulates``, a metric) starts empty on the worker; what it
    accumulated during a call (``_sg_totals``) comes back and is added to the chief's
    (``_sg_add_totals``)."""

    _sg_local: tuple[str, ...] = ()
    _sg_accumulates = False

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


def program_root() -> Path:
    """The directory of the program every task runs (``__main__``'s file), else the cwd."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    return Path(main).resolve().parent if main else Path.cwd().resolve()


def program_file() -> Path | None:
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    return Path(main).resolve() if main else None


_file_hashes: dict[Path, tuple[tuple[int, int], str]] = {}
# id(code) -> (the code, its hash, its global names), each computed once; the code is kept, so
# its id is never reused by another.
_code_facts: dict[int, tuple[types.CodeType, str | None, list[str] | None]] = {}
_in_program_cache: dict[tuple[type, Path], bool] = {}
# A bare module's attributes: what a described module leaves out when empty (its hooks), and
# the worker puts back as fresh empty ones.
_MODULE_DEFAULTS = {
    k: v
    for k, v in vars(torch.nn.Module()).items()
    if v is None or (isinstance(v, dict | set) and not v)
}
_HOOK_DICTS = {k for k, v in _MODULE_DEFAULTS.items() if k.endswith("hooks") and v == {}}
_compiled_files: dict[tuple[Path, str], types.CodeType] = {}


def file_hash(path: Path) -> str:
    """The sha256 of ``path``'s bytes (kept while its size and mtime stay: every schedule
    describes the program's functions, and reading the file each time would dominate)."""
    stat = path.stat()
    mark = (stat.st_size, stat.st_mtime_ns)
    known = _file_hashes.get(path)
    if known is not None and known[0] == mark:
        return known[1]
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    _file_hashes[path] = (mark, digest)
    return digest


def compiled(path: Path, sha: str) -> types.CodeType:
    """``path`` compiled (nothing executed), once per content."""
    code = _compiled_files.get((path, sha))
    if code is None:
        code = compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
        _compiled_files[(path, sha)] = code
    return code


def code_hash(code: types.CodeType) -> str:
    """A hash of ``code`` that is the same in every process compiling the same source (kept per
    code object: code is immutable, and every schedule describes its function again)."""
    known = _code_facts.get(id(code))
    if known is not None and known[0] is code and known[1] is not None:
        return known[1]
    digest = compute_code_hash(code)
    _code_facts[id(code)] = (code, digest, known[2] if known else None)
    return digest


def compute_code_hash(code: types.CodeType) -> str:
    """``code_hash`` computed afresh."""
    h = hashlib.sha256()
    hash_into(h, code)
    return h.hexdigest()


def hash_into(h: Any, value: Any) -> None:
    if isinstance(value, types.CodeType):
        h.update(b"code(")
        for part in (
            value.co_qualname,
            value.co_argcount,
            value.co_posonlyargcount,
            value.co_kwonlyargcount,
            value.co_flags,
            value.co_names,
            value.co_varnames,
            value.co_freevars,
            value.co_cellvars,
        ):
            h.update(repr(part).encode() + b";")
        h.update(value.co_code)
        for const in value.co_consts:
            hash_into(h, const)
        h.update(b")")
    elif isinstance(value, tuple):
        h.update(b"tuple(")
        for item in value:
            hash_into(h, item)
        h.update(b")")
    elif isinstance(value, frozenset):  # its order follows string hashing: differs per process
        h.update(b"frozenset(" + repr(sorted(repr(v) for v in value)).encode() + b")")
    else:
        h.update(f"{type(value).__name__}:{value!r};".encode())


def global_names(code: types.CodeType) -> list[str]:
    """The global names ``code`` and the code nested in it load or store, in first-use order."""
    known = _code_facts.get(id(code))
    if known is not None and known[0] is code and known[2] is not None:
        return known[2]
    names = _global_names(code)
    _code_facts[id(code)] = (code, known[1] if known else None, names)
    return names


def _global_names(code: types.CodeType) -> list[str]:
    names: dict[str, None] = {}
    for ins in dis.get_instructions(code):
        if ins.opname in _GLOBAL_OPS:
            names[str(ins.argval)] = None
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(dict.fromkeys(_global_names(const)))
    return list(names)


def unwrap(fn: Any) -> Any:
    """The Python function behind ``fn`` (a ``functools.wraps`` decorator's ``__wrapped__``)."""
    seen = 0
    while not isinstance(fn, types.FunctionType) and hasattr(fn, "__wrapped__") and seen < 16:
        fn, seen = fn.__wrapped__, seen + 1
    return fn


def _fn_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _reachable(module: str, qualname: str) -> Any:
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


class Describer:
    """Builds the table of plain data that ``rebuild`` turns back into functions."""

    def __init__(self, *, root: Path | None = None, special: Special | None = None) -> None:
        self.root = (root or program_root()).resolve()
        self.special = special or (lambda value: None)
        self.functions: dict[str, dict[str, Any]] = {}  # the table: functions, objects, classes
        self._keys: dict[int, str] = {}
        self._keep: list[Any] = []  # the described objects: their ids stay theirs
        self.accumulators: dict[str, Any] = {}  # table key -> an object whose totals come back

    def function(self, fn: Any, *, what: str) -> dict[str, Any]:
        """A reference to ``fn`` (a capture entry); ``what`` names it in errors."""
        fn = unwrap(fn)
        if not isinstance(fn, types.FunctionType):
            return self.value(fn, owner=what, name="the function itself")
        key = self._keys.get(id(fn))
        if key is not None:
            return {"k": "function", "ref": key}
        module, qualname = fn.__module__, fn.__qualname__
        path = Path(fn.__code__.co_filename)
        if (
            isinstance(module, str)
            and module != "__main__"
            and _reachable(module, qualname) is fn
            and not (path.is_file() and path.resolve().is_relative_to(self.root))
        ):
            # A library's function (torch's, ours): the worker's own module holds it, with the
            # module's own globals (which need not be plain data).
            return {"k": "named", "module": module, "qualname": qualname}
        key = str(len(self.functions))
        self._keys[id(fn)] = key
        self._keep.append(fn)
        name = _fn_name(fn)
        code = fn.__code__
        desc: dict[str, Any] = {
            "name": fn.__name__,
            "qualname": code.co_qualname,
            "line": code.co_firstlineno,
            "hash": code_hash(code),
            "module": str(fn.__globals__.get("__name__", "__main__")),
        }
        self.functions[key] = desc  # before the captures: a function may capture itself
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
        path = Path(fn.__code__.co_filename)
        module = str(fn.__globals__.get("__name__", "__main__"))
        if path.is_file():
            resolved = path.resolve()
            if resolved.is_relative_to(self.root):
                return {"file": resolved.relative_to(self.root).as_posix(), "sha": file_hash(path)}
            if module != "__main__" and getattr(sys.modules.get(module), "__file__", None):
                return {"import": module, "sha": file_hash(path)}
        raise TypeError(
            f"{name} is a function that cannot be sent: its code is in {str(path)!r}, which is "
            f"neither a file of the program (under {self.root.name}/) nor an importable module; "
            "a worker runs only code from its own copy of the program (define the function in "
            "the script or a module of it, not in a REPL or with exec)"
        )

    def value(self, value: Any, *, owner: str, name: str) -> dict[str, Any]:
        """A capture entry for ``value``, read by ``owner`` as ``name``."""
        special = self.special(value)
        if special is not None:
            return {"k": "special", "v": special}
        if isinstance(value, _PLAIN):
            return {"k": "value", "v": value}
        if isinstance(value, torch.Tensor):
            plain_data.check(value, what=f"{name} of {owner}")
            return {"k": "value", "v": value}
        if isinstance(value, types.ModuleType):
            return {"k": "module", "name": value.__name__}
        if isinstance(value, list | tuple):
            items = [self.value(v, owner=owner, name=f"{name}[{i}]") for i, v in enumerate(value)]
            return {"k": type(value).__name__, "items": items}
        if type(value) is dict and all(isinstance(k, str) for k in value):
            items = {k: self.value(v, owner=owner, name=f"{name}[{k!r}]") for k, v in value.items()}
            return {"k": "dict", "items": items}
        if type(value) in (dict, collections.OrderedDict):  # keys of plain data (hook handles)
            pairs = [
                [self.value(k, owner=owner, name=f"a key of {name}"),
                 self.value(v, owner=owner, name=f"{name}[{k!r}]")]
                for k, v in value.items()
            ]  # fmt: skip
            return {"k": "pairs", "ordered": type(value) is not dict, "items": pairs}
        if type(value) in (set, frozenset):
            items = [self.value(v, owner=owner, name=f"an item of {name}") for v in value]
            return {"k": type(value).__name__, "items": items}
        if type(value) in (argparse.Namespace, types.SimpleNamespace):  # a script's options
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
        if isinstance(value, enum.Enum) and _is_named(type(value)):
            member = f"{type(value).__qualname__}.{value.name}"
            return {"k": "named", "module": type(value).__module__, "qualname": member}
        if isinstance(value, type):
            if _is_named(value) and not self._in_program(value):
                return {"k": "named", "module": value.__module__, "qualname": value.__qualname__}
            return self._class(value, owner=owner, name=name)
        if _portable_kind(value) is not None:
            return self._object(value, owner=owner, name=name)
        if _is_named(value):
            return {"k": "named", "module": value.__module__, "qualname": value.__qualname__}
        kind = type(value)
        raise TypeError(
            f"{owner} is a function that cannot be sent: it captures {name!r}, a "
            f"{kind.__module__}.{kind.__qualname__}. A scheduled function may capture modules, "
            "functions, classes, tensors, plain data (None, bool, int, float, str, lists, tuples, "
            "dicts, sets, argparse namespaces), torch modules and optimizers, Keras losses, "
            "metrics and optimizers (by state), per-worker iterators and the coordinator's "
            "strategy"
        )

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

    def _object(self, value: Any, *, owner: str, name: str) -> dict[str, Any]:
        """An object by state: a table entry made once per object (shared and cyclic
        references stay one object on the worker)."""
        key = self._keys.get(id(value))
        if key is not None:
            return {"k": "object", "ref": key}
        kind = _portable_kind(value)
        key = f"o{len(self.functions)}"
        self._keys[id(value)] = key
        self._keep.append(value)
        desc: dict[str, Any] = {"kind": kind}
        self.functions[key] = desc  # before the state: the state may refer back to it
        desc["class"] = self.value(type(value), owner=owner, name=f"the class of {name}")
        if kind == "module":
            # Empty hooks and the like are left out; the worker puts back fresh empty ones.
            # So are this process's own hooks (``_sg_local``: the chief's read hooks).
            state = {
                k: v
                for k, v in ((k, _without_local_hooks(k, v)) for k, v in vars(value).items())
                if not (
                    k in _MODULE_DEFAULTS and (v is None or (isinstance(v, dict | set) and not v))
                )
            }
        elif kind == "optimizer":
            state = {k: v for k, v in vars(value).items() if k != "state"}  # state: on the ps
        else:
            state = value._sg_portable_state()
        desc["state"] = {
            k: self.value(v, owner=owner, name=f"{name}.{k}") for k, v in state.items()
        }
        if isinstance(value, Portable) and value._sg_accumulates:
            self.accumulators[key] = value
        return {"k": "object", "ref": key}

    def _class(self, cls: type, *, owner: str, name: str) -> dict[str, Any]:
        """A class of the program's own files, by its class body (the worker runs the body of
        its own copy to make the class)."""
        key = self._keys.get(id(cls))
        if key is not None:
            return {"k": "class", "ref": key}
        what = f"class {cls.__qualname__} (captured as {name!r} by {owner})"
        try:
            path = Path(inspect.getfile(cls)).resolve()
            line = inspect.getsourcelines(cls)[1]
        except (TypeError, OSError) as e:
            raise TypeError(f"{what} cannot be sent: its source is not in a file ({e})") from None
        if not path.is_relative_to(self.root):
            raise TypeError(f"{what} cannot be sent: {path.name} is not a file of the program")
        body = _class_body(compiled(path, file_hash(path)), cls.__qualname__, line)
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
        desc["bases"] = [
            self.value(b, owner=owner, name=f"a base of {cls.__qualname__}") for b in cls.__bases__
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


def _without_local_hooks(name: str, value: Any) -> Any:
    """A module attribute as described: a hook dictionary without the hooks that belong to
    this process (marked ``_sg_local``); anything else as it is."""
    if name not in _HOOK_DICTS or not isinstance(value, dict):
        return value
    if not any(getattr(h, "_sg_local", False) for h in value.values()):
        return value
    return type(value)((k, h) for k, h in value.items() if not getattr(h, "_sg_local", False))


def _is_named(value: Any) -> bool:
    """Whether ``value`` is reachable by ``module.qualname`` (and is not the script's own)."""
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    return (
        isinstance(module, str)
        and isinstance(qualname, str)
        and module != "__main__"
        and _reachable(module, qualname) is value
    )


def _portable_kind(value: Any) -> str | None:
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


def _class_body(top: types.CodeType, qualname: str, line: int) -> types.CodeType | None:
    """The code of the class body ``qualname`` at ``line`` (a class statement's code object:
    no function flags), if ``top`` has it."""
    for code in _nested(top):
        if (
            code.co_qualname == qualname
            and code.co_firstlineno == line
            and not code.co_flags & inspect.CO_NEWLOCALS
        ):
            return code
    return None


def _cell(cell: types.CellType, owner: str, name: str) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        raise TypeError(
            f"{owner} is a function that cannot be sent: its closure variable {name!r} has no "
            "value yet"
        ) from None


# ---------------------------------------------------------------------------- the worker side


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
        self.root = (root or program_root()).resolve()
        self.table = functions
        self.resolve_special = resolve_special or _no_special
        self._built: dict[str, Any] = {}  # table key -> the function, object or class made
        # The program's classes made so far, by (file, qualname, line, hash): the worker keeps
        # one across calls, so that an object of a later call is an instance of the same class.
        self._classes = classes if classes is not None else {}
        self.accumulators: dict[str, Any] = {}  # table key -> an accumulator made here

    def value(self, entry: Any) -> Any:
        if not isinstance(entry, dict) or "k" not in entry:
            raise ValueError(f"a capture entry is a dict with 'k'; got {entry!r}")
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
                raise ValueError(f"a named reference reaches no dunder: {entry['qualname']!r}")
            self._module(str(entry["module"]))
            found = _reachable(str(entry["module"]), str(entry["qualname"]))
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
        raise ValueError(f"unknown capture kind {kind!r}")

    def object(self, key: str) -> Any:
        """The object ``key`` of the table: ``cls.__new__(cls)`` of a module, optimizer or
        portable class, with the described state (only these kinds are ever made)."""
        built = self._built.get(key)
        if built is not None:
            return built
        desc = self.table[key]
        cls = self.value(desc["class"])
        kind = desc["kind"]
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
            for k, default in _MODULE_DEFAULTS.items():
                state.setdefault(k, type(default)() if default is not None else None)
            obj.__setstate__(state)  # torch's own, as unpickling a module does
        elif kind == "optimizer":
            obj.__setstate__({**state, "state": collections.defaultdict(dict)})
        else:
            obj._sg_from_state(state)
        if isinstance(obj, Portable) and obj._sg_accumulates:
            self.accumulators[key] = obj
        return obj

    def cls(self, key: str) -> type:
        """The program's class ``key``: its body from this task's own copy of the file, run
        with ``__build_class__`` (once per worker)."""
        built = self._built.get(key)
        if built is not None:
            return built
        desc = self.table[key]
        where = desc["where"]
        cache_key = (where["file"], where["sha"], desc["qualname"], desc["line"], desc["hash"])
        made = self._classes.get(cache_key)
        if made is None:
            path = self._program_path(where, f"class {desc['qualname']}")
            body = _class_body(compiled(path, where["sha"]), desc["qualname"], desc["line"])
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

    def _program_path(self, where: dict[str, Any], what: str) -> Path:
        rel = Path(str(where["file"]))
        path = (self.root / rel).resolve()
        if rel.is_absolute() or not path.is_relative_to(self.root):
            raise ValueError(f"the chief named {rel}, outside the program")
        return _same_copy(path, where["sha"], what)

    def function(self, key: str) -> types.FunctionType:
        built = self._built.get(key)
        if built is not None:
            return built
        desc = self.table[key]
        code = self._code(desc)
        freevars = code.co_freevars
        cells = tuple(types.CellType() for _ in freevars)
        glob: dict[str, Any] = {"__builtins__": builtins, "__name__": desc["module"]}
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
        if "file" in where:
            path = self._program_path(where, f"{desc['qualname']} (line {desc['line']})")
        else:
            module = self._module(str(where["import"]))
            path = Path(str(getattr(module, "__file__", "") or "")).resolve()
            _same_copy(path, where["sha"], f"{desc['qualname']} (line {desc['line']})")
        what = f"{desc['qualname']} (line {desc['line']} of {path.name})"
        top = compiled(path, str(where["sha"]))
        for code in _nested(top):
            if code.co_qualname == desc["qualname"] and code.co_firstlineno == desc["line"]:
                if code_hash(code) != desc["hash"]:
                    raise ImportError(f"{what}: its code differs from the chief's")
                return code
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
                "worker imports nothing else"
            )
        return importlib.import_module(name)


def _same_copy(path: Path, sha: Any, what: str) -> Path:
    """``path``, if this worker's copy of it hashes as the chief's (``sha``)."""
    if not path.is_file() or file_hash(path) != sha:
        raise ImportError(
            f"{what}: this worker's copy of {path.name} differs from the chief's (or is "
            "missing): every task must run the same program"
        )
    return path


def _nested(code: types.CodeType) -> Any:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested(const)


def dtype_named(name: str) -> torch.dtype:
    """``torch.<name>``, which must be a dtype (``"float32"``)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"torch.{name} is not a dtype")
    return dtype


def _no_special(entry: dict[str, Any]) -> Any:
    raise ValueError(f"nothing on this task resolves {entry!r}")


def source_line(fn: Any) -> str:
    """``"fn (file.py:12)"``: a function named for messages."""
    fn = unwrap(fn)
    try:
        return f"{_fn_name(fn)} ({Path(inspect.getfile(fn)).name}:{fn.__code__.co_firstlineno})"
    except (TypeError, AttributeError):
        return _fn_name(fn)


__all__ = [
    "Describer",
    "Portable",
    "Rebuilder",
    "add_totals",
    "code_hash",
    "file_hash",
    "program_file",
    "program_root",
    "totals_of",
]
