"""Which functions a worker may be asked to call: what the chief schedules, and the dataset
functions it sends, are the program's own functions or the library functions stratagem marks
here (Keras's ``fit`` schedules ``coordinated.train_steps``).

A capture table names library functions by ``module.qualname`` and rebuilds nested ones from a
module's own code with globals the table gives: fine for what a function *captures*, which only
the program's code calls. But the function a worker is told to call is called with arguments
from the wire, so a table naming ``builtins.exec`` (or ``subprocess.getoutput``'s code) would run
what a peer sent. The worker therefore calls only a function of the program's files, or one
registered here by stratagem (``entry_point``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_REGISTERED: set[tuple[str, str]] = set()


def entry_point(fn: F) -> F:
    """Mark a library function (by its module and qualname) as one a worker may be asked to
    call: stratagem's own scheduled steps. At module level only: a worker learns it when it
    imports the module (a nested function's decorator would run only where its outer one does,
    which is the chief: name those with ``nested_entry_points``)."""
    _REGISTERED.add((fn.__module__, fn.__qualname__))
    return fn


def nested_entry_points(module: str, *qualnames: str) -> None:
    """Mark nested functions of ``module`` (``"outer.<locals>.inner"``) as entry points."""
    _REGISTERED.update((module, q) for q in qualnames)


def is_entry_point(module: str, qualname: str) -> bool:
    return (module, qualname) in _REGISTERED
