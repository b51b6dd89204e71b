"""Checkpoints: ``sg.train.Checkpoint``, ``CheckpointManager``, ``latest_checkpoint``."""

from stratagem.train.checkpoint import Checkpoint, CheckpointError, LoadStatus
from stratagem.train.checkpoint_manager import CheckpointManager, latest_checkpoint

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointManager",
    "LoadStatus",
    "latest_checkpoint",
]
