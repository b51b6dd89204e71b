"""Which module classes ``load_model`` may rebuild from a saved config: Keras's registration rule.

A save names its module's class and, when the class describes itself, the config that rebuilds
it: Keras's ``get_config()`` (rebuilt by ``cls.from_config(config)``, else ``cls(**config)``)
or a Hugging Face ``config`` (rebuilt by ``cls(cls.config_class.from_dict(config))``). Loading
rebuilds only a class registered with ``register_keras_serializable`` or given in
``custom_objects`` (found by name, nothing imported), or one whose top-level package is in
``allow_packages`` (imported by its module path, inside that package only); ``safe_mode=False``
allows any class the file names, for files you trust. Anything else is an
``UnregisteredClassError`` that says how to allow it. Configs are plain JSON data.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from stratagem.errors import StratagemError

__all__ = [
    "ClassPolicy",
    "UnregisteredClassError",
    "describe",
    "get_custom_objects",
    "get_registered_name",
    "get_registered_object",
    "rebuild",
    "register_keras_serializable",
]

T = TypeVar("T")

# Keras's GLOBAL_CUSTOM_OBJECTS: "package>name" -> class (a class's name is found from it).
_OBJECTS: dict[str, type] = {}

_DOTTED = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")


class UnregisteredClassError(StratagemError, TypeError):
    """A save names a class that loading may not rebuild (Keras raises a TypeError here)."""


def _protocol(cls: type) -> str | None:
    """How instances of ``cls`` describe themselves: Keras's or Hugging Face's way, or not."""
    if callable(getattr(cls, "get_config", None)):
        return "get_config"
    config_class = getattr(cls, "config_class", None)
    if isinstance(config_class, type) and callable(getattr(config_class, "from_dict", None)):
        return "config_class"
    return None


def register_keras_serializable(package: str = "Custom", name: str | None = None) -> Callable:
    """Keras's decorator: registers a class as ``"package>name"`` (``name`` defaults to the
    class's), so ``load_model`` rebuilds it from its saved config without importing anything.
    Also callable on a library's class: ``register_keras_serializable("transformers")(C)``."""
    if not isinstance(package, str) or ">" in package:
        raise ValueError(f"package must be a string without '>', got {package!r}")

    def decorator(cls: T) -> T:
        if not isinstance(cls, type) or _protocol(cls) is None:
            raise ValueError(
                f"cannot register {cls!r}: expected a class with a get_config() method (Keras) "
                "or a Hugging Face config_class, which is what a saved config rebuilds it from"
            )
        registered = f"{package}>{name or cls.__name__}"
        _OBJECTS[registered] = cls
        return cls

    return decorator


def get_registered_name(obj: type) -> str:
    """The name ``obj`` is registered under, else its own name (Keras's)."""
    return _registered_name(obj) or obj.__name__


def _registered_name(cls: type) -> str | None:
    return next((name for name, c in reversed(_OBJECTS.items()) if c is cls), None)


def get_custom_objects() -> dict[str, type]:
    """The live registry (Keras's): ``{"package>name": class}``; edit it to unregister."""
    return _OBJECTS


def get_registered_object(
    name: str, custom_objects: Mapping[str, type] | None = None
) -> type | None:
    """The class ``custom_objects`` or the registry holds under ``name``, else None."""
    if custom_objects and name in custom_objects:
        return custom_objects[name]
    return _OBJECTS.get(name)


def describe(module: torch.nn.Module) -> tuple[dict[str, Any] | None, str | None]:
    """What a save records to rebuild ``module`` by its class (or None), and why not."""
    cls = type(module)
    protocol = _protocol(cls)
    if protocol is None:
        return None, f"{cls.__qualname__} has no get_config() and no Hugging Face config"
    try:
        own = module.get_config if protocol == "get_config" else module.config.to_dict
        config = json.loads(json.dumps(own()))  # plain data, or it is not saved
    except Exception as e:
        return None, f"the config of {cls.__qualname__} is not plain JSON data ({e})"
    record = {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "registered_name": _registered_name(cls),
        "protocol": protocol,
        "config": config,
        "training": module.training,
    }
    return record, None


def is_registered(module: torch.nn.Module) -> bool:
    return _registered_name(type(module)) is not None


