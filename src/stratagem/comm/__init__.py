"""Communication between processes and devices: process groups, collectives, cross-device ops."""

from stratagem.comm.communicator import Communicator, LocalCommunicator, PendingOp
from stratagem.comm.reduce_op import ReduceOp

__all__ = [
    "Communicator",
    "LocalCommunicator",
    "PendingOp",
    "ReduceOp",
]
