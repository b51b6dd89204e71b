"""``sg.distribute``: strategies, replica contexts, distributed input (TF's ``tf.distribute``)."""

from stratagem.comm.cross_device_ops import (
    CrossDeviceOps,
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
)
from stratagem.comm.reduce_op import ReduceOp
from stratagem.distribute import cluster_resolver, experimental
from stratagem.distribute.context import (
    ReplicaContext,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from stratagem.distribute.input import InputContext, InputOptions
from stratagem.distribute.mirrored import MirroredStrategy
from stratagem.distribute.multi_worker_mirrored import MultiWorkerMirroredStrategy
from stratagem.distribute.one_device import OneDeviceStrategy
from stratagem.distribute.parameter_server import ParameterServerStrategy, Server
from stratagem.distribute.strategy import Strategy
from stratagem.distribute.values import PerReplica

__all__ = [
    "CrossDeviceOps",
    "HierarchicalCopyAllReduce",
    "InputContext",
    "InputOptions",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "NcclAllReduce",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "PerReplica",
    "ReduceOp",
    "ReductionToOneDevice",
    "ReplicaContext",
    "Server",
    "Strategy",
    "cluster_resolver",
    "experimental",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
]
