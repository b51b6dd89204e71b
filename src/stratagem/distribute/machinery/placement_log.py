"""The device placement log (TF's ``tf.debugging.set_log_device_placement``).

When on, every operation is logged with the device it ran on, once per distinct (operation,
device), to the ``stratagem.device_placement`` logger (stderr when logging is not set up):
``Executing op aten::addmm in device /job:localhost/replica:0/task:0/device:CPU:1``. Module
calls come from a global forward hook, in every thread (the device: the module's ``sg.device``,
else its first parameter's); ATen operations, forward and backward, from a
``TorchDispatchMode``, in the thread that turned the log on and the threads stratagem starts
(parallel branches enter ``thread_logging()``). Off, nothing is installed: no hook, no mode.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode

from stratagem.distribute.machinery import device_scope
from stratagem.distribute.machinery.replica_devices import ReplicaDevice

logger = logging.getLogger("stratagem.device_placement")

_lock = threading.Lock()
_enabled = False
_seen: set[tuple[str, str]] = set()
_hooks: list[Any] = []
_calls = threading.local()  # per thread: the (module, its device) of the calls in progress
_mode: PlacementMode | None = None


def tf_name(device: str) -> str:
    """``cpu:1`` → TF's full name ``/job:localhost/replica:0/task:0/device:CPU:1``."""
    kind, _, index = device.partition(":")
    kind = {"cuda": "GPU", "cpu": "CPU"}.get(kind, kind.upper())
    return f"/job:localhost/replica:0/task:0/device:{kind}:{index or 0}"


def _device_name(device: torch.device) -> str:
    calls = getattr(_calls, "stack", None)
    named = calls[-1][1] if calls else device_scope.current_device()
    if named is not None and named.torch_device == device:
        return named.name  # a logical CPU device: the CPU, by the name the scope gave it
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return f"{device.type}:{device.index or 0}"


def _record(kind: str, name: str, device: str) -> None:
    key = (f"{kind} {name}", device)
    if key in _seen:  # read without the lock: a set lookup is atomic, and a miss re-checks
        return
    with _lock:
        if key in _seen:
            return
        _seen.add(key)
    logger.info("Executing %s %s in device %s", kind, name, tf_name(device))


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    if isinstance(value, dict):
        return _first_tensor(list(value.values()))
    return None


class PlacementMode(TorchDispatchMode):
    """Logs each ATen operation (what a kernel runs: ``aten::addmm``) with its result's device.

    A dispatch mode, not a function mode: ``with torch.device(...)`` (and so ``sg.device``) is
    a function mode, and torch's function modes leave by popping the top of their stack, so a
    function mode pushed inside one would be popped in its place when it exits.
    """

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        tensor = _first_tensor(result)
        if tensor is not None and _enabled:
            _record("op", func.name(), _device_name(tensor.device))
        return result


def _module_device(module: torch.nn.Module) -> ReplicaDevice | None:
    """The ``sg.device`` a module was created under: its own tag, or its first tagged part's
    (a ``Sequential`` has no parameters of its own)."""
    for part in module.modules():
        named = device_scope.module_device(part)
        if named is not None:
            return named
    return None


def _before_forward(module: torch.nn.Module, args: Any) -> None:
    stack = getattr(_calls, "stack", None)
    if stack is None:
        stack = _calls.stack = []
    named = _module_device(module)
    if named is None and stack:
        named = stack[-1][1]  # a part without a tag (ReLU) runs where its parent does
    if named is None:
        named = device_scope.current_device()  # a branch's thread: its device
    stack.append((module, named))


def _after_forward(module: torch.nn.Module, args: Any, output: Any) -> None:
    stack = getattr(_calls, "stack", [])
    named = None
    # Pop to this call's entry: a call that raised never reached its own forward hook.
    while stack:
        entry, named = stack.pop()
        if entry is module:
            break
    if named is not None:
        device = named.name
    else:
        tensor = next(iter(module.parameters(recurse=False)), None)
        if tensor is None:
            tensor = _first_tensor(output)
        if tensor is None:
            return
        device = _device_name(tensor.device)
    _record("module", type(module).__name__, device)


def set_log_device_placement(enabled: bool) -> None:
    """Turn the placement log on or off (off by default)."""
    global _enabled, _mode
    if not isinstance(enabled, bool):
        raise TypeError(f"set_log_device_placement takes True or False; got {enabled!r}")
    with _lock:
        if enabled == _enabled:
            return
        _enabled = enabled
        if enabled:
            if not logger.hasHandlers():  # TF prints its log whatever logging is set up
                logger.addHandler(logging.StreamHandler())
            if logger.getEffectiveLevel() > logging.INFO:
                logger.setLevel(logging.INFO)
            _seen.clear()
            _hooks.append(register_module_forward_pre_hook(_before_forward))
            _hooks.append(register_module_forward_hook(_after_forward))
            _mode = PlacementMode()
            _mode.__enter__()
        else:
            assert _mode is not None
            while _hooks:
                _hooks.pop().remove()
            mode, _mode = _mode, None
            with contextlib.suppress(Exception):  # turned off in another thread than on
                mode.__exit__(None, None, None)


def get_log_device_placement() -> bool:
    return _enabled


@contextlib.contextmanager
def thread_logging() -> Iterator[None]:
    """For threads stratagem starts: log their operations too while the log is on."""
    if not _enabled:
        yield
        return
    with PlacementMode():
        yield
