"""Copying elements to a device ahead of the step, for ``prefetch_to_device``.

On CUDA the background thread pins each tensor (page-locked host memory, which a copy can read
without the CPU) and copies it with ``non_blocking=True`` on a side stream of its own, so the
copy overlaps the step's kernels on the default stream; it records an event after the copy.
The consumer's stream waits for that event before using the tensors (a GPU-side wait, not a
host one), and ``record_stream`` tells the caching allocator that the consumer's stream uses
memory allocated on the side stream, so it is not reused too early.

On a CPU device (``"/cpu:0"``, a logical ``"cpu:1"``) there is nothing to copy: elements are
already in host memory, and the prefetch alone overlaps making them with the step.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import torch

from stratagem.data import _structure
from stratagem.errors import InputError

_NAME = re.compile(
    r"^(?:/job:[^/]+)?(?:/replica:\d+)?(?:/task:\d+)?/?(?:device:)?"
    r"(?P<kind>cpu|gpu|cuda)(?::(?P<index>\d+))?$",
    re.IGNORECASE,
)


def torch_device(spec: str | torch.device) -> torch.device:
    """The torch device of a TF or torch device name: "/gpu:1", "/device:GPU:1" and "cuda:1"
    are ``cuda:1``; "/cpu:0" and logical CPU devices ("cpu:1") are the CPU."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    if not isinstance(spec, str):
        raise InputError(f"prefetch_to_device needs a device name like '/gpu:0'; got {spec!r}")
    match = _NAME.match(spec.strip())
    if match is None:
        raise InputError(
            f"prefetch_to_device: unknown device {spec!r}; expected '/cpu:N', '/gpu:N' or "
            "'cuda:N' (TF's '/job:.../device:GPU:N' form too)"
        )
    if match.group("kind").lower() == "cpu":
        return torch.device("cpu")
    index = int(match.group("index") or 0)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index >= count:
        have = f"cuda:0..cuda:{count - 1}" if count else "no CUDA device"
        raise InputError(
            f"prefetch_to_device: device {spec!r} does not exist; this process has {have}"
        )
    return torch.device("cuda", index)


class InFlight(NamedTuple):
    """An element whose copy was queued on a side stream, and the event after it."""

    element: Any
    event: torch.cuda.Event


class CudaCopier:
    """``send`` (background thread) and ``receive`` (consumer) for one pass to a CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def send(self, element: Any) -> InFlight:
        with torch.cuda.stream(self.stream):
            moved = _structure.map_leaves(self._copy, element)
            event = torch.cuda.Event()
            event.record(self.stream)
        return InFlight(moved, event)

    def _copy(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        source = value if value.is_cuda else value.pin_memory()
        return source.to(self.device, non_blocking=True)

    def receive(self, in_flight: InFlight) -> Any:
        current = torch.cuda.current_stream(self.device)
        current.wait_event(in_flight.event)

        def mark(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.is_cuda:
                value.record_stream(current)
            return value

        return _structure.map_leaves(mark, in_flight.element)


def cpu_copy(element: Any) -> Any:
    """Elements to the CPU (those already there, every one from an in-memory dataset, as is)."""
    return _structure.map_leaves(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v, element)
