"""The program every task runs, and how a piece of its code is named across processes.

A function travels as *where its code is* (a file relative to the program root, or an
importable module), its ``co_qualname`` and ``co_firstlineno``, and a hash of its code object
(bytecode, names and constants, recursively: ``marshal.dumps`` is not used, its reference flags
depend on refcounts and differ between processes). A task compiles its own copy of that file
(``compile``: nothing is executed) and finds the code object by qualname and line.
"""

from __future__ import annotations

import dis
import functools
import hashlib
import inspect
import os
import sys
import types
from pathlib import Path
from typing import Any

_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL"})

_file_hashes: dict[Path, tuple[tuple[int, int], str]] = {}
# id(code) -> (the code, its hash, its global names), each computed once; the code is kept, so
# its id is never reused by another.
_code_facts: dict[int, tuple[types.CodeType, str | None, list[str] | None]] = {}
_compiled_files: dict[tuple[Path, str], types.CodeType] = {}


@functools.lru_cache(maxsize=4096)
def resolved(path: str) -> Path:
    """``Path(path).resolve()``, once per path string: every schedule describes (and every
    worker rebuilds) the same functions of the same files, and resolving a path is a stat per
    component, a fifth of the chief's time per ``schedule`` when it was done each time. The
    file's content is still checked each time (``file_hash``, ``same_copy``)."""
    return Path(path).resolve()


def program_root() -> Path:
    """The directory of the program every task runs (``__main__``'s file), else the cwd."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    return _directory_of(str(main)) if main else resolved(os.getcwd())


@functools.lru_cache(maxsize=64)
def _directory_of(path: str) -> Path:
    # The same Path each time: a describer per schedule keys its caches by the root, and a
    # new Path computes its hash again.
    return resolved(path).parent


def program_file() -> Path | None:
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    return resolved(str(main)) if main else None


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


_source_lines: dict[tuple[types.CodeType, str], str] = {}


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


def fn_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def reachable(module: str, qualname: str) -> Any:
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def is_named(value: Any) -> bool:
    """Whether ``value`` is reachable by ``module.qualname`` (and is not the script's own)."""
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    return (
        isinstance(module, str)
        and isinstance(qualname, str)
        and module != "__main__"
        and reachable(module, qualname) is value
    )


def class_body(top: types.CodeType, qualname: str, line: int) -> types.CodeType | None:
    """The code of the class body ``qualname`` at ``line`` (a class statement's code object:
    no function flags), if ``top`` has it."""
    for code in nested(top):
        if (
            code.co_qualname == qualname
            and code.co_firstlineno == line
            and not code.co_flags & inspect.CO_NEWLOCALS
        ):
            return code
    return None


def same_copy(path: Path, sha: Any, what: str) -> Path:
    """``path``, if this worker's copy of it hashes as the chief's (``sha``)."""
    if not path.is_file() or file_hash(path) != sha:
        raise ImportError(
            f"{what}: this worker's copy of {path.name} differs from the chief's (or is "
            "missing): every task must run the same program"
        )
    return path


def nested(code: types.CodeType) -> Any:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from nested(const)


def source_line(fn: Any) -> str:
    """``"fn (file.py:12)"``: a function named for messages (kept per code object and name:
    ``schedule`` names its function on every call)."""
    fn = unwrap(fn)
    code = getattr(fn, "__code__", None)
    key = (code, fn_name(fn)) if isinstance(code, types.CodeType) else None
    known = _source_lines.get(key) if key is not None else None
    if known is not None:
        return known
    try:
        line = f"{fn_name(fn)} ({Path(inspect.getfile(fn)).name}:{fn.__code__.co_firstlineno})"
    except (TypeError, AttributeError):
        return fn_name(fn)
    if key is not None:
        _source_lines[key] = line
    return line


def slot_names(cls: type) -> list[str]:
    """The attributes the ``__slots__`` of ``cls`` and its bases add (none for a namedtuple,
    whose ``__slots__`` is empty)."""
    names: list[str] = []
    for c in cls.__mro__:
        slots = vars(c).get("__slots__", ())
        names += [slots] if isinstance(slots, str) else list(slots)
    return [n for n in names if n not in ("__dict__", "__weakref__")]
