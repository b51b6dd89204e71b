"""The communicator over ``torch.distributed``: start, collectives with named errors, clean stop.

Start-up: a TCPStore hosted by rank 0 (or by torchrun's agent), a roll call that names missing
peers, ``init_process_group`` on that store (gloo on CPU; NCCL for CUDA tensors), and one barrier,
after which no process needs the store again (so its host may leave first). Every collective runs
inside ``_operation``, which turns gloo's anonymous "connection reset" or "timed out" into an error
that names the peer and the operation, by asking each peer's liveness server (``liveness.py``);
an error that is not the transport's (``is_communication_failure``) passes through as itself. At
exit the group is destroyed, so a job ends with exit code 0 and without abort messages.

In an elastic job (``STRATAGEM_ELASTIC=1``, set by the agent) collectives are waited in slices,
so that ``abandon()`` (the agent's channel) ends a blocked one; a lost peer or an abandoned
collective is ``MembershipChanged``; ``rebuild`` then abandons the group without joining gloo's
threads and starts the round's group in place (store prefix ``stratagem/round-N/``).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import datetime
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from stratagem.cluster.job_secret import job_secret, task_hosts
from stratagem.comm import error_report
from stratagem.comm.adopted_group import exchange_over_group
from stratagem.comm.binding import pin_transport_interfaces
from stratagem.comm.communicator import Communicator, LocalCommunicator, PendingOp
from stratagem.comm.gloo_drain import wait_for_gloo_threads
from stratagem.comm.liveness import (
    LOST,
    SILENT,
    TIMED_OUT,
    UNREACHABLE,
    LivenessServer,
    PeerState,
    advertised_host,
    first_lost,
    linger,
    operation_position,
    probe_all,
    whereabouts,
)
from stratagem.comm.peer_check import check_peers
from stratagem.comm.reduce_op import ReduceOp
from stratagem.comm.rendezvous import Member, open_store, roll_call
from stratagem.errors import (
    CollectiveTimeoutError,
    MembershipChanged,
    PeerLostError,
    RendezvousError,
    StaleGroupError,
    StratagemError,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


# How long a process whose collective timed out keeps answering its peers before it ends (see
# ``liveness.linger``): well inside the 5 s a hang's report may take past the operation timeout.
LINGER_S = 2.0
# How long a broken connection that no peer's state explains yet is re-examined (``_diagnose``).
SETTLE_S = 1.5
# The variable the elastic agent sets for its workers (see the module docstring).
ELASTIC_VARIABLE = "STRATAGEM_ELASTIC"
# An elastic job waits for a collective in slices of this long (``_complete``): how soon an
# abandon is noticed. A completed collective wakes the wait at once, as a blocking one does.
WAIT_SLICE_S = 0.05
# Made once: building a timedelta per collective was most of what a sliced wait added to one
# that completes within its first slice (gloo's timed wait sleeps and wakes as the blocking one).
_SLICE = datetime.timedelta(seconds=WAIT_SLICE_S)
# What gloo's ``Work.wait(timeout)`` raises when the slice ends first; the Work goes on.
_SLICE_ENDED = "Operation timed out!"
# Groups abandoned by ``rebuild``, with their last Works and tensors: never released.
# Dropping the last reference to a gloo group joins its threads, which wait in an abandoned
# collective until the operation timeout (measured: 18.5 s), and at interpreter exit too: the
# list holds one reference no one drops, so the exit of a process whose silent peer is never
# ended is not held up (measured: 60 s, the operation timeout, without it).
_graveyard: list[Any] = []
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_graveyard))


def elastic_job() -> bool:
    """Whether the elastic agent started this process (``STRATAGEM_ELASTIC=1``)."""
    raw = os.environ.get(ELASTIC_VARIABLE, "")
    if raw not in ("", "0", "1"):
        raise ValueError(f"{ELASTIC_VARIABLE}={raw!r}; expected 1 (an elastic job) or 0")
    return raw == "1"


class Resolver(Protocol):
    """What the communicator needs from a cluster resolver (see ``stratagem.cluster``)."""

    rank: int | None
    world_size: int
    local_rank: int
    rendezvous_address: tuple[str, int] | None
    agent_store: bool
    attempt: int

    def peer_name(self, rank: int) -> str: ...

    def describe(self) -> str: ...

    def cluster_spec(self) -> Any: ...


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be a positive number of seconds")
    return value


@dataclass(frozen=True)
class Timeouts:
    """How long to wait for peers to arrive, and for one collective to complete."""

    rendezvous: float = 60.0
    operation: float = 60.0

    @classmethod
    def from_env(cls, operation: float | None = None) -> Timeouts:
        """Defaults, overridden by STRATAGEM_RENDEZVOUS_TIMEOUT / STRATAGEM_OP_TIMEOUT
        (``operation``, where given, instead of the latter)."""
        op = operation if operation is not None else cls.operation_from_env()
        return cls(_env_seconds("STRATAGEM_RENDEZVOUS_TIMEOUT", 60.0), op)

    @staticmethod
    def operation_from_env() -> float:
        """The operation timeout alone (STRATAGEM_OP_TIMEOUT, 60 s by default): the one place
        it is read, for what waits on peers without a rendezvous (replica threads)."""
        return _env_seconds("STRATAGEM_OP_TIMEOUT", 60.0)


class _Pending(PendingOp):
    def __init__(
        self,
        comm: ProcessGroupCommunicator,
        work: Any,
        name: str,
        what: str,
        staged: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        self._comm, self._work, self._name, self._what = comm, work, name, what
        self._staged = staged  # (the caller's CPU tensor, its copy on the GPU), see on_group
        self._round = comm.round

    def wait(self) -> None:
        if self._comm.round != self._round:
            # Its group was abandoned: the wait could only end at the operation timeout.
            raise StaleGroupError(
                f"{self._name} of {self._what} was started in round {self._round} and waited "
                f"in round {self._comm.round} on {self._comm.peer_name(self._comm.rank)}: an "
                "elastic rebuild drops the collectives pending in the earlier round"
            )
        with self._comm._operation(self._name, self._what), self._comm.waiting():
            self._comm._complete(self._work, f"{self._name} of {self._what}")
        if self._staged is not None:
            tensor, moved = self._staged
            tensor.copy_(moved)


# Set when the interpreter is exiting because of an uncaught exception: the exit handshake then
# says "error" and does not wait for the others.
def mark_failing() -> None:
    """This process is ending because of an error its own code caught (a forked worker of
    ``notebook_launcher``): ``shutdown`` tells the peers "error", not "ok"."""
    error_report.mark_failing()


class ProcessGroupCommunicator(Communicator):
    """Collectives among the chief and workers of a cluster, over torch.distributed."""

    # True when the group moves CUDA tensors only: a pure NCCL group another library started
    # (``AdoptedGroupCommunicator``). Ours always has gloo beside NCCL ("cpu:gloo,cuda:nccl").
    stage_cpu_tensors = False

    def on_group(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``, or where the group can move it: a CPU tensor (a barrier's flag, a
        metric's totals, a shuffle seed) goes through a copy on this process's GPU when the
        group moves CUDA tensors only; the caller copies the result back."""
        if self.stage_cpu_tensors and tensor.device.type == "cpu":
            return tensor.to(torch.device("cuda", torch.cuda.current_device()))
        return tensor

    def __init__(self, resolver: Resolver, *, backend: str, timeouts: Timeouts) -> None:
        if resolver.rank is None:
            raise RendezvousError(
                f"{resolver.describe()} takes no part in collectives (only chief and workers do)"
            )
        if resolver.rendezvous_address is None:
            raise RendezvousError(f"{resolver.describe()} has no rendezvous address")
        self.rank = resolver.rank
        self.world_size = resolver.world_size
        self.backend = backend
        self.timeouts = timeouts
        self._resolver = resolver
        self._elastic = elastic_job()
        # An elastic job's membership round (the attempt: a newcomer is started at the round
        # it joins); ``rebuild`` moves it on. The agent's channel sets ``_abandoned``.
        self.round = resolver.attempt
        self._abandoned = threading.Event()
        self._abandon_why = ""
        self._me = self.peer_name(self.rank)
        error_report.install(self._me)  # the rendezvous's errors are reported as one block too
        self._seq = 0
        self._closed = False
        # The last Works and their tensors, held here so that a gloo thread never drops the last
        # reference to a Python object. Releasing one needs the GIL, and at interpreter exit
        # Python ends a thread that waits for the GIL with pthread_exit, which aborts the
        # process ("terminate called without an active exception", about once in 20 clean
        # two-worker runs). gloo's threads may outlive destroy_process_group (creating any
        # torch.optim optimizer after init pins the group), so this is never cleared early.
        # Each gloo thread finishes with a Work before taking another: 64 later, it is done.
        self._recent_works: collections.deque = collections.deque(maxlen=64)
        host, port = resolver.rendezvous_address
        hosts_store = self.rank == 0 and not resolver.agent_store
        owner = resolver.peer_name(0) if not resolver.agent_store else "the torchrun agent"
        # Known before anything listens: a multi-machine job without a secret stops here.
        secret = job_secret([host, *task_hosts(resolver.cluster_spec())], me=self._me)
        base = open_store(
            host,
            port,
            is_server=hosts_store,
            timeout_s=timeouts.rendezvous,
            owner=owner,
            me=self._me,
            secret=secret,
        )
        # Held for the life of the connection: a store written in Python (the sealed one) is
        # reached by torch's C++ only while its Python object lives; once collected, a later
        # process group (a mesh's dimensions) would find "Not implemented" in its place.
        self._base_store = base
        own_host = advertised_host(host)
        self._liveness = LivenessServer(own_host)
        # gloo's and TensorPipe's listeners on this task's address too (``comm.binding``).
        pin_transport_interfaces(own_host)
        self._secret = secret
        self._start_group()
        self._watch_exit()

    def _round_prefix(self) -> str:
        """This group's namespace in the store: one per attempt (torchrun's agent store outlives
        restarts of the workers), one per round in an elastic job."""
        return f"stratagem/round-{self.round}/" if self._elastic else f"stratagem/{self.round}/"

    def _start_group(self) -> None:
        """Roll call on this round's prefix, the default group, the secret's check of its
        connections and one barrier: the start of a job, or of an elastic round."""
        self._store = dist.PrefixStore(self._round_prefix(), self._base_store)
        # An elastic round's members agree on its size; the clusters they were each started
        # with may differ (a newcomer's is the round's, a survivor's an earlier one).
        cluster = _canonical(self._resolver)
        if self._elastic:
            cluster = f"elastic world={self.world_size}"
        member = Member(
            rank=self.rank,
            world_size=self.world_size,
            name=self._me,
            cluster=cluster,
            pid=os.getpid(),
            host=socket.gethostname(),
            liveness=self._liveness.address,
        )
        members = roll_call(
            self._store, member, timeout_s=self.timeouts.rendezvous, peer_name=self.peer_name
        )
        self._peers = {m.rank: m.liveness for m in members if m.rank != self.rank}
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore("pg/", self._store),
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=self.timeouts.operation),
        )
        if self._secret is not None:
            check_peers(
                self._secret, rank=self.rank, world_size=self.world_size, peer_name=self.peer_name
            )
        # Everyone is past the store now: the rendezvous host may leave whenever it is done.
        self.barrier(what="the end of start-up")

    # ----------------------------------------------------------------- elastic rounds

    @property
    def job_store(self) -> dist.Store:
        """The job's store, sealed, outside any round's space: where the elastic agent posts
        its decisions (``comm.elastic_member``)."""
        return self._base_store

    @property
    def elastic(self) -> bool:
        """Whether this process was started by the elastic agent (its group can be rebuilt)."""
        return self._elastic

    def abandon(self, why: str = "the agent opens a new round") -> None:
        """End the collective this process waits in, and any it starts until ``rebuild``, with
        ``MembershipChanged`` (elastic jobs only). Safe from any thread or a signal handler."""
        self._abandon_why = why
        self._abandoned.set()

    def rebuild(self, *, round: int, rank: int, world_size: int) -> None:
        """Leave the current group without waiting for its pending collectives, and start the
        group of elastic ``round`` in place, as ``rank`` of ``world_size``: roll call, group,
        secret check and barrier as at start-up. Groups made from the old group
        (``GroupCommunicator``, meshes) are refused from now on (``StaleGroupError``)."""
        if not self._elastic:
            raise RendezvousError(
                f"{self._me} cannot rebuild its group in place: it was started outside an "
                f"elastic job, whose collectives can be abandoned (expected {ELASTIC_VARIABLE}=1)"
            )
        if self._closed:
            raise RendezvousError(f"{self._me} cannot rebuild its group: it was shut down")
        if round <= self.round or not 0 <= rank < world_size:
            raise RendezvousError(
                f"{self._me} asked to rebuild as rank {rank} of {world_size} in round {round}; "
                f"expected a round after {self.round} and a rank in 0..{world_size - 1}"
            )
        self._abandon_group()
        self.round, self.rank, self.world_size = round, rank, world_size
        self._me = self.peer_name(rank)
        error_report.install(self._me)
        # Operation numbers count from the round's start in every member, a newcomer's too: a
        # hang report compares them across peers.
        self._seq = 0
        self._liveness.status, self._liveness.position = "running", "0:start"
        self._abandoned.clear()
        self._start_group()

    def _abandon_group(self) -> None:
        """Abort every group of this process and forget them in torch, without joining gloo's
        threads: the groups and their pending Works stay referenced (``_graveyard``)."""
        if not dist.is_initialized():
            return
        c10d = dist.distributed_c10d
        _graveyard.append((list(c10d._pg_map), self._recent_works))
        self._recent_works = collections.deque(maxlen=64)
        # Aborts each group (gloo's abort returns at once) and clears torch's maps; the
        # destructors that would join the threads do not run while the graveyard holds them.
        c10d._abort_process_group()

    def _watch_exit(self) -> None:
        """Say at exit how this process ends (``shutdown``), "error" after an uncaught one; and
        report an error of ours as one block (``comm.error_report``)."""
        error_report.install(self._me)
        error_report.set_diagnosis(self._diagnose_uncaught)
        atexit.register(self.shutdown)

    def _diagnose_uncaught(self, error: BaseException) -> BaseException | None:
        """An uncaught error of a collective that ran outside our operations (DTensor's in a
        mesh job's own training loop, the script's own ``torch.distributed`` calls), named as
        ours are: the lost or stopped peer. None when it is no transport failure."""
        if not is_communication_failure(error):
            return None
        after = f"operation #{self._seq}" if self._seq else "the start"
        op = f"a collective of the script's own (DTensor's or torch's, after {after})"
        named = self._diagnose("", "", error, op=op)
        return None if named is error else named

    def _release_group(self) -> None:
        """Destroy the default group this communicator started."""
        if dist.is_initialized():
            dist.destroy_process_group()

    # ----------------------------------------------------------------- naming and errors

    def peer_name(self, rank: int) -> str:
        if self._elastic:
            # The cluster the process was started with no longer says who holds a rank.
            return f"rank {rank} of round {self.round}"
        return self._resolver.peer_name(rank)

    @contextlib.contextmanager
    def _operation(self, name: str, what: str) -> Iterator[None]:
        self._seq += 1
        seq = self._seq
        self._liveness.position = operation_position(seq, f"{name} of {what}")
        try:
            yield
        except MembershipChanged:
            raise  # abandoned on the agent's word (``_complete``): nothing to diagnose
        except (RuntimeError, dist.DistError, CollectiveTimeoutError) as e:
            # Only a failure of the transport is about the peers. Anything else is this
            # process's own error (an operator DTensor refused, a shape, the user's exception)
            # and stays itself, whatever the peers did meanwhile: a peer that stopped on the
            # same error first must not turn it into "peer lost".
            if not is_communication_failure(e):
                raise
            raise self._diagnose(name, what, e) from e
        # Peers that time out from now on hear that this process got past it (and, while no
        # other operation starts, that it is outside collectives).
        if self._seq == seq:
            self._liveness.position = operation_position(seq, f"{name} of {what}", done=True)

    def _diagnose(
        self, name: str, what: str, error: BaseException, *, op: str | None = None
    ) -> BaseException:
        """Turn a failed collective into an error naming the lost or lagging peer (``op``: the
        operation in words, when not ours: ``name of what (operation #n)``)."""
        # A collective of the script's own (``op`` given) has no number: this process's
        # position is its last operation of ours, not where it waits now.
        mine = self._liveness.position if op is None else None
        op = op or f"{name} of {what} (operation #{self._seq})"
        answers = probe_all(self._peers)
        # A connection dropped while every peer still says it is running: the peer that dropped
        # it is about to say why (it is ending, or its own wait timed out a moment earlier and
        # it is still reporting). Ask again for a moment rather than blame no one.
        settle = time.monotonic() + SETTLE_S
        while (
            not _explained(error, answers)
            and time.monotonic() < settle
            and not (self._closed or sys.is_finalizing())
        ):
            time.sleep(0.1)
            answers = probe_all(self._peers)
        first, after = first_lost(answers)
        if first:
            why = {
                None: "",
                "error": " (it exited with an error)",
                "ok": " (it had finished)",
                LOST: " (it had lost a peer itself)",
                UNREACHABLE: " (unreachable: no answer at all, so its machine or the network to "
                "it is down; it may still be running on the other side)",
            }
            who = ", ".join(
                f"{self.peer_name(r)}{why[getattr(answers[r], 'status', None)]}" for r in first
            )
            them = "it" if len(first) == 1 else "them"
            also = (
                f" ({', '.join(self.peer_name(r) for r in after)} ended after {them}, having "
                f"lost {them} too)"
                if after
                else ""
            )
            lost = [self.peer_name(r) for r in first]
            # Peers probing this process from now on hear whom it lost, not just that it ended
            # with an error: that tells them it is not the first failure.
            self._liveness.position = ",".join(str(r) for r in first)
            self._liveness.status = LOST
            cut = all(getattr(answers[r], "status", None) == UNREACHABLE for r in first)
            ended = (
                "Check that machine and the network between them"
                if cut
                else "Its own output says why it ended"
            )
            # An elastic job's layer catches the subclass, and rebuilds the group.
            lost_error = MembershipChanged if self._elastic else PeerLostError
            return lost_error(
                f"{who} was lost during {op} on {self._me}{also}. Underlying error: "
                f"{underlying_error(error, lost)}. {ended}; "
                "`stratagem run --max-restarts N` restarts a job from its last checkpoint"
            )
        text = str(error).lower()
        silent = [r for r, a in sorted(answers.items()) if a is not None and a.status == SILENT]
        # A peer whose own wait timed out first drops its connections as it reports: here that
        # is a closed connection, from a peer still alive, which is the same hang.
        gave_up = [r for r, a in sorted(answers.items()) if a is not None and a.status == TIMED_OUT]
        if silent or gave_up or "timed out" in text or "timeout" in text:
            timed_out = silent or "timed out" in text or "timeout" in text
            head = (
                f"{op} timed out after {self.timeouts.operation:g}s on {self._me}"
                if timed_out
                else f"{op} was cut short on {self._me} when "
                f"{', '.join(self.peer_name(r) for r in gave_up)} timed out waiting "
                f"({self.timeouts.operation:g}s)"
            )
            where = [
                f"{self.peer_name(r)} does not answer (stopped or stuck)"
                if a.status == SILENT
                else f"{self.peer_name(r)} {whereabouts(a.position, mine)}"
                for r, a in sorted(answers.items())
                if a is not None and (a.status == SILENT or whereabouts(a.position, mine))
            ]
            missing = "; ".join(where) or (
                "every peer is in it too (one is only slow, or the transport stalled)"
            )
            # Peers that time out a moment later still read where this process waited.
            self._liveness.status = TIMED_OUT
            return CollectiveTimeoutError(
                f"{head}; every peer is alive, so one has not reached this operation: "
                f"{missing}. A stopped process "
                "must be resumed or ended; raise the timeout with STRATAGEM_OP_TIMEOUT if a "
                "peer is only slow."
            )
        return error

    def named_faults(self, operation: str, *, what: str) -> contextlib.AbstractContextManager[None]:
        return self._operation(operation, what)

    def prove_group(self, group: dist.ProcessGroup) -> None:
        """Challenge the connections of a process group made after start-up (a mesh's
        dimension, a pipeline's replicas) as the job's own were (``comm.peer_check``). Every
        member of ``group`` calls it, groups in the same order everywhere."""
        if self._secret is None or group is dist.group.WORLD:
            return
        ranks = dist.get_process_group_ranks(group)
        with self._operation("the check of the job secret", "a new group's connections"):
            check_peers(
                self._secret,
                rank=dist.get_rank(group),
                world_size=len(ranks),
                peer_name=lambda r: self.peer_name(ranks[r]),
                group=group,
            )

    # ----------------------------------------------------------------- collectives

    def _launch(self, name: str, what: str, launch: Any, tensors: tuple) -> Any:
        """Start a collective; keep its Work and tensors (see ``_recent_works``)."""
        with self._operation(name, what), without_backward_context():
            work = launch()
        self._recent_works.append((work, tensors))
        return work

    def _run(self, name: str, what: str, launch: Any, tensors: tuple) -> None:
        """Run a collective to completion."""
        work = self._launch(name, what, launch, tensors)
        with self._operation(name, what), self.waiting():
            self._complete(work, f"{name} of {what}")

    def _complete(self, work: Any, op: str) -> None:
        """Wait for ``work``: blocking, or in an elastic job in slices (``WAIT_SLICE_S``), so
        that ``abandon`` ends the wait (gloo's abort is a no-op: nothing wakes a blocked
        ``wait`` but the collective's end, and a signal's Python handler runs only after it).

        Slices rather than polling ``is_completed`` or a callback on the Work's future: a
        completed collective wakes the timed wait at once, as it wakes a blocking one (polling
        or a callback cost 5-90 % of a small all-reduce, measured). Only a slice that ends
        costs more (an exception, about 0.1 ms a time). Slicing a wait is safe here because an
        abandoned group is never destroyed (``_abandon_group``)."""
        if not self._elastic:
            work.wait()
            return
        while True:
            try:
                work.wait(_SLICE)
                return
            except RuntimeError as e:
                if _SLICE_ENDED not in str(e):
                    raise  # the collective's own error
                if work.is_completed():
                    work.wait()  # done just after the slice ended: returns, or raises its error
                    return
            if self._abandoned.is_set():
                raise MembershipChanged(
                    f"{op} (operation #{self._seq}) on {self._me} was abandoned: "
                    f"{self._abandon_why}"
                )

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Count the block's time as waiting for peers (``Traffic.seconds_waiting``)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.traffic.seconds_waiting += time.perf_counter() - start

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, what: str) -> None:
        moved = self.on_group(tensor)
        launch = lambda: dist.all_reduce(moved, op.to_dist(), async_op=True)  # noqa: E731
        self.traffic.count("all_reduce", moved.nbytes, self.world_size)
        self._run("all_reduce", what, launch, (moved,))
        if op is ReduceOp.MEAN:
            moved.div_(self.world_size)
        if moved is not tensor:
            tensor.copy_(moved)

    def all_reduce_async(self, tensor: torch.Tensor, *, what: str) -> PendingOp:
        moved = self.on_group(tensor)
        launch = lambda: dist.all_reduce(moved, dist.ReduceOp.SUM, async_op=True)  # noqa: E731
        self.traffic.count("all_reduce", moved.nbytes, self.world_size)
        work = self._launch("all_reduce", what, launch, (moved,))
        staged = (tensor, moved) if moved is not tensor else None
        return _Pending(self, work, "all_reduce", what, staged)

    def all_to_all_async(
        self, output: torch.Tensor, tensor: torch.Tensor, *, what: str
    ) -> PendingOp:
        launch = lambda: dist.all_to_all_single(output, tensor, async_op=True)  # noqa: E731
        self.traffic.count("all_to_all", tensor.nbytes, self.world_size)
        work = self._launch("all_to_all", what, launch, (output, tensor))
        return _Pending(self, work, "all_to_all", what)

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, *, what: str) -> None:
        launch = lambda: dist.all_gather_single(output, tensor, async_op=True)  # noqa: E731
        self.traffic.count("all_gather", tensor.nbytes, self.world_size)
        self._run("all_gather", what, launch, (output, tensor))

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, what: str) -> None:
        moved = self.on_group(tensor)
        launch = lambda: dist.broadcast(moved, src, async_op=True)  # noqa: E731
        self._run("broadcast", what, launch, (moved,))
        if moved is not tensor:
            tensor.copy_(moved)

    def all_gather(self, tensor: torch.Tensor, *, what: str) -> list[torch.Tensor]:
        source = self.on_group(tensor).contiguous()
        out = [torch.empty_like(source) for _ in range(self.world_size)]
        launch = lambda: dist.all_gather(out, source, async_op=True)  # noqa: E731
        self.traffic.count("all_gather", source.nbytes, self.world_size)
        self._run("all_gather", what, launch, (source, *out))
        return [o.to(tensor.device) for o in out]

    def barrier(self, *, what: str) -> None:
        # A tiny all-reduce rather than dist.barrier: it runs on the same backend as the other
        # collectives and fails the same named way.
        flag = self.on_group(torch.zeros(1))
        self._run("barrier", what, lambda: dist.all_reduce(flag, async_op=True), (flag,))

    # ----------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Tell peers how this process ends, then tear the group down."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        error_report.set_diagnosis(None)
        if self._liveness.status == TIMED_OUT:
            linger(self._peers, LINGER_S)
        self._liveness.close(
            "error" if error_report.failing() or sys.exc_info()[0] is not None else "ok"
        )
        # Before the interpreter shuts down: a gloo thread still dropping its last work would
        # abort the process then (comm.gloo_drain says why).
        wait_for_gloo_threads()
        self._release_group()
        global _live
        if _live is self:
            _live = None


