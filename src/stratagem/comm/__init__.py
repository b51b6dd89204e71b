"""Communication between processes and devices: process groups, collectives, cross-device ops."""

from stratagem.comm.communicator import Communicator, LocalCommunicator, PendingOp
from stratagem.comm.reduce_op import ReduceOp
from stratagem.comm.runtime import (
    current_communicator,
    distribution_context,
    set_current_communicator,
    set_distribution_context,
)

__all__ = [
    "Communicator",
    "LocalCommunicator",
    "PendingOp",
    "ReduceOp",
    "current_communicator",
    "distribution_context",
    "set_current_communicator",
    "set_distribution_context",
]
