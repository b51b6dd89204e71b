"""``Layout``: how each dimension of a tensor is split over the dimensions of a ``Mesh``.

A layout is plain data, as in TensorFlow's DTensor: one sharding spec per *tensor* dimension,
each a mesh dimension name (split that tensor dimension evenly along it) or ``UNSHARDED``; a mesh
dimension no spec names holds full copies (the tensor is replicated along it). The translation
into torch's placements (one per *mesh* dimension) is ``translate.placements``.

Specs apply to tensors as torch lays them out. A ``torch.nn.Linear`` weight is ``(out, in)``
where a Keras ``Dense`` kernel is ``(in, out)``, so a seed layout on a kernel ports to the
weight with its specs reversed: the seed's ``Layout.batch_sharded(mesh, 'batch', rank=2)`` on
``kernel`` (split ``in``) is ``Layout.inner_sharded(mesh, 'batch', rank=2)`` on ``weight``.
Column-wise tensor parallelism (split the outputs) is ``Layout(['model', UNSHARDED])`` on the
weight and ``Layout(['model'])`` on the bias; row-wise (split the inputs) is
``Layout([UNSHARDED, 'model'])`` with a replicated bias.
"""

from __future__ import annotations

from collections.abc import Sequence

from stratagem.dtensor.errors import LayoutError
from stratagem.dtensor.mesh import Mesh

UNSHARDED = "unsharded"


class Layout:
    """``Layout(sharding_specs, mesh)``: e.g. ``Layout(['batch', UNSHARDED], mesh)``."""

    def __init__(self, sharding_specs: Sequence[str], mesh: Mesh) -> None:
        if not isinstance(mesh, Mesh):
            raise LayoutError(
                f"Layout needs a sg.dtensor.Mesh, got {type(mesh).__name__}: {mesh!r}"
            )
        if isinstance(sharding_specs, (str, bytes)) or not isinstance(sharding_specs, Sequence):
            raise LayoutError(
                f"Layout sharding_specs={sharding_specs!r}: expected a list with one mesh "
                "dimension name or UNSHARDED per tensor dimension"
            )
        specs = list(sharding_specs)
        for spec in specs:
            if not isinstance(spec, str):
                raise LayoutError(
                    f"Layout({specs!r}): spec {spec!r} is a {type(spec).__name__}; expected a "
                    f"mesh dimension name ({list(mesh.dim_names)}) or UNSHARDED"
                )
            if spec != UNSHARDED and not mesh.contains_dim(spec):
                raise LayoutError(
                    f"Layout({specs!r}): the mesh {mesh} has no dimension {spec!r}; expected "
                    f"one of {list(mesh.dim_names)} or UNSHARDED"
                )
        used = [s for s in specs if s != UNSHARDED]
        twice = sorted({s for s in used if used.count(s) > 1})
        if twice:
            raise LayoutError(
                f"Layout({specs!r}): mesh dimension {twice[0]!r} shards more than one tensor "
                "dimension; each mesh dimension may split at most one"
            )
        self._specs = tuple(specs)
        self._mesh = mesh

    # --- constructors (TensorFlow's names) -------------------------------------------------

    @classmethod
    def replicated(cls, mesh: Mesh, rank: int) -> Layout:
        """Every dimension unsharded: a full copy on every device."""
        return cls([UNSHARDED] * _rank(rank, "replicated"), mesh)

    @classmethod
    def batch_sharded(cls, mesh: Mesh, batch_dim: str, rank: int) -> Layout:
        """The first dimension split along ``batch_dim``, the others unsharded."""
        return cls([batch_dim] + [UNSHARDED] * (_rank(rank, "batch_sharded", 1) - 1), mesh)

    @classmethod
    def inner_sharded(cls, mesh: Mesh, inner_dim: str, rank: int) -> Layout:
        """The last dimension split along ``inner_dim``, the others unsharded."""
        return cls([UNSHARDED] * (_rank(rank, "inner_sharded", 1) - 1) + [inner_dim], mesh)

    # --- what it says ----------------------------------------------------------------------

    @property
    def sharding_specs(self) -> list[str]:
        return list(self._specs)

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    @property
    def rank(self) -> int:
        return len(self._specs)

    def num_shards(self, dim: int) -> int:
        """Into how many pieces tensor dimension ``dim`` is split."""
        spec = self._specs[dim]
        return 1 if spec == UNSHARDED else self._mesh.dim_size(spec)

    def is_fully_replicated(self) -> bool:
        return all(s == UNSHARDED or self._mesh.dim_size(s) == 1 for s in self._specs)

    def local_shape(self, global_shape: Sequence[int]) -> list[int]:
        return [size // self.num_shards(d) for d, size in enumerate(global_shape)]

    def check_shape(self, shape: Sequence[int], what: str = "the tensor") -> None:
        """Raise ``LayoutError`` unless a tensor of ``shape`` can be laid out this way."""
        shape = list(shape)
        if len(shape) != self.rank:
            raise LayoutError(
                f"{self!r} has rank {self.rank} but {what} of shape {shape} has rank "
                f"{len(shape)}; expected one sharding spec per tensor dimension"
            )
        for d, size in enumerate(shape):
            n = self.num_shards(d)
            if size % n:
                raise LayoutError(
                    f"{what} of shape {shape} cannot take {self!r}: dimension {d} has size "
                    f"{size}, which {n} shards along mesh dimension {self._specs[d]!r} do not "
                    f"divide evenly; expected a multiple of {n}"
                )

    # --- plain data ------------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        return self._specs == other._specs and self._mesh == other._mesh

    def __hash__(self) -> int:
        return hash((self._specs, self._mesh))

    def to_string(self) -> str:
        dims = "|".join(f"{n}={s}" for n, s in zip(self._mesh.dim_names, self._mesh.shape))
        return f"sharding_specs:{','.join(self._specs)}, mesh:|{dims}|"

    def __repr__(self) -> str:
        return f"Layout.from_string({self.to_string()})"


def _rank(rank: int, what: str, minimum: int = 0) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < minimum:
        raise LayoutError(f"Layout.{what}: rank={rank!r}; expected an integer >= {minimum}")
    return rank