class AdoptedGroupCommunicator(ProcessGroupCommunicator):
    """The job's collectives over a default group another library initialised (Ray Train's
    ``TorchTrainer`` does, before the user's function runs; so may a user).

    The group is taken as it is: no store of ours and no second ``init_process_group`` (its port
    is already taken by the owner's store). The roll call travels over the group itself
    (``adopted_group``). The owner destroys the group; this communicator only leaves it.
    """

    def __init__(self, resolver: Resolver, *, timeouts: Timeouts) -> None:
        # Not ProcessGroupCommunicator.__init__: that one opens a store and starts the group.
        rank, world = dist.get_rank(), dist.get_world_size()
        if resolver.rank != rank or resolver.world_size != world:
            raise RendezvousError(
                f"torch.distributed was already initialised as rank {rank} of {world}, but "
                f"{resolver.describe()} is rank {resolver.rank} of {resolver.world_size}; "
                "expected the same rank and size (the environment and the group disagree)"
            )
        self.rank = rank
        self.world_size = world
        self.backend = str(dist.get_backend())
        # Ray Train starts a pure NCCL group on GPUs: it cannot move the CPU tensors some
        # collectives carry (a barrier's flag, metrics' totals, a seed); they go via the GPU.
        self.stage_cpu_tensors = self.backend == "nccl"
        # The owner's group was joined without our secret; so are the groups made from it (a
        # mesh's dimensions): prove_group has nothing to prove.
        self._secret = None
        self.timeouts = timeouts
        self._resolver = resolver
        # Not elastic: the owner's group is not ours to abandon or rebuild.
        self._elastic = False
        self.round = resolver.attempt
        self._abandoned = threading.Event()
        self._abandon_why = ""
        self._me = resolver.peer_name(rank)
        self._seq = 0
        self._closed = False
        self._recent_works: collections.deque = collections.deque(maxlen=64)
        self._peers: dict[int, str] = {}
        address = resolver.rendezvous_address
        self._liveness = LivenessServer(advertised_host(address[0] if address else "127.0.0.1"))
        me = Member(
            rank=rank,
            world_size=world,
            name=self._me,
            cluster=_canonical(resolver),
            pid=os.getpid(),
            host=socket.gethostname(),
            liveness=self._liveness.address,
        )
        members = exchange_over_group(
            me,
            device="cuda" if self.backend == "nccl" else "cpu",
            all_gather=lambda record: self.all_gather(record, what="the roll call"),
        )
        self._peers = {m.rank: m.liveness for m in members if m.rank != rank}
        self.barrier(what="the end of start-up")
        self._watch_exit()

    def _release_group(self) -> None:
        """Leave the group to the library that started it (Ray destroys it at shutdown)."""


