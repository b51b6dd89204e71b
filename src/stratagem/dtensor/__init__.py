"""``sg.dtensor``: meshes of devices with named dimensions, and layouts for tensors on them.

Port of TensorFlow's DTensor (``tf.experimental.dtensor``) onto ``torch.distributed.tensor``::

    mesh = sg.dtensor.create_mesh([("batch", 2), ("model", 2)])
    layout_map = sg.dtensor.LayoutMap(mesh)
    layout_map["feature.*weight"] = sg.dtensor.Layout(["model", sg.dtensor.UNSHARDED], mesh)
    with layout_map.scope():
        model = build_model()      # its weights are DTensors, each with .layout

``copy_to_mesh`` lays out one tensor; ``megatron_layout_map(mesh, model)`` writes the map of
Megatron's tensor parallelism for a transformer. Train with a plain ``torch.optim`` optimizer:
DTensor decides every collective. One process per device: launch with ``stratagem run -n N``,
TF_CONFIG, torchrun or SLURM.
"""

from stratagem.dtensor import metrics
from stratagem.dtensor.errors import LayoutError, MeshError, ShardingRuleError
from stratagem.dtensor.layout import UNSHARDED, Layout
from stratagem.dtensor.layout_map import LayoutMap, apply_layout_map, layout_weights
from stratagem.dtensor.megatron import MEGATRON_PLAN, megatron_layout_map
from stratagem.dtensor.mesh import Mesh, create_mesh
from stratagem.dtensor.translate import (
    DTensor,
    LaidOutParameter,
    copy_to_mesh,
    fetch_layout,
    pack,
    relayout,
    unpack,
)

__all__ = [
    "MEGATRON_PLAN",
    "UNSHARDED",
    "DTensor",
    "LaidOutParameter",
    "Layout",
    "LayoutError",
    "LayoutMap",
    "Mesh",
    "MeshError",
    "ShardingRuleError",
    "apply_layout_map",
    "copy_to_mesh",
    "create_mesh",
    "fetch_layout",
    "layout_weights",
    "megatron_layout_map",
    "metrics",
    "pack",
    "relayout",
    "unpack",
]
