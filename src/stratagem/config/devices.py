"""``sg.config`` devices: the physical devices, and splitting the CPU into logical devices.

As with TensorFlow's ``set_logical_device_configuration``, the CPU can be split into logical
devices so that ``MirroredStrategy()`` finds several replicas on one machine. A logical CPU
device is a replica thread computing on the shared CPU, so the configuration decides how many
devices ``list_logical_devices("CPU")`` reports and a bare ``MirroredStrategy()`` uses. As in
TF it is fixed once devices are initialized (``list_logical_devices``, or a strategy created
with explicit or default devices): changing it after that raises ``RuntimeError``. GPUs are
listed but not split (torch cannot partition one GPU's memory per replica, as TF's virtual GPUs
do): configuring a GPU raises instead of doing nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch


class PhysicalDevice(NamedTuple):
    """A device of the machine (``tf.config.PhysicalDevice``)."""

    name: str
    device_type: str


class LogicalDevice(NamedTuple):
    """A device a strategy can place a replica on (``tf.config.LogicalDevice``)."""

    name: str
    device_type: str


class LogicalDeviceConfiguration:
    """One logical device to create from a physical one (``tf.config.LogicalDeviceConfiguration``).

    ``memory_limit`` (MB), ``experimental_priority`` and ``experimental_device_ordinal`` apply
    to virtual GPUs, which stratagem does not make: on a CPU they raise, as TF raises for a CPU
    memory limit.
    """

    def __init__(
        self,
        memory_limit: int | None = None,
        experimental_priority: int | None = None,
        experimental_device_ordinal: int | None = None,
    ) -> None:
        self.memory_limit = memory_limit
        self.experimental_priority = experimental_priority
        self.experimental_device_ordinal = experimental_device_ordinal

    def _set_options(self) -> dict[str, Any]:
        return {name: value for name, value in vars(self).items() if value is not None}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LogicalDeviceConfiguration) and vars(self) == vars(other)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"LogicalDeviceConfiguration({args})"


_lock = threading.Lock()
_cpu_config: list[LogicalDeviceConfiguration] | None = None
_initialized = False


def _normalize_type(device_type: str | None) -> str | None:
    if device_type is None:
        return None
    if not isinstance(device_type, str):
        raise TypeError(f"device_type must be a string like 'CPU' or 'GPU'; got {device_type!r}")
    return device_type.upper()


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def list_physical_devices(device_type: str | None = None) -> list[PhysicalDevice]:
    """The machine's devices: one CPU, and every CUDA GPU (``device_type`` "CPU"/"GPU")."""
    kind = _normalize_type(device_type)
    devices = [PhysicalDevice("/physical_device:CPU:0", "CPU")]
    devices += [PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in range(_gpu_count())]
    return [d for d in devices if kind is None or d.device_type == kind]


def list_logical_devices(device_type: str | None = None) -> list[LogicalDevice]:
    """The devices strategies place replicas on: the CPU's logical devices (one unless
    configured), and one per GPU. Initializes the devices, as in TF."""
    global _initialized
    kind = _normalize_type(device_type)
    with _lock:
        _initialized = True
        cpus = 1 if _cpu_config is None else len(_cpu_config)
    devices = [LogicalDevice(f"/device:CPU:{i}", "CPU") for i in range(cpus)]
    devices += [LogicalDevice(f"/device:GPU:{i}", "GPU") for i in range(_gpu_count())]
    return [d for d in devices if kind is None or d.device_type == kind]


def set_logical_device_configuration(
    device: PhysicalDevice, logical_devices: Sequence[LogicalDeviceConfiguration] | None
) -> None:
    """Split ``device`` (the CPU, from ``list_physical_devices("CPU")``) into one logical device
    per configuration; ``None`` restores the default of one. Before devices are initialized."""
    global _cpu_config
    if not isinstance(device, PhysicalDevice):
        raise ValueError(
            f"device must be a PhysicalDevice from sg.config.list_physical_devices(); got "
            f"{device!r}"
        )
    if device not in list_physical_devices():
        raise ValueError(f"unrecognized device {device!r}; known: {list_physical_devices()}")
    configs = None if logical_devices is None else list(logical_devices)
    if configs is not None:
        wrong = [c for c in configs if not isinstance(c, LogicalDeviceConfiguration)]
        if wrong or not configs:
            raise ValueError(
                "logical_devices must be a non-empty list of "
                f"sg.config.LogicalDeviceConfiguration; got {logical_devices!r}"
            )
    if device.device_type == "GPU":
        raise ValueError(
            f"cannot configure {device.name}: stratagem does not split a GPU into virtual GPUs "
            "(TF partitions its memory; torch cannot per replica) nor limit its memory here; "
            "use torch.cuda.set_per_process_memory_fraction for a memory limit"
        )
    for config in configs or []:
        if config._set_options():
            raise ValueError(
                f"{config!r}: memory_limit and the experimental_* options apply to virtual "
                "GPUs; a logical CPU device takes none (TF raises for a CPU memory limit too)"
            )
    with _lock:
        if _initialized:
            current = 1 if _cpu_config is None else len(_cpu_config)
            wanted = 1 if configs is None else len(configs)
            if current != wanted:
                raise RuntimeError(
                    "Virtual devices cannot be modified after being initialized: devices were "
                    f"initialized with {current} logical CPU device(s) (by "
                    "list_logical_devices or by creating a strategy); call "
                    "set_logical_device_configuration at the start of the program"
                )
        _cpu_config = configs


def get_logical_device_configuration(
    device: PhysicalDevice,
) -> list[LogicalDeviceConfiguration] | None:
    """The configuration set for ``device``, or None if none was."""
    if not isinstance(device, PhysicalDevice):
        raise ValueError(f"device must be a PhysicalDevice; got {device!r}")
    if device.device_type != "CPU":
        return None
    with _lock:
        return None if _cpu_config is None else list(_cpu_config)


def initialize() -> None:
    """Fix the configuration: stratagem has decided on devices (a strategy was created)."""
    global _initialized
    with _lock:
        _initialized = True


def logical_cpu_count() -> int:
    """How many logical CPU devices there are (initializes the devices)."""
    return len(list_logical_devices("CPU"))