class GroupCommunicator(Communicator):
    """Collectives among some of a job's processes (one dimension of a mesh), over the job's
    connection: the same named operations, timeouts and lost-peer diagnosis.

    ``rank`` and ``world_size`` are within the group. ``broadcast`` alone spans the whole job,
    from the job's chief: what the chief draws (a shuffle seed) must reach the processes of
    every group alike. ``is_chief`` is the job's chief, not each group's first process.
    """

    def __init__(self, job: ProcessGroupCommunicator, group: dist.ProcessGroup) -> None:
        self._job = job
        self._made_in_round = job.round
        self._group_itself = group
        self._ranks: list[int] = dist.get_process_group_ranks(group)
        self.rank = self._ranks.index(job.rank)
        self.world_size = len(self._ranks)

    def _live_group(self) -> dist.ProcessGroup:
        """The group, while the job's group it was made from lives (an elastic rebuild
        replaces that one, not this)."""
        if self._job.round != self._made_in_round:
            raise StaleGroupError(
                f"a group of ranks {self._ranks} made in round {self._made_in_round} was used "
                f"in round {self._job.round} on {self._job.peer_name(self._job.rank)}: groups "
                "and meshes are not rebuilt in place; only strategies without them rebuild"
            )
        return self._group_itself

    @property
    def is_chief(self) -> bool:
        return self._job.is_chief

    def peer_name(self, rank: int) -> str:
        return self._job.peer_name(self._ranks[rank])

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, what: str) -> None:
        g, moved = self._live_group(), self._job.on_group(tensor)
        launch = lambda: dist.all_reduce(moved, op.to_dist(), group=g, async_op=True)  # noqa: E731
        self.traffic.count("all_reduce", moved.nbytes, self.world_size)
        self._job._run("all_reduce", what, launch, (moved,))
        if op is ReduceOp.MEAN:
            moved.div_(self.world_size)
        if moved is not tensor:
            tensor.copy_(moved)

    def all_reduce_async(self, tensor: torch.Tensor, *, what: str) -> PendingOp:
        g, moved = self._live_group(), self._job.on_group(tensor)
        launch = lambda: dist.all_reduce(moved, group=g, async_op=True)  # noqa: E731
        self.traffic.count("all_reduce", moved.nbytes, self.world_size)
        work = self._job._launch("all_reduce", what, launch, (moved,))
        staged = (tensor, moved) if moved is not tensor else None
        return _Pending(self._job, work, "all_reduce", what, staged)

    def all_to_all_async(
        self, output: torch.Tensor, tensor: torch.Tensor, *, what: str
    ) -> PendingOp:
        g = self._live_group()
        launch = lambda: dist.all_to_all_single(output, tensor, group=g, async_op=True)  # noqa: E731
        self.traffic.count("all_to_all", tensor.nbytes, self.world_size)
        work = self._job._launch("all_to_all", what, launch, (output, tensor))
        return _Pending(self._job, work, "all_to_all", what)

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, *, what: str) -> None:
        g = self._live_group()
        launch = lambda: dist.all_gather_single(output, tensor, group=g, async_op=True)  # noqa: E731
        self.traffic.count("all_gather", tensor.nbytes, self.world_size)
        self._job._run("all_gather", what, launch, (output, tensor))

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, what: str) -> None:
        if src != 0:
            raise ValueError(
                f"a group's broadcast comes from the job's chief (src=0), got src={src}"
            )
        self._live_group()  # a group of an earlier round is refused here too
        self._job.broadcast(tensor, 0, what=what)

    def all_gather(self, tensor: torch.Tensor, *, what: str) -> list[torch.Tensor]:
        source, g = self._job.on_group(tensor).contiguous(), self._live_group()
        out = [torch.empty_like(source) for _ in range(self.world_size)]
        launch = lambda: dist.all_gather(out, source, group=g, async_op=True)  # noqa: E731
        self.traffic.count("all_gather", source.nbytes, self.world_size)
        self._job._run("all_gather", what, launch, (source, *out))
        return [o.to(tensor.device) for o in out]

    def barrier(self, *, what: str) -> None:
        flag, g = self._job.on_group(torch.zeros(1)), self._live_group()
        launch = lambda: dist.all_reduce(flag, group=g, async_op=True)  # noqa: E731
        self._job._run("barrier", what, launch, (flag,))

    def named_faults(self, operation: str, *, what: str) -> contextlib.AbstractContextManager[None]:
        return self._job.named_faults(operation, what=what)


