"""``sg.train``: checkpoints, and ``ClusterSpec`` (where TF keeps it)."""

from stratagem.cluster.spec import ClusterSpec
from stratagem.train.checkpoint import Checkpoint, CheckpointError, LoadStatus
from stratagem.train.checkpoint_manager import CheckpointManager, latest_checkpoint

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointManager",
    "ClusterSpec",
    "LoadStatus",
    "latest_checkpoint",
]
