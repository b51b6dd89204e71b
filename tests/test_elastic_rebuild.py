"""Survivors keep their processes: the default group abandoned and rebuilt in place for a new
elastic round (``ProcessGroupCommunicator.rebuild``, ``comm.elastic_member``).

The multi-process tests start gloo workers with torchrun's environment and ``STRATAGEM_ELASTIC=1``
around a store this test hosts (as the elastic agent hosts it); no launcher. The reference for
each sum is a hand computation: every worker contributes 2**(its first rank), a newcomer 8.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cluster_utils import WORKERS, Process, child_env, free_ports
from stratagem.cluster import TorchrunClusterResolver
from stratagem.comm.binding import TRANSPORT_INTERFACE_VARIABLES
from stratagem.comm.elastic_member import admit, continue_without, ranks_after_loss
from stratagem.comm.liveness import probe
from stratagem.comm.process_group import (
    WAIT_SLICE_S,
    GroupCommunicator,
    ProcessGroupCommunicator,
    Timeouts,
)
from stratagem.errors import MembershipChanged, RendezvousError, StaleGroupError

SCRIPT = WORKERS / "elastic_rebuild.py"
# Every collective's own timeout: far longer than any test below may take, so that no verdict
# can be reached by waiting it out.
OP_TIMEOUT = 60.0
TEST_LIMIT_S = 40.0


class Job:
    """Workers of one elastic job around a store hosted here; every child ended on exit."""

    def __init__(self, workdir: Path, port: int) -> None:
        self.workdir, self.port = workdir, port
        self.processes: list[Process] = []
        self.deadline = time.monotonic() + TEST_LIMIT_S

    def start(self, rank: int, world: int, name: str, **extra: str) -> Process:
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "STRATAGEM_ELASTIC": "1",
            "OP_TIMEOUT": str(OP_TIMEOUT),
            **extra,
        }
        process = Process([sys.executable, str(SCRIPT)], child_env(env), self.workdir, name)
        self.processes.append(process)
        return process

    def wait_for(self, process: Process, pattern: str) -> re.Match[str]:
        """The first line of ``process``'s output matching ``pattern``, once it is there."""
        while True:
            found = re.search(pattern, process.output_so_far(), re.MULTILINE)
            if found:
                return found
            if process.proc.poll() is not None or time.monotonic() > self.deadline:
                raise AssertionError(
                    f"{process.name} printed no {pattern!r} (exit {process.proc.poll()}):\n"
                    f"{process.output_so_far()}\n{process.errors_so_far()}"
                )
            time.sleep(0.02)

    def in_second_step(self, process: Process) -> None:
        """Wait until ``process`` is in its second all-reduce (its liveness server says so)."""
        address = self.wait_for(process, r"^READY \d+ (\S+)$").group(1)
        self.wait_for(process, r"^SUM ")
        while True:
            state = probe(address, timeout=2.0)
            if state and re.fullmatch(r"#\d+ \(all_reduce of the step\)", state.position):
                return
            assert time.monotonic() < self.deadline, f"{process.name} is at {state}"
            time.sleep(0.02)

    def finish(self, process: Process) -> str:
        result = process.wait(max(1.0, self.deadline - time.monotonic()))
        return result.check(process.name).stdout


@contextmanager
def elastic_job(workdir: Path) -> Iterator[Job]:
    port = free_ports(1)[0]
    timeout = datetime.timedelta(seconds=TEST_LIMIT_S)
    store = dist.TCPStore("127.0.0.1", port, None, True, timeout, wait_for_workers=False)
    job = Job(workdir, port)
    try:
        yield job
    finally:
        for process in job.processes:
            if process.proc.poll() is None:
                process.end_all()
                process.proc.wait(timeout=10)
            process.kill_group()
        del store


