"""Clusters: who the tasks of a job are, and which one this process is.

Pure logic, no processes and no torch: ``ClusterSpec``, TF_CONFIG parsing, task roles, and the
resolvers that read TF_CONFIG/STRATAGEM_CONFIG, torchrun's and SLURM's variables.
``resolve_cluster()`` picks the one that applies.
"""

from __future__ import annotations

from stratagem.cluster.address import format_address, parse_address
from stratagem.cluster.cluster_spec import ClusterSpec
from stratagem.cluster.detect import resolve_cluster
from stratagem.cluster.resolver import (
    ClusterResolver,
    SimpleClusterResolver,
    TFConfigClusterResolver,
)
from stratagem.cluster.roles import (
    TASK_TYPES,
    check_task_types,
    collective_members,
    is_chief,
    is_coordinated,
    rank_of,
)
from stratagem.cluster.slurm import (
    SlurmClusterResolver,
    expand_hostlist,
    expand_tasks_per_node,
    slurm_env_present,
)
from stratagem.cluster.tf_config import TFConfig, load_tf_config, parse_tf_config
from stratagem.cluster.torchrun import TorchrunClusterResolver, torchrun_env_present

__all__ = [
    "TASK_TYPES",
    "ClusterResolver",
    "ClusterSpec",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfig",
    "TFConfigClusterResolver",
    "TorchrunClusterResolver",
    "check_task_types",
    "collective_members",
    "expand_hostlist",
    "expand_tasks_per_node",
    "format_address",
    "is_chief",
    "is_coordinated",
    "load_tf_config",
    "parse_address",
    "parse_tf_config",
    "rank_of",
    "resolve_cluster",
    "slurm_env_present",
    "torchrun_env_present",
]