# What the transports say when a peer is gone, stuck or unreachable. gloo raises plain
# RuntimeErrors that carry its source file ("[.../gloo/transport/tcp/pair.cc:553] Connection
# closed by peer [127.0.0.1]:25754", "... Timed out waiting 60000ms for recv operation");
# NCCL, the store and torch's own network code raise DistError's subclasses.
_TRANSPORT_WORDS = (
    "gloo",
    "nccl",
    "connection closed",
    "connection reset",
    "connection refused",
    "broken pipe",
    "socket",
    "timed out",
    "timeout",
)


def _explained(error: BaseException, answers: dict[int, PeerState | None]) -> bool:
    """Whether the peers' answers (or the error itself, a timeout) say why a collective failed:
    a peer ended, silent, unreachable or timed out itself."""
    text = str(error).lower()
    if "timed out" in text or "timeout" in text:
        return True
    return any(a is None or a.status != "running" for a in answers.values())


def is_communication_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective's transport failing (so the peers may be why), as
    opposed to an error of this process's own computation, which is reported as itself."""
    if isinstance(error, (PeerLostError, CollectiveTimeoutError, dist.DistError)):
        return True  # a lost peer an inner layer saw (a pipeline's transfer), named here
    if isinstance(error, StratagemError):
        return False  # ours, about this process (an operator DTensor cannot shard, say)
    text = str(error).lower()
    return any(word in text for word in _TRANSPORT_WORDS)


