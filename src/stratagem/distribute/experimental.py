"""``sg.distribute.experimental``: collective options, variable partitioners (TF's
``tf.distribute.experimental.partitioners``), TF 2.4's ``coordinator`` namespace and the
experimental strategies: names only, each defined in its own module.

The names are imported on first use (PEP 562), so a job that does not use the sharded, mesh or
pipeline strategies never imports FSDP, DTensor or ``torch.distributed.pipelining``."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers see; the names load on first use (below)
    from stratagem.distribute import coordinator as coordinator
    from stratagem.distribute import partitioners as partitioners
    from stratagem.distribute.central_storage_strategy import (
        CentralStorageStrategy as CentralStorageStrategy,
    )
    from stratagem.distribute.communication_options import (
        CommunicationImplementation as CommunicationImplementation,
    )
    from stratagem.distribute.communication_options import (
        CommunicationOptions as CommunicationOptions,
    )
    from stratagem.distribute.fully_sharded_strategy import (
        FullyShardedStrategy as FullyShardedStrategy,
    )
    from stratagem.distribute.machinery.branches import Ensemble as Ensemble
    from stratagem.distribute.machinery.branches import ParallelBranches as ParallelBranches
    from stratagem.distribute.mesh_strategy import MeshStrategy as MeshStrategy
    from stratagem.distribute.parameter_server_strategy import (
        ParameterServerStrategy as ParameterServerStrategy,
    )
    from stratagem.distribute.pipeline_strategy import PipelineStrategy as PipelineStrategy

# public name -> the module that defines it (a module itself where the name is a namespace)
_WHERE = {
    "CentralStorageStrategy": "stratagem.distribute.central_storage_strategy",
    "CommunicationImplementation": "stratagem.distribute.communication_options",
    "CommunicationOptions": "stratagem.distribute.communication_options",
    "Ensemble": "stratagem.distribute.machinery.branches",
    "FullyShardedStrategy": "stratagem.distribute.fully_sharded_strategy",
    "MeshStrategy": "stratagem.distribute.mesh_strategy",
    "ParallelBranches": "stratagem.distribute.machinery.branches",
    "ParameterServerStrategy": "stratagem.distribute.parameter_server_strategy",
    "PipelineStrategy": "stratagem.distribute.pipeline_strategy",
}
_NAMESPACES = {
    "coordinator": "stratagem.distribute.coordinator",
    "partitioners": "stratagem.distribute.partitioners",
}

__all__ = sorted([*_WHERE, *_NAMESPACES])


def __getattr__(name: str) -> Any:
    if name in _NAMESPACES:
        value = importlib.import_module(_NAMESPACES[name])
    elif name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return __all__