def test_survivors_of_a_killed_peer_get_the_named_error_then_rebuild_and_admit_a_newcomer(
    tmp_path,
):
    """Three workers; rank 1 SIGKILLed while the others are in an all-reduce. The survivors get
    ``MembershipChanged`` naming rank 1, rebuild for round 1 as ranks 0 and 1 of 2 (old order
    kept: old rank 2 becomes 1) and all-reduce 1 + 4; then a newcomer joins at round 2 (2 -> 3)
    and the three all-reduce 1 + 4 + 8."""
    with elastic_job(tmp_path) as job:
        workers = [job.start(r, 3, f"worker{r}", VICTIM="1", NEWCOMER="1") for r in range(3)]
        survivors = [workers[0], workers[2]]
        job.wait_for(workers[1], r"^SUM 7\.0")
        for process in survivors:
            job.in_second_step(process)
        os.kill(workers[1].pid, signal.SIGKILL)
        for process in survivors:
            job.wait_for(process, r"^SUM 5\.0 round=1")
        newcomer = job.start(2, 3, "newcomer", JOINING="1", TORCHELASTIC_RESTART_COUNT="2")
        outputs = [job.finish(p) for p in (*survivors, newcomer)]
    for output, new_rank in zip(outputs[:2], (0, 1)):
        lost = re.search(r"^LOST after \S+: (.*)$", output, re.MULTILINE)
        assert lost, output
        # The error names the killed peer (under load a diagnosis may name more: a peer whose
        # liveness probe was slow; the rebuild below is the claim).
        assert "rank 1 of round 0" in lost.group(1) and "lost" in lost.group(1), output
        assert "REBUILT in" in output and f"round=1 rank={new_rank} of=2" in output, output
        assert re.search(rf"^SUM 5\.0 round=1 rank={new_rank} of=2$", output, re.M), output
        assert re.search(rf"^SUM 13\.0 round=2 rank={new_rank} of=3$", output, re.M), output
    assert re.search(r"^SUM 13\.0 round=2 rank=2 of=3$", outputs[2], re.M), outputs[2]


def test_the_agent_s_abandon_frees_survivors_of_a_stopped_peer_before_the_op_timeout(tmp_path):
    """Rank 2 SIGSTOPped while the others wait for it in an all-reduce: gloo would wait the
    whole operation timeout (60 s here). The abandon the agent sends (SIGUSR1 here, which calls
    ``comm.abandon``) makes them leave at once, rebuild for round 1, all-reduce 1 + 2 and exit
    cleanly (rank 2 still stopped), all within this test's own limit (40 s, below the
    operation timeout)."""
    with elastic_job(tmp_path) as job:
        workers = [job.start(r, 3, f"worker{r}", VICTIM="2") for r in range(3)]
        survivors = workers[:2]
        job.wait_for(workers[2], r"^SUM 7\.0")
        for process in survivors:
            job.in_second_step(process)
        os.kill(workers[2].pid, signal.SIGSTOP)
        abandoned = time.monotonic()
        for process in survivors:
            os.kill(process.pid, signal.SIGUSR1)
        for process in survivors:
            job.wait_for(process, r"^SUM 3\.0 round=1")
        took = time.monotonic() - abandoned
        # They end cleanly with rank 2 still stopped: the abandoned group is never joined.
        outputs = [job.finish(p) for p in survivors]
    assert took < OP_TIMEOUT, took
    for rank, output in enumerate(outputs):
        assert re.search(
            r"^LOST after \S+: all_reduce of the step \(operation #\d+\) on rank "
            rf"{rank} of round 0 was abandoned: the agent declared rank 2 lost$",
            output,
            re.M,
        ), output
        assert re.search(rf"^SUM 3\.0 round=1 rank={rank} of=2$", output, re.M), output


# --------------------------------------------------------------------------- in one process


def test_survivors_keep_their_order_in_the_next_round():
    assert ranks_after_loss(4, [1]) == {0: 0, 2: 1, 3: 2}
    assert ranks_after_loss(3, [0, 2]) == {1: 0}
    for world, lost in ((3, []), (3, [3]), (3, [1, 1]), (2, [0, 1]), (3, [True])):
        with pytest.raises(ValueError, match=f"of a world of {world}: expected one or more"):
            ranks_after_loss(world, lost)