def underlying_error(error: BaseException, lost: Sequence[str] = ()) -> str:
    """The gist of a torch/gloo error: its first line, without gloo's source location and
    its advice to read the remote worker's log (we name the worker instead).

    gloo names the far end of its own connection (``Read error [127.0.0.1]:54957``), on a port
    gloo picked, which is none of the job's addresses: the address is said to be that, and
    whose it is when one peer was lost (``lost``: the names of the lost tasks)."""
    text = str(error).strip().splitlines()
    line = text[0] if text else type(error).__name__
    line = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", line)
    line = line.split(". This is typically caused by")[0].rstrip(".")
    owner = f"{lost[0]}'s" if len(lost) == 1 else "a peer's"
    return re.sub(
        r"\[[^\]\s]+\]:\d+",
        lambda m: (
            f"{m.group(0)} ({owner} gloo connection, on a port of gloo's own, not its "
            "address in the cluster)"
        ),
        line,
        count=1,
    )


def _canonical(resolver: Resolver) -> str:
    """A compact, order-independent description of the cluster, compared at the roll call."""
    spec = resolver.cluster_spec()
    as_dict = spec.as_dict() if hasattr(spec, "as_dict") else {}
    parts = []
    for job in sorted(as_dict):
        tasks = as_dict[job]
        if isinstance(tasks, dict):
            tasks = [tasks[k] for k in sorted(tasks)]
        parts.append(f"{job}={len(tasks)}")
    return ",".join(parts) or f"world={resolver.world_size}"


