"""``sg.train``: checkpoints, and ``ClusterSpec`` (where TF keeps it)."""

from stratagem.cluster.cluster_spec import ClusterSpec
from stratagem.train.checkpoint import Checkpoint, CheckpointError, CheckpointOptions, LoadStatus
from stratagem.train.checkpoint_manager import CheckpointManager, latest_checkpoint
from stratagem.train.checkpoints_iterator import checkpoints_iterator, wait_for_new_checkpoint
from stratagem.train.manifest import (
    DamagedSaveError,
    FellBackWarning,
    UncheckedSaveWarning,
    UnsafeCheckpointError,
)
from stratagem.train.preemption import (
    PreemptionCheckpointHandler,
    TerminationConfig,
    slurm_requeue_config,
)

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointOptions",
    "ClusterSpec",
    "DamagedSaveError",
    "FellBackWarning",
    "LoadStatus",
    "PreemptionCheckpointHandler",
    "TerminationConfig",
    "UncheckedSaveWarning",
    "UnsafeCheckpointError",
    "checkpoints_iterator",
    "latest_checkpoint",
    "slurm_requeue_config",
    "wait_for_new_checkpoint",
]