@dataclass(frozen=True)
class ClassPolicy:
    """The classes a load may rebuild (``load_model``'s arguments of the same names)."""

    custom_objects: Mapping[str, type] | None = None
    allow_packages: tuple[str, ...] = ()
    safe_mode: bool = True

    @classmethod
    def of(
        cls,
        custom_objects: Mapping[str, type] | None,
        allow_packages: Iterable[str] | str,
        safe_mode: bool,
    ) -> ClassPolicy:
        packages = (allow_packages,) if isinstance(allow_packages, str) else tuple(allow_packages)
        bad = [p for p in packages if not isinstance(p, str) or not _DOTTED.match(p) or "." in p]
        if bad:
            raise ValueError(
                f"allow_packages={allow_packages!r}: expected top-level package names such as "
                f"('transformers',), got {bad!r}"
            )
        if custom_objects is not None and not isinstance(custom_objects, Mapping):
            raise TypeError(
                f"custom_objects must be a dict of name -> class, got "
                f"{type(custom_objects).__name__}"
            )
        return cls(custom_objects, packages, bool(safe_mode))


def _class_of(record: Mapping[str, Any], policy: ClassPolicy) -> type:
    path = str(record.get("class"))
    registered = record.get("registered_name")
    short = path.rsplit(".", 1)[-1]
    found = get_registered_object(registered, policy.custom_objects) if registered else None
    if found is None and policy.custom_objects:
        found = policy.custom_objects.get(short)
    if found is not None:
        if not (isinstance(found, type) and issubclass(found, torch.nn.Module)):
            raise TypeError(f"{short!r} is registered as {found!r}, not a torch.nn.Module class")
        return found
    package = path.split(".", 1)[0]
    if not (package in policy.allow_packages or not policy.safe_mode):
        shown = f"{path!r} (registered as {registered!r})" if registered else repr(path)
        raise UnregisteredClassError(
            f"the save names the class {shown}, which is neither registered nor from an "
            f"allowed package, so it is not rebuilt: nothing is imported by a name a file "
            f"chose. Register it (sg.keras.saving.register_keras_serializable()), or pass "
            f"custom_objects={{{short!r}: {short}}} or allow_packages=({package!r},) to "
            f"load_model, or safe_mode=False for a file you trust; or pass module= (a fresh "
            f"{short})"
        )
    return _import(path, package)


def _import(path: str, package: str) -> type:
    """The class at ``path`` ("a.b.C"), importing its module, which lies inside ``package``."""
    parts = path.split(".")
    if not _DOTTED.match(path) or any(part.startswith("__") for part in parts):
        raise UnregisteredClassError(f"the save names the class {path!r}, not a class's path")
    for cut in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
        module_name = ".".join(parts[:cut])
        try:
            obj: Any = importlib.import_module(module_name)
        except ImportError:
            continue
        for attribute in parts[cut:]:
            obj = getattr(obj, attribute, None)
        # Defined in the package, not merely reachable from it (a name it re-exports).
        inside = isinstance(obj, type) and f"{obj.__module__}.".startswith(f"{package}.")
        if inside and issubclass(obj, torch.nn.Module):
            return obj
        break
    raise UnregisteredClassError(
        f"the save names the class {path!r}, which is not a torch.nn.Module class defined in "
        f"the package {package!r}"
    )


def rebuild(record: Mapping[str, Any], policy: ClassPolicy) -> torch.nn.Module:
    """A fresh module of the class ``record`` names, built from its saved config."""
    cls = _class_of(record, policy)
    config = record.get("config")
    if not isinstance(config, dict):
        raise ValueError(f"the saved config of {record.get('class')!r} is not an object")
    if record.get("protocol") == "config_class" and _protocol(cls) == "config_class":
        module = cls(cls.config_class.from_dict(config))  # type: ignore[attr-defined]
    elif record.get("protocol") == "get_config" and _protocol(cls) == "get_config":
        from_config = getattr(cls, "from_config", None)
        module = from_config(config) if callable(from_config) else cls(**config)
    else:
        raise UnregisteredClassError(
            f"{cls.__qualname__} cannot be rebuilt from a config saved by "
            f"{record.get('protocol')!r}: it has no matching get_config()/config_class"
        )
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"rebuilding {cls.__qualname__} gave {type(module).__name__}, no module")
    module.train(bool(record.get("training", True)))
    return module
