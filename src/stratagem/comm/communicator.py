"""The interface every layer uses to talk to the other processes of a job.

``LocalCommunicator`` is the single-process null version: the same calls, a world of one, no
processes to wait for. Code above this layer never asks whether it runs distributed.
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from stratagem.comm import plain_data
from stratagem.comm.reduce_op import ReduceOp


class PendingOp(abc.ABC):
    """A collective started asynchronously; ``wait()`` finishes it or raises a named error."""

    @abc.abstractmethod
    def wait(self) -> None: ...


class _DoneOp(PendingOp):
    def wait(self) -> None:
        return None


@dataclass
class Traffic:
    """What one process sent to its peers through a communicator's data collectives.

    Counted as the bandwidth-optimal algorithms send it (the "bus bandwidth" model of
    nccl-tests), so that figures do not depend on which algorithm gloo or NCCL picks: over n
    processes, an all-reduce of B bytes sends 2(n-1)/n*B (a reduce-scatter, then an
    all-gather), an all-to-all of B bytes (n-1)/n*B (its own chunk stays), an all-gather of a
    B-byte part (n-1)*B. Broadcasts and barriers are not counted. A world of one sends nothing.
    """

    bytes_sent: int = 0
    all_reduces: int = 0  # all-reduces started, compressed ones included
    collectives: int = 0  # every counted collective
    # Seconds spent waiting for collectives to complete, barriers included (comm.stragglers
    # takes them from a step's time to find each process's own work).
    seconds_waiting: float = 0.0

    def count(self, kind: str, nbytes: int, world_size: int) -> None:
        """Add one collective of ``kind`` ("all_reduce", "all_to_all", "all_gather")."""
        n = world_size
        factor = {"all_reduce": 2 * (n - 1), "all_to_all": n - 1, "all_gather": n * (n - 1)}
        self.bytes_sent += factor[kind] * nbytes // n
        self.collectives += 1
        self.all_reduces += kind == "all_reduce"


class Communicator(abc.ABC):
    """Collectives among the processes of one job, each operation named for error messages.

    ``what`` says, in words, what an operation carries ("gradients", "initial values of 6
    parameters"): it is echoed when a peer is lost or an operation times out.
    """

    rank: int
    world_size: int

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    @property
    def traffic(self) -> Traffic:
        """The bytes this process has sent through this communicator (see ``Traffic``)."""
        # Made on first use: subclasses need not call a base __init__ for it.
        if "_traffic" not in self.__dict__:
            self._traffic = Traffic()
        return self._traffic

    @abc.abstractmethod
    def peer_name(self, rank: int) -> str:
        """A readable name for a rank, e.g. ``worker 1 (localhost:23456)``."""

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, what: str) -> None:
        """Reduce ``tensor`` in place across all processes (MEAN divides by the world size)."""

    @abc.abstractmethod
    def all_reduce_async(self, tensor: torch.Tensor, *, what: str) -> PendingOp:
        """Start a SUM all-reduce of ``tensor`` in place; the result is valid after ``wait()``."""

    def all_to_all_async(
        self, output: torch.Tensor, tensor: torch.Tensor, *, what: str
    ) -> PendingOp:
        """Start an all-to-all of 1-D ``tensor``, cut in ``world_size`` equal chunks: chunk i
        goes to process i, and ``output`` receives every process's chunk for this one, in rank
        order. A pure transfer (no arithmetic), so any dtype the backend moves will do."""
        raise NotImplementedError(f"{type(self).__name__} has no all_to_all ({what})")

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, *, what: str) -> None:
        """Every process's 1-D ``tensor``, concatenated in rank order into ``output``."""
        parts = self.all_gather(tensor, what=what)
        output.copy_(torch.cat(parts))

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, what: str) -> None:
        """Overwrite ``tensor`` on every process with its value on ``src``."""

    @abc.abstractmethod
    def all_gather(self, tensor: torch.Tensor, *, what: str) -> list[torch.Tensor]:
        """Every process's ``tensor`` (same shape everywhere), in rank order."""

    def all_gather_object(self, obj: Any, *, what: str) -> list[Any]:
        """Every process's ``obj``, in rank order: plain data and tensors only (the schema of
        ``comm.plain_data``; tuples stay tuples, tensors arrive on the CPU). Nothing a peer
        sends is unpickled: other objects are refused here with a ``TypeError``, and a peer's
        frame that does not fit the schema is a ``PeerDataError`` naming the peer."""
        # One frame of bytes through all_gather rather than dist.all_gather_object, which
        # unpickles, and whose internal Works and tensors a communicator could not keep alive
        # (see ProcessGroupCommunicator).
        frame = plain_data.encode(obj, what=what)
        payload = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
        sizes = [int(s) for s in self.all_gather(torch.tensor([payload.numel()]), what=what)]
        for rank, size in enumerate(sizes):  # on every process, before any allocates
            plain_data.check_announced_size(size, sender=self.peer_name(rank), what=what)
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[: payload.numel()] = payload
        gathered = self.all_gather(padded, what=what)
        return [
            plain_data.decode(
                chunk[:size].numpy().tobytes(), sender=self.peer_name(rank), what=what
            )
            for rank, (chunk, size) in enumerate(zip(gathered, sizes, strict=True))
        ]

    @abc.abstractmethod
    def barrier(self, *, what: str) -> None:
        """Wait until every process reaches this point."""

    def named_faults(self, operation: str, *, what: str) -> contextlib.AbstractContextManager[None]:
        """A block in which torch runs collectives of its own on this job's processes (DTensor's
        redistributions, the pipeline schedule's sends): a lost or stuck peer there is reported
        as this layer's own operations are, naming the peer, the ``operation`` and ``what`` it
        carried."""
        return contextlib.nullcontext()

    def shutdown(self) -> None:
        """Release the connection to the other processes (idempotent)."""
        return None


class LocalCommunicator(Communicator):
    """A world of one process: every collective is the identity."""

    def __init__(self) -> None:
        self.rank = 0
        self.world_size = 1

    def peer_name(self, rank: int) -> str:
        return "this process" if rank == 0 else f"rank {rank}"

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, what: str) -> None:
        return None

    def all_reduce_async(self, tensor: torch.Tensor, *, what: str) -> PendingOp:
        return _DoneOp()

    def all_to_all_async(
        self, output: torch.Tensor, tensor: torch.Tensor, *, what: str
    ) -> PendingOp:
        output.copy_(tensor)
        return _DoneOp()

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, *, what: str) -> None:
        output.copy_(tensor)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, what: str) -> None:
        return None

    def all_gather(self, tensor: torch.Tensor, *, what: str) -> list[torch.Tensor]:
        return [tensor]

    def all_gather_object(self, obj: Any, *, what: str) -> list[Any]:
        # The same schema check as a real exchange, so a program that sends an object no peer
        # could receive fails on one process already, not first on a cluster.
        plain_data.check(obj, what=what)
        return [obj]

    def barrier(self, *, what: str) -> None:
        return None
