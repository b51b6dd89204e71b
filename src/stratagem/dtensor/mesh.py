"""``Mesh`` and ``create_mesh``: devices arranged in a grid with named dimensions.

TensorFlow's DTensor lays a mesh over the devices of one or many clients; here every device is
one process (``stratagem run -n N``, TF_CONFIG by hand, torchrun, SLURM), and the mesh is a
``torch.distributed.device_mesh.DeviceMesh`` with the same dimension names. ``create_mesh``
starts the process group itself, through the same resolvers and rendezvous that
``MultiWorkerMirroredStrategy`` uses, when none is running yet. A process that runs alone gets a
one-process group, so a mesh of size 1 works without any cluster (the single-process null
version of every distributed piece below).
"""

from __future__ import annotations

import atexit
import math
import re
from collections.abc import Sequence

import torch
import torch.distributed as dist

from stratagem.comm.gloo_drain import wait_for_gloo_threads
from stratagem.dtensor.errors import MeshError

_DEVICE = re.compile(r"^(?:/job:\w+/replica:\d+/task:\d+/device:)?(?P<type>[A-Za-z]+):(?P<i>\d+)$")
_TF_TYPES = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda"}


class Mesh:
    """A grid of devices with named dimensions (``dtensor.Mesh``), one device per process.

    ``dim_names`` and ``shape`` say how the processes are arranged: process ``rank`` sits at the
    row-major coordinate of ``rank`` in ``shape``. Build one with ``create_mesh``; the torch
    ``DeviceMesh`` underneath is ``mesh.device_mesh``.
    """

    def __init__(self, device_mesh: object, devices: Sequence[str] | None = None) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        if not isinstance(device_mesh, DeviceMesh) or device_mesh.mesh_dim_names is None:
            raise MeshError(
                f"Mesh needs a torch DeviceMesh with named dimensions, got {device_mesh!r}; "
                "use sg.dtensor.create_mesh([('batch', n)])"
            )
        self.device_mesh = device_mesh
        self.dim_names: tuple[str, ...] = tuple(device_mesh.mesh_dim_names)
        self.shape: tuple[int, ...] = tuple(device_mesh.mesh.shape)
        self.device_type: str = device_mesh.device_type
        self.devices: tuple[str, ...] = tuple(
            devices or [f"{self.device_type}:{i}" for i in range(self.size)]
        )

    @property
    def size(self) -> int:
        """How many devices (processes) the mesh holds."""
        return math.prod(self.shape)

    def dim_size(self, dim_name: str) -> int:
        """How many devices lie along ``dim_name``."""
        return self.shape[self._index(dim_name)]

    def coordinate(self, dim_name: str) -> int:
        """This process's index along ``dim_name`` (which shard of a tensor split along it)."""
        return int(self.device_mesh.get_local_rank(self._index(dim_name)))

    def num_local_devices(self) -> int:
        """Devices of the mesh in this process: always 1 (one process per device)."""
        return 1

    def local_devices(self) -> list[str]:
        return [self.devices[dist.get_rank()] if dist.is_initialized() else self.devices[0]]

    def contains_dim(self, dim_name: str) -> bool:
        return dim_name in self.dim_names

    def _index(self, dim_name: str) -> int:
        if dim_name not in self.dim_names:
            raise MeshError(
                f"mesh {self} has no dimension {dim_name!r}; its dimensions are "
                f"{list(self.dim_names)}"
            )
        return self.dim_names.index(dim_name)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mesh):
            return NotImplemented
        return (
            self.dim_names == other.dim_names
            and self.shape == other.shape
            and self.device_type == other.device_type
        )

    def __hash__(self) -> int:
        return hash((self.dim_names, self.shape, self.device_type))

    def __repr__(self) -> str:
        dims = "|".join(f"{n}={s}" for n, s in zip(self.dim_names, self.shape, strict=True))
        return f"Mesh(|{dims}|, device_type={self.device_type!r})"


