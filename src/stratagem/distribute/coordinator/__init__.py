"""``sg.distribute.coordinator``: TF2's ``ClusterCoordinator`` (the chief schedules functions
that worker tasks run; functions travel by reference, see ``stratagem.shipping``)."""

from stratagem.distribute.coordinator.cluster_coordinator import ClusterCoordinator
from stratagem.distribute.coordinator.remote_values import (
    CancelledError,
    ClosureInputError,
    FunctionError,
    PerWorkerDataset,
    PerWorkerIterator,
    RemoteValue,
)
from stratagem.distribute.coordinator.worker import experimental_get_current_worker_index
from stratagem.distribute.machinery.input import (
    PerWorkerDistributedDataset,
    PerWorkerDistributedDatasetsFromFunction,
)

__all__ = [
    "CancelledError",
    "ClosureInputError",
    "ClusterCoordinator",
    "FunctionError",
    "PerWorkerDataset",
    "PerWorkerDistributedDataset",
    "PerWorkerDistributedDatasetsFromFunction",
    "PerWorkerIterator",
    "RemoteValue",
    "experimental_get_current_worker_index",
]
