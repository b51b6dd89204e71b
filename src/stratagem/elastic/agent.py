"""Elastic jobs on torch's own agent: ``stratagem run -n MIN:MAX script.py``.

``StratagemAgent`` is torch elastic's ``SimpleElasticAgent``: its rounds are torch's dynamic
rendezvous (rank assignment through the round's store, the exit barrier) over the job's store
sealed with the job's secret; its workers are started, streamed and stopped by the launcher's
own ``cluster.attempt.Job``, with torchrun's environment. Where torch restarts every worker and
spends a restart on any failure, ours decides: a worker lost while MIN stay is a membership
change (no restart spent; the job goes on with those left, from the newest checkpoint); with
restarts left (``--max-restarts``) the lost worker is started again instead (the job goes on
with MAX); fewer than MIN left and no restart: the job fails naming the lost worker. Each change
is said by the launcher and, to the workers, in ``STRATAGEM_ELASTIC_CHANGE`` (the chief prints
it where the job resumes). Survivors are started again (torch's way).
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.agent.server.api import (
    DEFAULT_ROLE,
    RunResult,
    SimpleElasticAgent,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)

from stratagem.cluster.attempt import (
    Console,
    Interrupts,
    Job,
    Outcome,
    describe_status,
    exit_code_of,
)
from stratagem.cluster.job_secret import SECRET_VARIABLE, job_secret, new_secret
from stratagem.cluster.tasks import Task, WorkerRange, free_ports, launched_env, plural
from stratagem.cluster.torchrun import ELASTIC_CHANGE_VARIABLE, ELASTIC_ROUND_VARIABLE
from stratagem.comm.elastic_member import (
    IN_PLACE_VARIABLE,
    RoundDecision,
    all_in_place,
    post_decision,
)
from stratagem.comm.process_group import ELASTIC_VARIABLE
from stratagem.elastic.sealed_rendezvous import SealedRendezvous, explain, sealed_handler

_MONITOR_S = 0.05


class StratagemAgent(SimpleElasticAgent):
    """One node's workers as torch elastic's worker group (see the module's docstring)."""

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        workers: WorkerRange,
        target: Sequence[str],
        python: str,
        console: Console,
        interrupts: Interrupts,
        base_env: Mapping[str, str],
        host: str,
        grace_period: float,
        rendezvous: SealedRendezvous,
        nodes: WorkerRange | None = None,
        node_name: str = "this node",
    ) -> None:
        super().__init__(spec, exit_barrier_timeout=60)
        self.workers = workers
        self.rendezvous = rendezvous  # spec's handler, as ours: it tells the round joined
        self.nodes = nodes  # None: a job on this machine alone, whose workers may change
        self.node_name = node_name
        self._members: list[str] = []  # the nodes of the round, by group rank
        self._order: list[str] = []  # this node's workers by rank in the round, by task name
        self._checked_at = 0.0  # when the rendezvous was last asked about waiting nodes
        self._unreachable = False  # the store did not answer the last time it was asked
        self.target = list(target)
        self.python = python
        self.console = console
        self.interrupts = interrupts
        self.base_env = dict(base_env)
        self.host = host
        self.grace_period = grace_period
        self.outcome: Outcome | None = None
        self._job: Job | None = None
        self._round = ""
        self._change = ""  # what the last membership change was, for the next round's workers

    # ------------------------------------------------------------------ rounds

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        # Torch's round, the same on every node and never repeated: each round's workers meet
        # under it in the store, apart from any earlier round's.
        self._round = str(self.rendezvous.round)
        store = worker_group.store
        # The nodes of the round, by name, so that a change can name the node that left.
        store.set(f"stratagem/node/{worker_group.group_rank}", self.node_name)
        names = [f"stratagem/node/{i}" for i in range(worker_group.group_world_size)]
        self._members = [raw.decode() for raw in store.multi_get(names)]

    # ------------------------------------------------------------------ workers

    def _worker_env(self, worker_group: WorkerGroup, worker: Any) -> dict[str, str]:
        spec = worker_group.spec
        env = launched_env(self.base_env)
        env.update(
            LOCAL_RANK=str(worker.local_rank),
            RANK=str(worker.global_rank),
            GROUP_RANK=str(worker_group.group_rank),
            ROLE_RANK=str(worker.role_rank),
            ROLE_NAME=spec.role,
            LOCAL_WORLD_SIZE=str(spec.local_world_size),
            WORLD_SIZE=str(worker.world_size),
            GROUP_WORLD_SIZE=str(worker_group.group_world_size),
            ROLE_WORLD_SIZE=str(worker.role_world_size),
            MASTER_ADDR=str(worker_group.master_addr),
            MASTER_PORT=str(worker_group.master_port),
            TORCHELASTIC_RESTART_COUNT=str(spec.max_restarts - self._remaining_restarts),
            TORCHELASTIC_MAX_RESTARTS=str(spec.max_restarts),
            TORCHELASTIC_RUN_ID=spec.rdzv_handler.get_run_id(),
            TORCHELASTIC_USE_AGENT_STORE="True",
            TORCH_NCCL_ASYNC_ERROR_HANDLING="1",
        )
        env[ELASTIC_ROUND_VARIABLE] = self._round
        env[ELASTIC_VARIABLE] = "1"  # collectives a lost peer can end, groups rebuilt in place
        if self.nodes is None:  # on one machine a lost worker's peers may go on in place
            env[IN_PLACE_VARIABLE] = "1"
        if self._change:
            env[ELASTIC_CHANGE_VARIABLE] = self._change
        return env

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        tasks = [
            Task("worker", w.global_rank, self.host, self._worker_env(worker_group, w))
            for w in worker_group.workers
        ]
        self._order = [t.name for t in tasks]  # the round's ranks, as its workers see them
        self._job = Job(
            tasks,
            self.target,
            grace_period=self.grace_period,
            python=self.python,
            console=self.console,
            interrupts=self.interrupts,
        )
        self._job.start()
        return {w.local_rank: pid for w, pid in zip(worker_group.workers, self._job.pids())}

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        if self._job is not None:
            self._job.stop()

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        assert self._job is not None
        state = self._job.poll()
        if state.failed:
            return RunResult(state=WorkerState.FAILED)
        if not state.running:
            # Torch's bookkeeping (worker events) looks up every worker's return value.
            done = {w.global_rank: None for w in worker_group.workers}
            return RunResult(state=WorkerState.SUCCEEDED, return_values=done)
        return RunResult(state=WorkerState.HEALTHY)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        if self._job is not None:
            self._job.stop()
        self._worker_group.spec.rdzv_handler.shutdown()

    # ------------------------------------------------------------------ the loop

    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """Torch's loop with the rules of the module's docstring: a lost worker is a membership
        change while MIN stay; restarts are spent only on starting workers again."""
        spec = self._worker_group.spec
        self._initialize_workers(self._worker_group)
        while True:
            if self.interrupts.signum is not None:
                name = signal.Signals(self.interrupts.signum).name
                self._stop_workers(self._worker_group)
                self.outcome = Outcome(128 + self.interrupts.signum, f"stopped: received {name}")
                return RunResult(state=WorkerState.FAILED)
            time.sleep(spec.monitor_interval)
            result = self._monitor_workers(self._worker_group)
            self._worker_group.state = result.state
            if result.state == WorkerState.SUCCEEDED:
                self._exit_barrier()
                done = plural(spec.local_world_size, "worker")
                self.outcome = Outcome(0, f"{done} exited 0")
                return result
            if result.state == WorkerState.FAILED:
                changed = self._membership_change() if self.nodes is None else self._node_change()
                if not changed:
                    self._stop_workers(self._worker_group)
                    return result
            elif self.nodes is not None and not self._other_nodes_agree():
                return RunResult(state=WorkerState.FAILED)

    def _other_nodes_agree(self) -> bool:
        """While the workers train (asked once a second: a read of the store): a node waiting
        to join starts a new round (torch's admission, no restart spent); a job another node
        closed ends here too. False when the job ends."""
        now = time.monotonic()
        if now - self._checked_at < 1.0:
            return True
        self._checked_at = now
        handler = self._worker_group.spec.rdzv_handler
        try:
            closed, waiting = handler.is_closed(), handler.num_nodes_waiting()
        except Exception as e:  # torch's RendezvousError or the store's own error, as raised
            # A link cut for a while is not a lost node: the workers' collectives outlast it
            # (TCP retransmits, the operation timeout); only their failure changes the round.
            if not self._unreachable:
                self._unreachable = True
                self.console.log(
                    f"the job's store is unreachable from {self.node_name} ({explain(e)}); "
                    "training goes on while the workers' collectives do"
                )
            return True
        if self._unreachable:
            self._unreachable = False
            self.console.log(f"the job's store is reachable again from {self.node_name}")
        if closed:
            self._stop_workers(self._worker_group)
            self.outcome = Outcome(1, "another node ended the job (its rendezvous is closed)")
            return False
        if waiting > 0:
            before = list(self._members)
            self._next_round("a node asks to join")
            joined = [m for m in self._members if m not in before]
            assert self.nodes is not None  # asked only in a job over several nodes
            count = f"{len(self._members)} of {self.nodes.maximum} nodes"
            self._change = (
                f"{', '.join(joined)} admitted: {count}"
                if joined
                else f"a node started its workers again: a new round with {count}"
            )
            self.console.log(self._change)
            self._start_round()
        return True

    def _next_round(self, why: str) -> None:
        """Stop this node's workers and meet the other nodes in a new round."""
        self._stop_workers(self._worker_group)
        self._worker_group.state = WorkerState.STOPPED
        self.console.log(f"{why}: meeting the other nodes in a new round")
        self._rendezvous(self._worker_group)

    def _start_round(self) -> None:
        ids = self._start_workers(self._worker_group)
        for local_rank, pid in ids.items():
            self._worker_group.workers[local_rank].id = pid
        self._worker_group.state = WorkerState.HEALTHY

    def _node_change(self) -> bool:
        """After a failure of this node's workers in a job over several nodes: meet the others
        in a new round, then decide. Fewer nodes than before: a node was lost, a membership
        change (no restart spent); rounds made without this node: it was left out (a cut
        link) and comes back as a newcomer (no restart spent). Otherwise a failure, which
        spends a restart (each node counts its own, as torch's agents do) or ends the job,
        closing the rendezvous so that every node stops."""
        assert self._job is not None and self.nodes is not None
        spec = self._worker_group.spec
        state = self._job.poll()
        failed = ", ".join(f"{t.name} {describe_status(s)}" for t, s in state.failed)
        first_status = state.failed[0][1]
        before, last_round = list(self._members), int(self._round)
        self._next_round(f"{failed} on {self.node_name}")
        left = [m for m in before if m not in self._members]
        if left:
            self._change = (
                f"continued with {len(self._members)} of {len(before)} nodes; "
                f"{', '.join(left)} lost"
            )
        elif int(self._round) > last_round + 1:
            # Rounds were made without this node (its link was cut past the heartbeat
            # expiry): its workers failed for being left out, and it comes back as any node
            # that joins, admitted without spending a restart.
            count = f"{len(self._members)} of {self.nodes.maximum} nodes"
            self._change = (
                f"{self.node_name} admitted again in round {self._round}: the job went on "
                f"without it since round {last_round}; {count}"
            )
        elif self._remaining_restarts > 0:
            self._remaining_restarts -= 1
            used = spec.max_restarts - self._remaining_restarts
            self._change = (
                f"{failed} on {self.node_name}; its workers started again (restart {used} of "
                f"{spec.max_restarts})"
            )
        else:
            spec.rdzv_handler.set_closed()
            self.outcome = Outcome(
                exit_code_of(first_status),
                f"{failed} on {self.node_name}, with no node lost and no restart left "
                "(--max-restarts): the job ends on every node",
            )
            return False
        self.console.log(self._change)
        self._start_round()
        return True

    def _go_on_in_place(self, lost: list[Task]) -> bool:
        """The workers left go on in their own processes, if each said at its start that it can
        (``elastic_member.offer_in_place``): a new round of torch's rendezvous, and the agent's
        word to them in the job's store (the round and the lost ranks); they rebuild their group
        and redo the step they were in. False: they are started again instead."""
        assert self._job is not None
        gone = [self._order.index(t.name) for t in lost]
        stay = [r for r in range(len(self._order)) if r not in gone]
        store = self.rendezvous.store
        if not all_in_place(store, round=int(self._round), ranks=stay):
            return False
        after = int(self._round)
        self._rendezvous(self._worker_group)  # torch's next round, the same on every node
        why = f"{self._change} (in place)"
        decision = RoundDecision(int(self._round), tuple(gone), why)
        post_decision(store, after=after, decision=decision)
        for task in lost:
            self._job.set_aside(task)
        self._order = [n for n in self._order if n not in {t.name for t in lost}]
        self._change = why
        self.console.log(why)
        return True

    def _membership_change(self) -> bool:
        """After a worker's failure: start the next round (True), or say why the job ends."""
        assert self._job is not None
        spec = self._worker_group.spec
        state = self._job.poll()
        lost = ", ".join(f"{t.name} lost: {describe_status(s)}" for t, s in state.failed)
        before = spec.local_world_size
        left = before - len(state.failed)
        first_status = state.failed[0][1]
        if state.finished:
            # A worker that ended its training cannot train again: a job whose backups are
            # gone with its end (BackupAndRestore deletes them) would start over.
            self.outcome = Outcome(
                exit_code_of(first_status),
                f"{lost} after {plural(len(state.finished), 'worker')} had finished",
            )
            return False
        if self._remaining_restarts > 0:
            self._remaining_restarts -= 1
            used = spec.max_restarts - self._remaining_restarts
            spec.local_world_size = self.workers.maximum
            self._change = (
                f"{lost}; started again with {self.workers.maximum} workers "
                f"(restart {used} of {spec.max_restarts})"
            )
        elif left >= self.workers.minimum:
            spec.local_world_size = left
            self._change = f"continued with {left} of {before} workers; {lost}"
            if self._go_on_in_place([t for t, _ in state.failed]):
                return True
        else:
            self.outcome = Outcome(
                exit_code_of(first_status),
                f"{lost}; {plural(left, 'worker')} left, fewer than the {self.workers.minimum} "
                f"the job needs (-n {self.workers}), and no restart left",
            )
            return False
        self.console.log(self._change)
        self._restart_workers(self._worker_group)
        return True


