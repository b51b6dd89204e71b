"""Asynchronous checkpoint writes (TF's ``CheckpointOptions(enable_async=True)``).

``CheckpointOptions`` carries TF's option names. ``BackgroundWrites`` runs one checkpoint's
writes in a background thread, one at a time: a new write first waits for the previous one, and
an error of a write is raised by the next ``start`` or ``wait`` (``Checkpoint.sync``), naming the
path. The values are copied before the write starts (``snapshot``), so training goes on changing
its tensors while the copy is written.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from stratagem.errors import CheckpointError


@dataclass(frozen=True)
class CheckpointOptions:
    """TF's ``tf.train.CheckpointOptions``. ``enable_async`` (or its older name
    ``experimental_enable_async_checkpoint``) writes in a background thread: ``save``/``write``
    return once the values are copied; ``checkpoint.sync()`` waits for the write.
    ``experimental_io_device`` is accepted for porting (the values are copied to host memory)."""

    experimental_io_device: str | None = None
    experimental_enable_async_checkpoint: bool = False
    enable_async: bool = False

    @property
    def asynchronous(self) -> bool:
        return bool(self.enable_async or self.experimental_enable_async_checkpoint)


def is_async(options: CheckpointOptions | None) -> bool:
    if options is not None and not isinstance(options, CheckpointOptions):
        raise TypeError(
            f"options must be an sg.train.CheckpointOptions, got {type(options).__name__}"
        )
    return options is not None and options.asynchronous


def snapshot(state: Any) -> Any:
    """``state`` with every tensor copied to host memory (the write reads the copies)."""
    return pytree.tree_map(
        lambda v: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v, state
    )


class BackgroundWrites:
    """One write at a time, in a background thread; its error surfaces at the next call."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._failure: tuple[str, BaseException] | None = None

    def start(self, path: str, write: Callable[[], None]) -> None:
        self.wait()

        def run() -> None:
            try:
                write()
            except BaseException as e:  # raised in the caller's thread by the next call
                self._failure = (path, e)

        self._thread = threading.Thread(target=run, name="stratagem-checkpoint", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        """Wait for the write under way; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._failure is not None:
            path, error = self._failure
            self._failure = None
            raise CheckpointError(
                f"the asynchronous save of {path!r} failed: {type(error).__name__}: {error}"
            ) from error
