"""The errors of ``sg.dtensor``: a bad mesh, and a layout that does not fit its tensor or mesh."""

from __future__ import annotations

from stratagem.errors import StratagemError


class MeshError(StratagemError, ValueError):
    """A mesh that cannot be built: bad dimensions, or a size other than the job's."""


class LayoutError(StratagemError, ValueError):
    """A layout that names no mesh dimension, or does not fit a tensor's rank or shape."""


class ShardingRuleError(StratagemError, NotImplementedError):
    """An operator DTensor has no sharding rule for ran on a mesh, or one it cannot run on a
    dimension the mesh cuts unevenly: it names the operator, the module it ran in when known,
    and what to do instead."""