@dataclass(frozen=True)
class NodePlace:
    """Where this launcher stands in a job over several machines (``--nnodes MIN:MAX``): node
    ``node_rank`` (0 hosts the job's store, at ``master_addr:master_port``)."""

    nodes: WorkerRange
    node_rank: int
    master_addr: str
    master_port: int

    @property
    def name(self) -> str:
        return f"node {self.node_rank}"


def run_elastic(
    target: Sequence[str],
    *,
    workers: WorkerRange,
    max_restarts: int = 0,
    grace_period: float = 5.0,
    host: str = "localhost",
    python: str | None = None,
    console: Console | None = None,
    base_env: Mapping[str, str] | None = None,
    omp_threads: int | None = None,
    place: NodePlace | None = None,
    join_timeout_s: float = 600.0,
) -> Outcome:
    """Run ``python *target`` as an elastic job: ``workers`` workers on this machine, or with
    ``place``, this node's ``workers.maximum`` workers of a job over several machines."""
    python = python or sys.executable
    console = console or Console(sys.stdout, sys.stderr)
    env = dict(os.environ if base_env is None else base_env)
    if omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    if place is None:
        secret: bytes | None = (env.get(SECRET_VARIABLE, "").strip() or new_secret()).encode()
        (port,) = free_ports(1)
        store_host, is_host, name = host, True, "this launcher"
    else:
        name = f"{place.name}'s launcher"
        secret = job_secret([place.master_addr, host], me=name)
        store_host, port, is_host = place.master_addr, place.master_port, place.node_rank == 0
    if secret is not None:
        env[SECRET_VARIABLE] = secret.decode()
    nodes = place.nodes if place is not None else WorkerRange(1, 1)
    # A node whose agent stops beating for 5 s leaves the next round; a cut store is seen
    # within 10 s (each store operation's limit) rather than torch's 60.
    handler = sealed_handler(
        host=store_host,
        port=port,
        is_host=is_host,
        secret=secret,
        run_id=None,
        min_nodes=nodes.minimum,
        max_nodes=nodes.maximum,
        join_timeout_s=join_timeout_s,
        last_call_s=2,
        close_timeout_s=10,
        heartbeat_s=1,
        keep_alive_max_attempt=5,
        read_timeout_s=10,
        where=name,
    )
    spec = WorkerSpec(
        role="worker",
        local_world_size=workers.maximum,
        rdzv_handler=handler,
        entrypoint=python,
        args=tuple(target),
        max_restarts=max_restarts,
        monitor_interval=_MONITOR_S,
        master_addr=store_host,
        master_port=port,
    )
    command = shlex.join([os.path.basename(python), *target])
    with Interrupts().installed() as interrupts:
        agent = StratagemAgent(
            spec,
            workers=workers,
            target=target,
            python=python,
            console=console,
            interrupts=interrupts,
            base_env=env,
            host=host,
            grace_period=grace_period,
            rendezvous=handler,
            nodes=None if place is None else place.nodes,
            node_name="this node" if place is None else place.name,
        )
        where = "" if place is None else f" on {place.name} (--nnodes {place.nodes})"
        count = workers.maximum if place is not None else workers
        console.log(
            f"elastic job: {plural(workers.maximum, 'worker')}{where} (-n {count}, "
            f"--max-restarts {max_restarts}) on torch's elastic agent: {command}"
        )
        agent.run()
    outcome = agent.outcome or Outcome(1, "the elastic agent ended without a result")
    verb = "finished" if outcome.exit_code == 0 else "failed"
    console.log(f"job {verb}: {outcome.reason}")
    return outcome
