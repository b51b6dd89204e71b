"""Device names as users write them (TF or torch spelling) → torch devices.

TF names logical CPU devices ``/cpu:0``, ``/cpu:1``...; torch has one ``cpu``. A logical CPU
device here is a replica computing on the shared CPU (its own thread), so ``cpu:1`` maps to
``torch.device("cpu")`` while keeping its own name for messages and for telling replicas apart.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from stratagem.config import devices as config_devices
from stratagem.errors import DeviceError

_PATTERN = re.compile(
    r"^(?:/job:[^/]+)?(?:/replica:\d+)?(?:/task:\d+)?/?(?:device:)?"
    r"(?P<kind>cpu|gpu|cuda)(?::(?P<index>\d+))?$",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class ReplicaDevice:
    """A replica's device: the name the user gave and the torch device it computes on."""

    name: str
    torch_device: torch.device

    def __str__(self) -> str:
        return self.name


def parse_device(spec: str | torch.device | ReplicaDevice) -> ReplicaDevice:
    """Parse ``"cpu:1"``, ``"/gpu:0"``, ``"cuda:0"``, TF's long form, a torch.device, or an
    ``sg.config`` device (as TF takes ``tf.config.LogicalDevice``s)."""
    if isinstance(spec, ReplicaDevice):
        return spec
    if isinstance(spec, config_devices.LogicalDevice | config_devices.PhysicalDevice):
        spec = spec.name.replace("/physical_device:", "/device:")
    if isinstance(spec, torch.device):
        spec = str(spec)
    if not isinstance(spec, str):
        raise DeviceError(f"a device must be a string like 'cpu:0' or 'gpu:1', got {spec!r}")
    m = _PATTERN.match(spec.strip())
    if m is None:
        raise DeviceError(
            f"unknown device {spec!r}; expected 'cpu:N' (logical CPU devices), 'gpu:N' or "
            "'cuda:N', optionally in TF's '/job:.../device:GPU:N' form"
        )
    kind = m.group("kind").lower()
    index = int(m.group("index") or 0)
    if kind == "cpu":
        return ReplicaDevice(f"cpu:{index}", torch.device("cpu"))
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index >= count:
        have = f"cuda:0..cuda:{count - 1}" if count else "no CUDA device"
        raise DeviceError(f"device {spec!r} does not exist: this process has {have}")
    return ReplicaDevice(f"cuda:{index}", torch.device("cuda", index))


def parse_devices(
    specs: list[str | torch.device] | tuple[str | torch.device, ...],
) -> list[ReplicaDevice]:
    """Parse a list of distinct devices (a duplicate would be one replica counted twice).

    A strategy's devices are decided now: the logical device configuration is fixed from here
    on (TF's "devices initialized")."""
    config_devices.initialize()
    if isinstance(specs, (str, torch.device)):
        raise DeviceError(f"devices must be a list of devices, got the single device {specs!r}")
    devices = [parse_device(s) for s in specs]
    if not devices:
        raise DeviceError("devices is empty; give at least one device, e.g. ['cpu:0']")
    names = [d.name for d in devices]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise DeviceError(f"devices {list(specs)!r} name {', '.join(dupes)} more than once")
    return devices


def default_devices() -> list[ReplicaDevice]:
    """Every CUDA device, or else every logical CPU device (TF's MirroredStrategy default:
    ``list_logical_devices("GPU") or list_logical_devices("CPU")``; one CPU device unless
    ``sg.config.set_logical_device_configuration`` split it)."""
    gpus = config_devices.list_logical_devices("GPU")
    if gpus:
        return [parse_device(f"cuda:{i}") for i in range(len(gpus))]
    return [parse_device(f"cpu:{i}") for i in range(config_devices.logical_cpu_count())]
