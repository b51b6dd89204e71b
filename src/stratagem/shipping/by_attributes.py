"""Objects of a library's classes that travel by their attributes: a Hugging Face model's
``config`` (``GPT2Config``), ``generation_config`` and any object like them, in a module,
optimizer or closure that a coordinator's worker rebuilds.

The worker makes such an object as ``pickle`` makes a plain one, minus every hook:
``object.__new__(cls)``, its ``__dict__`` filled with the described attributes, each a capture
entry like any other. Nothing a peer sends is called and nothing is imported; the worker checks
the class and each attribute against this rule itself. A class qualifies when it is a library's
(named by ``module.qualname``; not the program's or stratagem's, which opt in with
``Portable``; no module, optimizer or ``Portable``); its objects are all ``__dict__`` (every class
of its MRO but ``object`` a class statement of a ``.py`` file, no ``__slots__``); it has no
``__del__``; and its pickling hooks are ``object``'s (no ``__setstate__``, ``__getnewargs__``...).
An attribute's name is a string, no dunder, and names no method or other descriptor of the class.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from stratagem.shipping.portable import Portable
from stratagem.shipping.program import is_named

_PICKLING_HOOKS = ("__reduce__", "__reduce_ex__", "__getstate__")
_NO_HOOKS = ("__setstate__", "__getnewargs__", "__getnewargs_ex__", "__del__")
_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: every class statement's (and many C types')
_refusals: dict[tuple[type, Path], str | None] = {}


def refusal(cls: type, root: Path) -> str | None:
    """Why objects of ``cls`` may not travel by their attributes (None: they may); ``root`` is
    the program's directory."""
    if not isinstance(cls, type):  # what a peer sent as a class: not hashed, not kept
        return f"{cls!r} is not a class"
    key = (cls, root)
    if key not in _refusals:
        _refusals[key] = _refusal(cls, root)
    return _refusals[key]


def _refusal(cls: type, root: Path) -> str | None:
    if issubclass(cls, torch.nn.Module | torch.optim.Optimizer | Portable):
        return "it is a module, optimizer or Portable class, which travel as such"
    for base in cls.__mro__[:-1]:
        if not _python_source(base):
            return f"{base.__module__}.{base.__qualname__} is not a class of Python source"
        if "__slots__" in vars(base):
            return f"{base.__qualname__} has __slots__ (state outside its __dict__)"
    if cls.__new__ is not object.__new__:
        return "its objects are not made by object.__new__"
    if not is_named(cls):
        return "its class is not reachable by its module and qualname"
    if str(cls.__module__).split(".")[0] == "stratagem":
        return (
            "it is one of stratagem's own classes, and of those only Keras models, dtype policies, "
            "losses, metrics and optimizers can be sent to a worker"
        )
    try:
        in_program = Path(inspect.getfile(cls)).resolve().is_relative_to(root)
    except (TypeError, OSError):
        in_program = False
    if in_program:
        return "its class is the program's own (derive it from stratagem.shipping.Portable)"
    for hook in _PICKLING_HOOKS:
        if getattr(cls, hook) is not getattr(object, hook):
            return f"it defines {hook} (what pickle takes is not its __dict__)"
    for hook in _NO_HOOKS:
        if hasattr(cls, hook):
            return f"it defines {hook}"
    return None


def _python_source(cls: type) -> bool:
    """Whether ``cls`` is made by a class statement of a ``.py`` file (not a C type, whose
    objects hold state outside their ``__dict__``; many are heap types nowadays)."""
    if not cls.__flags__ & _HEAP_TYPE:
        return False
    try:
        return inspect.getfile(cls).endswith(".py")
    except (TypeError, OSError):
        return False


def attribute_refusal(cls: type, name: object) -> str | None:
    """Why an attribute called ``name`` may not be set on a rebuilt ``cls`` (None: it may)."""
    if not isinstance(name, str):
        return f"attribute names are strings; got {type(name).__name__} {name!r}"
    if name.startswith("__") and name.endswith("__"):
        return f"{name!r} is a dunder name"
    for base in cls.__mro__:
        if name in vars(base) and hasattr(type(vars(base)[name]), "__get__"):
            kind = type(vars(base)[name]).__name__
            return f"{name!r} would hide {base.__qualname__}.{name} (a {kind})"
    return None
