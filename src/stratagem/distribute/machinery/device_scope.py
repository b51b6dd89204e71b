"""``sg.device(name)``: TF's ``tf.device``, a scope that places what is created inside it.

Outside a strategy scope, ``with sg.device("cuda:1"):`` enters torch's own device context, so
modules and tensors created inside live on that device. Names are TF's or torch's: ``"/gpu:1"``,
``"/device:GPU:1"``, ``"cuda:1"``, ``"/cpu:0"``, a logical ``"cpu:1"`` (whose tensors are CPU
tensors: the scope adds the name, which tags the modules registered inside for the placement
log and parallel branches). Scopes nest (the innermost wins) and are per thread, as TF's are.
Inside ``strategy.scope()`` the strategy's placement wins: ``sg.device`` changes nothing, and
naming a device the strategy does not compute on is an error, in either order of nesting,
rather than a placement silently ignored.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)

from stratagem.distribute.machinery import context
from stratagem.distribute.machinery.context import StrategyLike
from stratagem.distribute.machinery.replica_devices import ReplicaDevice, parse_device
from stratagem.errors import DeviceError

_local = threading.local()
_lock = threading.Lock()
_open_scopes = 0  # across threads: the registration hooks are installed only while any is open
_hooks: list[Any] = []
_module_devices: weakref.WeakKeyDictionary[torch.nn.Module, ReplicaDevice] = (
    weakref.WeakKeyDictionary()
)


def _stack() -> list[ReplicaDevice]:
    stack = getattr(_local, "devices", None)
    if stack is None:
        stack = _local.devices = []
    return stack


def current_device() -> ReplicaDevice | None:
    """The innermost ``sg.device`` of this thread, or None."""
    stack = _stack()
    return stack[-1] if stack else None


def module_device(module: torch.nn.Module) -> ReplicaDevice | None:
    """The ``sg.device`` a module's parameters or buffers were registered under, if any."""
    return _module_devices.get(module)


def _active_strategy() -> StrategyLike | None:
    strategy = context.scope_strategy()
    return None if strategy is None or not context.has_strategy() else strategy


def check_strategy(strategy: StrategyLike) -> None:
    """Raise if ``strategy``'s scope opens inside an ``sg.device`` it does not compute on.

    The default strategy places nothing (TF does not count it as a strategy): its scope keeps
    the device scope's placement."""
    target = current_device()
    if target is not None and strategy is not context.default_strategy():
        _check_conflict(strategy, target, "outside")


def _check_conflict(strategy: StrategyLike, target: ReplicaDevice, where: str) -> None:
    devices = strategy.extended.worker_devices
    if target.name not in devices:
        raise DeviceError(
            f"sg.device({target.name!r}) {where} the scope of {type(strategy).__name__}, whose "
            f"devices are {list(devices)}: the strategy places what is created in its scope on "
            f"its own devices, so {target.name!r} would be ignored. Name one of its devices, or "
            "create the module outside the strategy's scope"
        )


@contextlib.contextmanager
def device(device_name: str | torch.device | ReplicaDevice) -> Iterator[None]:
    """Place modules and tensors created inside on ``device_name`` (TF's ``tf.device``)."""
    target = parse_device(device_name)
    strategy = _active_strategy()
    if strategy is not None:
        _check_conflict(strategy, target, "inside")
    stack = _stack()
    stack.append(target)
    _open()
    try:
        if strategy is not None:
            yield  # the strategy's placement wins
        else:
            with target.torch_device:
                yield
    finally:
        _close()
        stack.pop()


@contextlib.contextmanager
def naming(target: ReplicaDevice) -> Iterator[None]:
    """For threads stratagem runs on a device (parallel branches): the thread's current device
    is ``target`` (the placement log names it), with no placement and no checks."""
    stack = _stack()
    stack.append(target)
    try:
        yield
    finally:
        stack.pop()


def _open() -> None:
    global _open_scopes
    with _lock:
        _open_scopes += 1
        if _open_scopes == 1:
            _hooks.append(register_module_parameter_registration_hook(_tag))
            _hooks.append(register_module_buffer_registration_hook(_tag))


def _close() -> None:
    global _open_scopes
    with _lock:
        _open_scopes -= 1
        if _open_scopes == 0:
            while _hooks:
                _hooks.pop().remove()


def _tag(module: torch.nn.Module, name: str, tensor: Any) -> None:
    target = current_device()
    if target is not None and _active_strategy() is None:
        _module_devices[module] = target
