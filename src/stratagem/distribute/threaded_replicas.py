"""Local replicas on threads, meeting at merge calls: MirroredStrategy's and
CentralStorageStrategy's way of running several replicas in one process.

1. ``run`` runs replica 0 in the calling thread and the others on replica threads
   (``machinery.replica_threads.ReplicaGroup``); each call sets its replica context, device,
   view of the variables and random stream (the core's ``_replica_calls``).
2. A merge call (``merge_call`` in a replica context: an optimizer step, an all-reduce, a
   ``GradScaler`` call) is a sync point: every local replica arrives, the last one runs the
   action once, seeing the primaries rather than its copies (``DisableTorchFunction`` lifts the
   replica's view), and the others wait for it, each for at most ``sync_timeout`` seconds.
3. Replicas that share the CPU split its intra-op threads between them; between sync points
   one replica works alone and gets the process's threads back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from typing_extensions import override

from stratagem.distribute.capabilities import MergesReplicas
from stratagem.distribute.extended import StrategyExtended
from stratagem.distribute.machinery import context
from stratagem.distribute.machinery.context import ReplicaContext
from stratagem.distribute.machinery.replica_threads import ReplicaGroup


class ThreadedReplicas(StrategyExtended, MergesReplicas):
    """Several local replicas on threads that meet at merge calls (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._replicas: ReplicaGroup | None = None  # replica threads, started on first use
        self._process_threads = torch.get_num_threads()
        self._intra_op_threads = self._threads_per_cpu_replica()

    def _threads_per_cpu_replica(self) -> int | None:
        # Replicas sharing the CPU split its intra-op threads; otherwise each would start as
        # many threads as there are cores and they would fight over them.
        cpu = sum(1 for device in self.replica_devices if device.type == "cpu")
        if cpu < 2:
            return None
        return max(1, self._process_threads // cpu)

    @override
    def run_replica_calls(self, calls: list[Callable[[], Any]]) -> list[Any]:
        """Concurrently, on replica threads, so that they can meet at ``merge_call``."""
        return self._replica_group().run(calls)

    def _replica_group(self) -> ReplicaGroup:
        if self._replicas is None:
            self._replicas = ReplicaGroup(len(self.replica_devices), self._sync_timeout)
        return self._replicas

    @override
    def _enter_replica(self, replica: int, stack: contextlib.ExitStack) -> None:
        if self._intra_op_threads is not None:
            stack.callback(torch.set_num_threads, torch.get_num_threads())
            torch.set_num_threads(self._intra_op_threads)

    @override
    def merge_replicas(self, ctx: ReplicaContext, what: str, action: Callable[[], None]) -> None:
        def unviewed() -> None:
            # Runs in whichever replica thread arrives last; it must see the primaries.
            with torch._C.DisableTorchFunction(), self._all_threads():
                action()

        self._replica_group().sync(ctx.local_replica_id, what, unviewed)

    @contextlib.contextmanager
    def _all_threads(self) -> Iterator[None]:
        """Every intra-op thread of the process, for work one replica does while others wait."""
        if self._intra_op_threads is None:
            yield
            return
        previous = torch.get_num_threads()
        torch.set_num_threads(self._process_threads)
        try:
            yield
        finally:
            torch.set_num_threads(previous)

    def lend_threads(self, to_replica_zero: bool) -> None:
        """Around an optimizer step: replica 0 does the update while the others wait, so it
        takes the process's threads (True) and gives them back afterwards (False)."""
        ctx = context.current_replica()
        if (
            self._intra_op_threads is None
            or ctx is None
            or ctx.strategy is not self.strategy
            or ctx.local_replica_id != 0
        ):
            return
        torch.set_num_threads(self._process_threads if to_replica_zero else self._intra_op_threads)
