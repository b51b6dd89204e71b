"""``sg.distribute.experimental``: collective options, variable partitioners (TF's
``tf.distribute.experimental.partitioners``), TF 2.4's ``coordinator`` namespace and the
experimental strategies: names only, each defined in its own module."""

from __future__ import annotations

from stratagem.distribute import coordinator, partitioners
from stratagem.distribute.central_storage_strategy import CentralStorageStrategy
from stratagem.distribute.communication_options import (
    CommunicationImplementation,
    CommunicationOptions,
)
from stratagem.distribute.fully_sharded_strategy import FullyShardedStrategy
from stratagem.distribute.machinery.branches import Ensemble, ParallelBranches
from stratagem.distribute.mesh_strategy import MeshStrategy
from stratagem.distribute.parameter_server_strategy import ParameterServerStrategy
from stratagem.distribute.pipeline_strategy import PipelineStrategy

__all__ = [
    "CentralStorageStrategy",
    "CommunicationImplementation",
    "CommunicationOptions",
    "Ensemble",
    "FullyShardedStrategy",
    "MeshStrategy",
    "ParallelBranches",
    "ParameterServerStrategy",
    "PipelineStrategy",
    "coordinator",
    "partitioners",
]
