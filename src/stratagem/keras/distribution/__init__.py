"""``sg.keras.distribution``: Keras 3's distribution API on stratagem's meshes.

Keras 3 code that distributes with these names ports unchanged; the model is a torch module
and the layouts' keys and axes are torch's (``d1/weight``, not ``dense/kernel``)::

    mesh = DeviceMesh((2, 2), ["batch", "model"], list_devices())  # stratagem run -n 4
    layout_map = LayoutMap(mesh)
    layout_map["d1/weight"] = ("model", None)
    set_distribution(ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    model = sg.keras.Model(build_module())  # laid out on the mesh; compile and fit as usual
"""

from stratagem.keras.distribution.device_mesh import (
    DeviceMesh,
    TensorLayout,
    get_device_count,
    list_devices,
)
from stratagem.keras.distribution.distributions import (
    DataParallel,
    Distribution,
    ModelParallel,
    distribute_tensor,
    distribution,
    set_distribution,
)
from stratagem.keras.distribution.keras_layout_map import LayoutMap

__all__ = [
    "DataParallel",
    "DeviceMesh",
    "Distribution",
    "LayoutMap",
    "ModelParallel",
    "TensorLayout",
    "distribute_tensor",
    "distribution",
    "get_device_count",
    "list_devices",
    "set_distribution",
]
