"""Keras 3's ``list_devices``, ``DeviceMesh`` and ``TensorLayout``, over ``sg.dtensor``.

As on Keras 3's PyTorch backend, a device is a process: ``list_devices()`` names one device per
process of the job (``"cpu:0"``, ``"gpu:1"``, ...). ``DeviceMesh`` and ``TensorLayout`` are
plain data, checked as Keras checks them; ``mesh.backend_mesh`` and ``layout.backend_layout``
build the ``sg.dtensor.Mesh`` and ``sg.dtensor.Layout`` they stand for on first use, which is
where the mesh must have as many devices as the job has processes, in rank order (row-major).
``None`` in a layout's axes is ``sg.dtensor.UNSHARDED``; axes apply to torch's shapes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from stratagem import dtensor
from stratagem.distribute.cluster_resolver import resolve_cluster

_DEVICE = re.compile(r"^(?P<type>[a-z]+):(?P<index>\d+)$")


def num_processes() -> int:
    """How many processes the job has (the process group's, else the cluster's)."""
    if dist.is_initialized():
        return dist.get_world_size()
    return resolve_cluster().world_size


def process_id() -> int:
    """This process's rank in the job (0 alone)."""
    if dist.is_initialized():
        return dist.get_rank()
    return resolve_cluster().rank or 0


def list_devices(device_type: str | None = None) -> list[str]:
    """``keras.distribution.list_devices``: the job's devices, one per process, as
    ``"cpu:0"``/``"gpu:0"``; the default type is ``"gpu"`` where CUDA is, else ``"cpu"``."""
    kind = (device_type or ("gpu" if torch.cuda.is_available() else "cpu")).lower()
    if kind == "cuda":
        kind = "gpu"
    if kind not in ("cpu", "gpu"):
        raise ValueError(
            f"list_devices: device_type={device_type!r}; expected 'cpu', 'gpu' or None"
        )
    if kind == "gpu" and not torch.cuda.is_available():
        return []
    return [f"{kind}:{i}" for i in range(num_processes())]


def get_device_count(device_type: str | None = None) -> int:
    """``keras.distribution.get_device_count``: ``len(list_devices(device_type))``."""
    return len(list_devices(device_type))


class DeviceMesh:
    """``DeviceMesh(shape, axis_names, devices=None)``: Keras 3's mesh, devices as a numpy
    array of ``shape`` (``list_devices()`` when not given)."""

    def __init__(
        self, shape: Sequence[int], axis_names: Sequence[str], devices: Any = None
    ) -> None:
        if not shape or not axis_names:
            raise ValueError(
                "Shape and axis_names cannot be empty. Received: "
                f"shape={shape}, axis_names={axis_names}"
            )
        if len(shape) != len(axis_names):
            raise ValueError(
                "Shape and axis_names should have same size. "
                f"Received: shape={shape}, axis_names={axis_names}"
            )
        if devices is None:
            devices = list_devices()
        devices = np.array(devices)
        if math.prod(shape) != math.prod(devices.shape):
            raise ValueError(
                "Shape does not match the number of devices. "
                f"Received: shape={shape}; devices.shape={devices.shape}"
            )
        self._shape = shape
        self._axis_names = axis_names
        self._devices = np.reshape(devices, shape)
        self._backend_mesh: dtensor.Mesh | None = None

    @property
    def shape(self) -> Sequence[int]:
        return self._shape

    @property
    def axis_names(self) -> Sequence[str]:
        return self._axis_names

    @property
    def devices(self) -> np.ndarray:
        return self._devices

    @property
    def backend_mesh(self) -> dtensor.Mesh:
        """The ``sg.dtensor.Mesh`` over the job's processes (made, and checked, on first use)."""
        if self._backend_mesh is None:
            devices = [str(d) for d in self._devices.flatten()]
            indices = [_device_index(d) for d in devices]
            if indices != list(range(len(devices))):
                raise dtensor.MeshError(
                    f"{self!r}: devices {devices} are not in rank order; each mesh position is "
                    "the process of that row-major rank, so expected devices 0, 1, ... in order "
                    "(as list_devices() gives them)"
                )
            self._backend_mesh = dtensor.create_mesh(
                [(str(n), int(s)) for n, s in zip(self._axis_names, self._shape, strict=True)],
                devices=devices,
            )
        return self._backend_mesh

    def __repr__(self) -> str:
        return f"<DeviceMesh shape={self.shape}, axis_names={self.axis_names}>"

    __str__ = __repr__


def _device_index(device: str) -> int:
    found = _DEVICE.match(device.lower())
    if found is None:
        raise dtensor.MeshError(
            f"DeviceMesh device {device!r} is not understood; expected 'cpu:0' or 'gpu:1'"
        )
    return int(found.group("index"))


class TensorLayout:
    """``TensorLayout(axes, device_mesh=None)``: per tensor dimension a mesh axis name, or
    ``None`` (not split). The mesh may be set once, later (a ``LayoutMap`` sets it)."""

    def __init__(self, axes: Sequence[str | None], device_mesh: DeviceMesh | None = None) -> None:
        self._axes = tuple(axes)
        self._device_mesh = device_mesh
        self._validate_axes()

    @property
    def axes(self) -> tuple[str | None, ...]:
        return self._axes

    @property
    def device_mesh(self) -> DeviceMesh | None:
        return self._device_mesh

    @device_mesh.setter
    def device_mesh(self, device_mesh: DeviceMesh) -> None:
        if self._device_mesh is not None:
            raise ValueError(
                f"Cannot override device mesh value. Existing value is {self._device_mesh}"
            )
        self._device_mesh = device_mesh
        self._validate_axes()

    @property
    def backend_layout(self) -> dtensor.Layout:
        """The ``sg.dtensor.Layout`` it stands for, on ``device_mesh.backend_mesh``."""
        if self._device_mesh is None:
            raise dtensor.LayoutError(
                f"{self!r} has no device mesh; expected a TensorLayout(axes, device_mesh) or "
                "one placed in a LayoutMap"
            )
        specs = []
        for axis in self._axes:
            if axis is not None and not isinstance(axis, str):
                raise dtensor.LayoutError(
                    f"{self!r}: axis {axis!r} splits one dimension over several mesh axes, "
                    "which sg.dtensor layouts cannot say; expected one axis name or None per "
                    "dimension"
                )
            specs.append(dtensor.UNSHARDED if axis is None else axis)
        return dtensor.Layout(specs, self._device_mesh.backend_mesh)

    def _validate_axes(self) -> None:
        if self._device_mesh:
            valid_axis_names = set(self._device_mesh.axis_names)
            axis_names = set(self._axes) - {None}
            if axis_names - valid_axis_names:
                raise ValueError(
                    "Invalid axis names for Layout. Valid axis "
                    f"names: {valid_axis_names}, Got {axis_names}"
                )

    def __repr__(self) -> str:
        return f"<TensorLayout axes={self.axes}, device_mesh={self.device_mesh}>"

    __str__ = __repr__