class _Member:
    """A communicator stand-in that records the rebuild asked of it."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size, self.round = rank, world_size, 0
        self.asked: dict[str, int] = {}

    def rebuild(self, *, round: int, rank: int, world_size: int) -> None:
        self.asked = {"round": round, "rank": rank, "world_size": world_size}
        self.round, self.rank, self.world_size = round, rank, world_size


def test_a_member_rebuilds_to_its_rank_after_a_loss_or_an_admission():
    member = _Member(3, 4)
    assert continue_without(member, round=1, lost=[0, 2]) == 1
    assert member.asked == {"round": 1, "rank": 1, "world_size": 2}
    admit(member, round=2, newcomers=2)
    assert member.asked == {"round": 2, "rank": 1, "world_size": 4}
    with pytest.raises(ValueError, match="rank 1 is among the lost ranks"):
        continue_without(member, round=3, lost=[1])
    with pytest.raises(ValueError, match="newcomers=0; expected a positive number"):
        admit(member, round=2, newcomers=0)


@contextmanager
def lone_worker(monkeypatch, elastic: str = "1") -> Iterator[ProcessGroupCommunicator]:
    """A job of one process that hosts its own store (elastic or not). It pins gloo's
    interfaces in this process's environment, which every later test's children would inherit
    (loopback: the network-namespace jobs could not reach each other): restored after."""
    monkeypatch.setenv("STRATAGEM_ELASTIC", elastic)
    for variable in TRANSPORT_INTERFACE_VARIABLES:
        monkeypatch.setenv(variable, "")  # set by the communicator; the original comes back
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(free_ports(1)[0])
    comm = ProcessGroupCommunicator(
        TorchrunClusterResolver(environ=env), backend="gloo", timeouts=Timeouts(10.0, 10.0)
    )
    try:
        yield comm
    finally:
        comm.shutdown()


def test_a_group_or_a_pending_collective_of_an_earlier_round_is_refused_by_name(monkeypatch):
    with lone_worker(monkeypatch) as comm:
        group = GroupCommunicator(comm, dist.new_group([0]))
        group.barrier(what="a group's barrier")
        pending = comm.all_reduce_async(torch.ones(1), what="a gradient")
        comm.rebuild(round=1, rank=0, world_size=1)
        with pytest.raises(StaleGroupError, match="started in round 0 and waited in round 1"):
            pending.wait()
        assert comm.round == 1 and comm.peer_name(0) == "rank 0 of round 1"
        with pytest.raises(StaleGroupError, match=r"ranks \[0\] made in round 0 was used in"):
            group.barrier(what="a stale group's barrier")
        comm.barrier(what="the rebuilt group's barrier")  # the job's own group works


def test_a_rebuild_is_refused_for_an_earlier_round_or_outside_an_elastic_job(monkeypatch):
    earlier = pytest.raises(RendezvousError, match=r"expected a round after 0 and a rank in 0\.\.0")
    with lone_worker(monkeypatch) as comm, earlier:
        comm.rebuild(round=0, rank=0, world_size=1)
    outside = pytest.raises(RendezvousError, match="outside an elastic job")
    with lone_worker(monkeypatch, elastic="0") as comm, outside:
        comm.rebuild(round=1, rank=0, world_size=1)


class _TimedWork:
    """A gloo Work as its timed wait behaves (torch's ``Work::wait(timeout)``): each
    ``wait(timeout)`` is one slice, ending unfinished ("Operation timed out!") unless the Work
    fails; ``during_slice(n)`` runs in the n-th; ``done_at`` is the slice at whose end the
    collective completes, just after the wait gave up."""

    def __init__(self, during_slice, done_at: int | None = None, error: str = "") -> None:
        self.during_slice, self.done_at, self.error = during_slice, done_at, error
        self.slices: list[datetime.timedelta] = []
        self.completed = False

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if timeout is None:
            assert self.completed, "a blocking wait on a pending collective: nothing ends it"
            return True
        self.slices.append(timeout)
        self.during_slice(len(self.slices))
        if self.error:
            raise RuntimeError(self.error)
        self.completed = len(self.slices) == self.done_at
        raise RuntimeError("Operation timed out!")

    def is_completed(self) -> bool:
        return self.completed


def test_the_agent_s_word_ends_a_sliced_wait_at_the_end_of_the_slice_it_came_in(monkeypatch):
    """The release the sliced wait exists for, slice by slice: the word comes during the third
    slice and the wait ends as that slice does, each slice ``WAIT_SLICE_S`` long; a collective
    that completes as the slice ends is complete, not abandoned; the collective's own error
    passes through as itself."""
    slice_ = datetime.timedelta(seconds=WAIT_SLICE_S)
    with lone_worker(monkeypatch) as comm:

        def word_in(n: int):
            return lambda i: i == n and comm.abandon("the agent declared rank 2 lost")

        work = _TimedWork(word_in(3))
        with pytest.raises(MembershipChanged, match="on rank 0 of round 0 was abandoned: the "):
            comm._complete(work, "all_reduce of the step")
        assert work.slices == [slice_] * 3
        comm.rebuild(round=1, rank=0, world_size=1)  # clears the word

        work = _TimedWork(word_in(2), done_at=2)
        comm._complete(work, "all_reduce of the step")
        assert work.slices == [slice_] * 2
        comm.rebuild(round=2, rank=0, world_size=1)

        lost = "Connection closed by peer [127.0.0.1]:1234"
        with pytest.raises(RuntimeError, match=re.escape(lost)):
            comm._complete(_TimedWork(lambda i: None, error=lost), "all_reduce of the step")