def create_mesh(
    mesh_dims: Sequence[tuple[str, int]],
    mesh_name: str = "",
    devices: Sequence[str] | None = None,
    device_type: str | None = None,
) -> Mesh:
    """``dtensor.create_mesh([("batch", 4), ("model", 2)])``: a mesh over this job's processes.

    The product of the dimension sizes must equal the number of processes. ``devices`` (TF's
    ``["CPU:0", ...]`` or torch's ``["cpu:0", ...]``) may name the devices; there must be one
    per mesh position, and they must all be of one type, which becomes the mesh's device type.
    Each process computes on its own device of that type (CUDA device ``LOCAL_RANK`` on GPUs).
    ``mesh_name`` is accepted for TensorFlow compatibility and unused.
    """
    del mesh_name
    names, shape = _check_dims(mesh_dims)
    size = math.prod(shape)
    call = f"create_mesh({[(n, s) for n, s in zip(names, shape, strict=True)]})"
    if devices is not None:
        devices = list(devices)
        types = {_device_type(d, call) for d in devices}
        if len(devices) != size:
            raise MeshError(
                f"{call}: {len(devices)} devices given ({devices}) but the mesh has {size} "
                "positions; expected one device per position"
            )
        if len(types) > 1:
            raise MeshError(f"{call}: devices of several types {sorted(types)}; expected one")
        if device_type is None:
            device_type = types.pop()
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    world = _ensure_process_group(device_type)
    if size != world:
        raise MeshError(
            f"{call}: the mesh has {size} devices but this job has {world} "
            f"process{'es' if world != 1 else ''} (one device per process); expected mesh "
            f"dimensions whose sizes multiply to {world}"
        )
    from stratagem.comm.process_group import new_device_mesh

    device_mesh = new_device_mesh(device_type, shape, names)
    return Mesh(device_mesh, devices)


def _check_dims(mesh_dims: Sequence[tuple[str, int]]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    expected = "expected a list of (name, size) pairs such as [('batch', 4), ('model', 2)]"
    if isinstance(mesh_dims, (str, bytes)) or not isinstance(mesh_dims, Sequence) or not mesh_dims:
        raise MeshError(f"create_mesh: mesh_dims={mesh_dims!r}; {expected}")
    names: list[str] = []
    sizes: list[int] = []
    for dim in mesh_dims:
        if (
            not isinstance(dim, (tuple, list))
            or len(dim) != 2
            or not isinstance(dim[0], str)
            or not dim[0]
            or isinstance(dim[1], bool)
            or not isinstance(dim[1], int)
            or dim[1] < 1
        ):
            raise MeshError(
                f"create_mesh: bad mesh dimension {dim!r} in {list(mesh_dims)}; {expected} "
                "with non-empty names and positive sizes"
            )
        if dim[0] in names:
            raise MeshError(f"create_mesh: dimension name {dim[0]!r} appears twice in {mesh_dims}")
        if dim[0] == "unsharded":
            raise MeshError("create_mesh: 'unsharded' is reserved (it is dtensor.UNSHARDED)")
        names.append(dim[0])
        sizes.append(dim[1])
    return tuple(names), tuple(sizes)


def _device_type(device: str, call: str) -> str:
    m = _DEVICE.match(str(device).strip())
    kind = _TF_TYPES.get(m.group("type").lower()) if m else None
    if kind is None:
        raise MeshError(
            f"{call}: device {device!r} is not understood; expected 'CPU:0', 'GPU:1', 'cpu:0' or "
            "'cuda:1'"
        )
    if kind == "cuda" and not torch.cuda.is_available():
        raise MeshError(f"{call}: device {device!r} needs CUDA, which this machine lacks")
    return kind


def _ensure_process_group(device_type: str) -> int:
    """Start the default process group unless one runs; return the number of processes."""
    if dist.is_initialized():
        return dist.get_world_size()
    from stratagem.cluster import resolve_cluster
    from stratagem.comm.process_group import connect, default_backend, use_local_gpu

    resolver = resolve_cluster()
    if resolver.rank is None:
        raise MeshError(
            f"{resolver.describe()} cannot join a mesh: only the chief and the workers of a "
            "cluster take part in collectives"
        )
    if device_type == "cuda":
        use_local_gpu(resolver)
    connect(resolver, backend=default_backend(device_type))
    if not dist.is_initialized():
        # Alone, without a cluster: a one-process group, so that DTensor still runs.
        dist.init_process_group(
            default_backend(device_type), store=dist.HashStore(), rank=0, world_size=1
        )
        atexit.register(_destroy_local_group)
    return dist.get_world_size()


def _destroy_local_group() -> None:
    wait_for_gloo_threads()  # see comm.gloo_drain
    if dist.is_initialized() and dist.get_world_size() == 1:
        dist.destroy_process_group()
