"""Layouts to ``torch.distributed.tensor``: the one place where DTensor placements are chosen.

A ``Layout`` has one spec per tensor dimension; a DTensor has one placement per mesh
dimension. Mesh dimension ``m`` gets ``Shard(d)`` when tensor dimension ``d`` is split along it,
and ``Replicate()`` when no dimension is. Everything here is torch's own machinery:
``distribute_tensor`` cuts full tensors, ``DTensor.from_local`` assembles shards, and DTensor's
sharding propagation decides the collectives of every operation that follows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)

from stratagem.dtensor.errors import LayoutError
from stratagem.dtensor.layout import UNSHARDED, Layout
from stratagem.dtensor.mesh import Mesh

__all__ = [
    "DTensor",
    "LaidOutParameter",
    "batch_part_to_mesh",
    "copy_to_mesh",
    "fetch_layout",
    "layout_parameter",
    "pack",
    "placements",
    "relayout",
    "replica_part",
    "unpack",
]


def placements(layout: Layout) -> tuple[Placement, ...]:
    """One placement per mesh dimension: ``Shard(d)`` if tensor dim ``d`` is split along it."""
    specs = layout.sharding_specs
    out: list[Placement] = []
    for name in layout.mesh.dim_names:
        out.append(Shard(specs.index(name)) if name in specs else Replicate())
    return tuple(out)


def layout_of(placements_: Sequence[Placement], rank: int, mesh: Mesh, what: str) -> Layout:
    """The inverse of ``placements``: the layout of a DTensor with these placements."""
    specs = [UNSHARDED] * rank
    for name, p in zip(mesh.dim_names, placements_, strict=True):
        if isinstance(p, Shard):
            if specs[p.dim] != UNSHARDED:
                raise LayoutError(
                    f"{what} splits dimension {p.dim} along both {specs[p.dim]!r} and {name!r}; "
                    "a Layout splits each tensor dimension along at most one mesh dimension"
                )
            specs[p.dim] = name
        elif isinstance(p, Partial):
            raise LayoutError(
                f"{what} holds partial sums along mesh dimension {name!r} (placements "
                f"{tuple(placements_)}); reduce it first (.full_tensor() or relayout)"
            )
    return Layout(specs, mesh)


def _mesh_of(tensor: DTensor) -> Mesh:
    return Mesh(tensor.device_mesh)


# --- tensors ------------------------------------------------------------------------------


def copy_to_mesh(tensor: torch.Tensor, layout: Layout) -> DTensor:
    """A full tensor, the same on every process, laid out on the mesh (``dtensor.copy_to_mesh``).

    No communication: each process keeps the slice its mesh position owns.
    """
    _check_layout(layout, "copy_to_mesh")
    if isinstance(tensor, DTensor):
        raise LayoutError(
            f"copy_to_mesh got a DTensor already on a mesh ({fetch_layout(tensor)!r}); use "
            "sg.dtensor.relayout(tensor, layout) to change its layout"
        )
    tensor = torch.as_tensor(tensor)
    layout.check_shape(tensor.shape, "copy_to_mesh's tensor")
    device = _mesh_device(layout.mesh)
    return distribute_tensor(
        tensor.to(device), layout.mesh.device_mesh, placements(layout), src_data_rank=None
    )


def pack(tensors: Sequence[torch.Tensor] | torch.Tensor, layout: Layout) -> DTensor:
    """This process's shard(s) → one distributed tensor (``dtensor.pack``).

    ``tensors`` holds one shard per local device of the mesh, which is one here (a list of one
    tensor, or the tensor itself). Every process passes the shard its mesh position owns, all
    of the same shape; the global shape is that shape times the number of shards per dimension.
    """
    _check_layout(layout, "pack")
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    tensors = list(tensors)
    n = layout.mesh.num_local_devices()
    if len(tensors) != n:
        raise LayoutError(
            f"pack got {len(tensors)} tensors but the mesh has {n} local device per process; "
            "expected one shard per local device"
        )
    local = torch.as_tensor(tensors[0]).to(_mesh_device(layout.mesh))
    if local.dim() != layout.rank:
        raise LayoutError(
            f"{layout!r} has rank {layout.rank} but pack's shard of shape {list(local.shape)} "
            f"has rank {local.dim()}; expected one sharding spec per tensor dimension"
        )
    shape = [size * layout.num_shards(d) for d, size in enumerate(local.shape)]
    return DTensor.from_local(
        local.contiguous(),
        layout.mesh.device_mesh,
        placements(layout),
        run_check=False,
        shape=torch.Size(shape),
        stride=torch.empty(shape, device="meta").stride(),
    )


def unpack(tensor: DTensor) -> list[torch.Tensor]:
    """The shards this process holds, one per local device (``dtensor.unpack``)."""
    if not isinstance(tensor, DTensor):
        raise LayoutError(f"unpack expects a DTensor, got {type(tensor).__name__}")
    return [tensor.to_local()]


def relayout(tensor: DTensor, layout: Layout) -> DTensor:
    """The same values under another layout of the same mesh (``dtensor.relayout``)."""
    _check_layout(layout, "relayout")
    if not isinstance(tensor, DTensor):
        raise LayoutError(f"relayout expects a DTensor, got {type(tensor).__name__}")
    layout.check_shape(tensor.shape, "relayout's tensor")
    return tensor.redistribute(layout.mesh.device_mesh, placements(layout))


def batch_part_to_mesh(local: torch.Tensor, layout: Layout, rows: int) -> DTensor:
    """One replica's rows of a global batch of ``rows`` examples → the DTensor of the whole
    batch with ``layout`` (``Layout.batch_sharded``), without communication: each process
    holds its own part, cut as ``torch.chunk`` cuts (DTensor's ``Shard``)."""
    _check_layout(layout, "batch_part_to_mesh")
    shape = torch.Size([rows, *local.shape[1:]])
    return DTensor.from_local(
        local.contiguous(),
        layout.mesh.device_mesh,
        placements(layout),
        run_check=False,
        shape=shape,
        stride=torch.empty(shape, device="meta").stride(),
    )


def replica_part(tensor: DTensor, mesh: Mesh, batch_dim: str, rows: int | None) -> torch.Tensor:
    """What one replica (a coordinate along ``batch_dim``) holds of a value computed on a batch
    of ``rows`` examples split along ``batch_dim``: its rows of a tensor split along it (or of
    one as long as the batch, which DTensor may have chosen to replicate: a batch too small to
    split), its partial sum (or mean) of a reduction over the batch, else the whole value."""
    index = mesh.dim_names.index(batch_dim)
    along: Placement = tensor.placements[index]
    if isinstance(along, Partial) and along.reduce_op not in ("sum", "avg"):
        along = Replicate()  # a max or min: its value over the whole batch
    if isinstance(along, Shard) and along.dim != 0:
        along = Replicate()
    if isinstance(along, Replicate) and tensor.dim() > 0 and tensor.shape[0] == rows:
        along = Shard(0)  # per example: each replica takes its own rows
    target = tuple(along if i == index else Replicate() for i in range(len(mesh.dim_names)))
    if tuple(tensor.placements) != target:
        tensor = tensor.redistribute(mesh.device_mesh, target)
    return tensor.to_local()


def assigned_layout(tensor: torch.Tensor) -> Layout | None:
    """The layout a weight was laid out with (``layout_parameter``); None for other tensors."""
    return getattr(tensor, "_sg_layout", None)


def fetch_layout(tensor: torch.Tensor) -> Layout:
    """The layout of a DTensor (``dtensor.fetch_layout``); works on every DTensor."""
    laid_out = assigned_layout(tensor)
    if laid_out is not None:
        return laid_out
    if not isinstance(tensor, DTensor):
        raise LayoutError(
            f"fetch_layout expects a DTensor, got a {type(tensor).__name__} of shape "
            f"{list(tensor.shape)}; lay it out with copy_to_mesh or pack first"
        )
    return layout_of(tensor.placements, tensor.dim(), _mesh_of(tensor), "the tensor")


def _check_layout(layout: object, what: str) -> None:
    if not isinstance(layout, Layout):
        raise LayoutError(f"{what} needs a sg.dtensor.Layout, got {type(layout).__name__}")


def _mesh_device(mesh: Mesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


# --- parameters ---------------------------------------------------------------------------


class LaidOutParameter(DTensor):
    """A parameter laid out on a mesh: a ``DTensor`` (and ``nn.Parameter``) with ``.layout``.

    ``.layout`` is the ``sg.dtensor.Layout`` the parameter was created under, as in the seed
    (``weight.layout``). On these parameters it shadows ``torch.Tensor.layout`` (the memory
    layout, ``torch.strided``), which torch's kernels read from C++ and never through this
    attribute. Tensors computed from the parameter — ``detach()``, ``state_dict()`` values,
    gradients, optimizer state — are plain DTensors whose ``.layout`` is torch's; use
    ``sg.dtensor.fetch_layout`` for those.
    """

    @property
    def layout(self) -> Any:  # type: ignore[override]
        return self.__dict__["_sg_layout"]

    def __deepcopy__(self, memo: dict[int, Any]) -> LaidOutParameter:
        data: torch.Tensor = DTensor.detach(self).clone()
        if getattr(self, "_is_param", False):
            data = torch.nn.Parameter(data, self.requires_grad)
        copied = _as_laid_out(data, self.__dict__["_sg_layout"])
        memo[id(self)] = copied
        return copied

    def __reduce_ex__(self, protocol: int) -> Any:
        # Pickles as the plain DTensor parameter it is; the layout is not part of its value.
        return DTensor.detach(self).__reduce_ex__(protocol)

    # torch.compile rebuilds a traced input from DTensor's flattening (as a fake tensor), and
    # its compiled code checks that each input is of the type it traced: a LaidOutParameter
    # must come back as one, not as the DTensor it also is. Dynamo reads DTensor's flattening
    # context itself, so the layout cannot travel in it: a rebuilt one has none (a fake
    # tensor's layout is never read; the compiled code runs on the real parameters).
    @staticmethod
    def __tensor_unflatten__(
        inner_tensors: dict[str, Any], flatten_spec: Any, outer_size: Any, outer_stride: Any
    ) -> LaidOutParameter:
        rebuilt = DTensor.__tensor_unflatten__(
            inner_tensors, flatten_spec, outer_size, outer_stride
        )
        rebuilt.__class__ = LaidOutParameter
        rebuilt.__dict__["_sg_layout"] = None
        return rebuilt  # type: ignore[return-value]


def _as_laid_out(param: torch.Tensor, layout: Layout) -> LaidOutParameter:
    param.__class__ = LaidOutParameter
    param.__dict__["_sg_layout"] = layout
    if param.requires_grad:
        param.register_post_accumulate_grad_hook(_grad_like_parameter)
    return param  # type: ignore[return-value]


def _grad_like_parameter(param: torch.Tensor) -> None:
    # A weight replicated along `batch` gets partial sums from each batch shard; reduce them
    # once here, so the gradient (and the optimizer state built from it) is laid out like the
    # parameter, instead of every optimizer operation reducing it again.
    grad = param.grad
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements):
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def layout_parameter(
    tensor: torch.Tensor, layout: Layout, what: str, *, parameter: bool = True
) -> LaidOutParameter:
    """``tensor`` laid out per ``layout``: a new parameter, or a buffer when not ``parameter``.

    A full tensor is cut with process 0's values (as MultiWorkerMirroredStrategy broadcasts the
    chief's initial values), so processes seeded differently still agree. A DTensor already on
    the mesh is redistributed.
    """
    layout.check_shape(tensor.shape, what)
    requires_grad = tensor.requires_grad
    data = tensor.detach()
    if isinstance(data, DTensor):
        laid = data.redistribute(layout.mesh.device_mesh, placements(layout))
    else:
        laid = distribute_tensor(
            data.to(_mesh_device(layout.mesh)),
            layout.mesh.device_mesh,
            placements(layout),
            src_data_rank=0,
        )
    if not parameter:
        return _as_laid_out(laid, layout)
    return _as_laid_out(torch.nn.Parameter(laid, requires_grad=requires_grad), layout)
