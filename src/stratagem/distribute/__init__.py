"""``sg.distribute``: strategies, replica contexts, distributed input (TF's ``tf.distribute``).

This is the one door into the package: other packages of stratagem import from here (and the
public namespaces ``capabilities``, ``cluster_resolver``, ``coordinator``, ``experimental``,
``partitioners``), never from its machinery (``tests/test_architecture.py`` checks it). Besides
TF's names it names what the layers above need (Keras, checkpoints, ``sg.nn``,
``sg.debugging``, ``sg.device``): ``strategy_for``, ``owner_of``, ``tensors_of`` (which
strategy distributes what), ``current_replica`` (the replica context in force, if any),
``device`` and the placement log.
"""

from stratagem.comm.cross_device_ops import (
    CrossDeviceOps,
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
)
from stratagem.comm.reduce_op import ReduceOp
from stratagem.distribute import capabilities, cluster_resolver, coordinator, experimental

# Provides the default strategy to the replica context (get_strategy() outside every scope).
from stratagem.distribute import default_strategy as _provides_default  # noqa: F401
from stratagem.distribute.extended import StrategyExtended
from stratagem.distribute.machinery.context import (
    ReplicaContext,
    current_replica,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from stratagem.distribute.machinery.device_scope import device
from stratagem.distribute.machinery.input import InputContext, InputOptions
from stratagem.distribute.machinery.per_replica import PerReplica
from stratagem.distribute.machinery.placement_log import (
    get_log_device_placement,
    set_log_device_placement,
)
from stratagem.distribute.machinery.scope_hooks import owner_of, strategy_for, tensors_of
from stratagem.distribute.mirrored_strategy import MirroredStrategy
from stratagem.distribute.multi_worker_mirrored_strategy import MultiWorkerMirroredStrategy
from stratagem.distribute.one_device_strategy import OneDeviceStrategy
from stratagem.distribute.parameter_server_strategy import ParameterServerStrategy
from stratagem.distribute.planner import auto, plan
from stratagem.distribute.server import Server
from stratagem.distribute.strategy import Strategy

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
    "StrategyExtended",
    "auto",
    "capabilities",
    "cluster_resolver",
    "coordinator",
    "current_replica",
    "device",
    "experimental",
    "get_log_device_placement",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "owner_of",
    "plan",
    "set_log_device_placement",
    "strategy_for",
    "tensors_of",
]