_connect_lock = threading.Lock()
# The connection this process started. torch.distributed's default group is process-wide, so
# a second strategy (or a mesh) of the same job shares it rather than starting another.
# Strategies hold their own communicator; this is only where ``connect`` finds the open one.
_live: ProcessGroupCommunicator | None = None


def default_backend(device_type: str) -> str:
    """gloo for CPU tensors; NCCL for CUDA tensors with gloo beside it for CPU-side objects."""
    if device_type == "cuda":
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def use_local_gpu(resolver: Resolver) -> int | None:
    """Make this process's local rank's GPU the current device and return its index; None where
    there is no GPU. It must be set before an NCCL group starts: NCCL's communicator, FSDP2's
    shards and every tensor made with ``device="cuda"`` use it, and it is cuda:0 in every
    process until set."""
    if not (torch.cuda.is_available() and torch.cuda.device_count() > 0):
        return None
    index = resolver.local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return index


def live_connection() -> ProcessGroupCommunicator | None:
    """The connection ``connect`` opened in this process, while it is open."""
    return _live


def new_groups(
    rank_lists: Sequence[Sequence[int]], *, timeout: float | None = None
) -> list[dist.ProcessGroup]:
    """A process group for each list of ranks, in order, its connections proven with the job's
    secret where this process is a member (``prove_group``): a group made after start-up opens
    new gloo connections, and none is used unproven. Every process of the job calls it with the
    same lists (torch.distributed's rule); ``timeout`` (seconds) bounds the groups' operations
    (torch's default without it)."""
    extra = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    groups = [dist.new_group(list(ranks), **extra) for ranks in rank_lists]
    me = dist.get_rank()
    _prove([g for g, ranks in zip(groups, rank_lists) if me in ranks])
    return groups


def new_device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """torch's ``init_device_mesh`` over the job, each dimension's group proven with the job's
    secret (as ``new_groups``'); every process calls it alike."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    _prove([mesh.get_group(dim) for dim in range(len(shape))])
    return mesh


def _prove(groups: list[dist.ProcessGroup]) -> None:
    """This process's new groups challenged in order (nothing where stratagem started no
    connection, or adopted one without its secret)."""
    job = live_connection()
    for group in groups if job is not None else ():
        job.prove_group(group)


def connect(
    resolver: Resolver, *, backend: str = "gloo", timeouts: Timeouts | None = None
) -> Communicator:
    """The process's communicator for this cluster, started on first use and then shared."""
    global _live
    with _connect_lock:
        current = _live
        if current is not None:
            if current.world_size != resolver.world_size or current.rank != resolver.rank:
                raise RendezvousError(
                    f"this process already belongs to a job as rank {current.rank} of "
                    f"{current.world_size}; it cannot also be {resolver.describe()}"
                )
            return current
        if resolver.world_size == 1 and resolver.rendezvous_address is None:
            return LocalCommunicator()
        if dist.is_initialized():
            # Someone else started the default group (Ray Train does, before the train function
            # runs): join it as it is rather than start a second one on its port.
            _live = AdoptedGroupCommunicator(resolver, timeouts=timeouts or Timeouts.from_env())
            return _live
        _live = ProcessGroupCommunicator(
            resolver, backend=backend, timeouts=timeouts or Timeouts.from_env()
        )
        return _live


@contextlib.contextmanager
def without_backward_context() -> Iterator[None]:
    """Launch a collective without backward's Python context in its captured thread state.

    ``backward()`` stashes a ``contextvars.Context`` in torch's thread-local state while it
    runs, and a gloo Work launched from an autograd hook captures that state; releasing it then
    needs the GIL wherever the Work dies, a gloo thread included (see ``_recent_works``).
    """
    if not torch._C._is_key_in_tls("context"):
        yield
        return
    saved = torch._C._get_obj_in_tls("context")
    torch._C._remove_obj_from_tls("context")
    try:
        yield
    finally:
        torch._C._stash_obj_in_tls("context", saved)
