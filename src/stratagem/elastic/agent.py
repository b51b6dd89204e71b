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

import hashlib
import hmac
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
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from stratagem.cluster.attempt import (
    Console,
    Interrupts,
    Job,
    Outcome,
    describe_status,
    exit_code_of,
)
from stratagem.cluster.job_secret import SECRET_VARIABLE, key_for, new_secret
from stratagem.cluster.tasks import (
    CONFLICTING_ENV,
    CONFLICTING_ENV_PREFIXES,
    LaunchError,
    Task,
    free_ports,
    plural,
)
from stratagem.cluster.torchrun import ELASTIC_CHANGE_VARIABLE, ELASTIC_ROUND_VARIABLE
from stratagem.comm.rendezvous import open_store

_MONITOR_S = 0.05
_STORE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class WorkerRange:
    """``-n MIN:MAX``: the job runs while at least ``minimum`` workers live, up to ``maximum``."""

    minimum: int
    maximum: int

    @classmethod
    def parse(cls, text: str) -> WorkerRange:
        low, sep, high = text.partition(":")
        try:
            minimum, maximum = int(low), int(high if sep else low)
        except ValueError:
            raise LaunchError(
                f"expected a number of workers N or a range MIN:MAX (as torchrun's --nnodes), "
                f"got {text!r}"
            ) from None
        if not 1 <= minimum <= maximum:
            raise LaunchError(
                f"a range of workers needs 1 <= MIN <= MAX, got {text!r} (MIN={minimum}, "
                f"MAX={maximum})"
            )
        return cls(minimum, maximum)

    def __str__(self) -> str:
        return f"{self.minimum}:{self.maximum}"


def run_id_for(secret: str) -> str:
    """The rendezvous's run id: derived from the job's secret, so outsiders cannot guess it."""
    return hmac.new(key_for(secret.encode(), "rdzv-run-id"), b"", hashlib.sha256).hexdigest()[:16]


def _sealed_handler(host: str, port: int, secret: str, *, nodes: int) -> RendezvousHandler:
    """Torch's dynamic rendezvous (c10d backend) on this node's store, sealed with ``secret``:
    every join, leave and heartbeat is a sealed compare-and-set, so a state written without
    the secret is refused before torch unpickles it."""
    store = open_store(
        host,
        port,
        is_server=True,
        timeout_s=_STORE_TIMEOUT_S,
        owner="the elastic agent",
        me="the elastic agent",
        secret=secret.encode(),
    )
    run_id = run_id_for(secret)
    params = RendezvousParameters(
        backend="stratagem",
        endpoint=f"{host}:{port}",
        run_id=run_id,
        min_nodes=nodes,
        max_nodes=nodes,
        join_timeout="60",
        last_call_timeout="1",
        close_timeout="10",
    )
    return create_handler(store, C10dRendezvousBackend(store, run_id), params)


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
    ) -> None:
        super().__init__(spec, exit_barrier_timeout=60)
        self.workers = workers
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
        self._rounds = 0
        self._change = ""  # what the last membership change was, for the next round's workers

    # ------------------------------------------------------------------ rounds

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        # One number per round, from the round's rank 0 (which hosts the store, so it counts
        # every round the store has seen) through the round's own store: every node's workers
        # of this round meet under it, apart from any earlier round's.
        store = worker_group.store
        if worker_group.group_rank == 0:
            store.set("stratagem/round", str(self._rounds))
        self._round = store.get("stratagem/round").decode()
        self._rounds += 1

    # ------------------------------------------------------------------ workers

    def _worker_env(self, worker_group: WorkerGroup, worker: Any) -> dict[str, str]:
        spec = worker_group.spec
        env = {
            key: value
            for key, value in self.base_env.items()
            if key not in CONFLICTING_ENV and not key.startswith(CONFLICTING_ENV_PREFIXES)
        }
        env.update(
            PYTHONUNBUFFERED="1",
            STRATAGEM_LAUNCHER="1",
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
        if self._change:
            env[ELASTIC_CHANGE_VARIABLE] = self._change
        return env

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        tasks = [
            Task("worker", w.global_rank, self.host, self._worker_env(worker_group, w))
            for w in worker_group.workers
        ]
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
            if result.state == WorkerState.FAILED and not self._membership_change():
                self._stop_workers(self._worker_group)
                return result

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
) -> Outcome:
    """Run ``python *target`` as an elastic job of ``workers`` workers on this machine."""
    python = python or sys.executable
    console = console or Console(sys.stdout, sys.stderr)
    env = dict(os.environ if base_env is None else base_env)
    secret = env.get(SECRET_VARIABLE, "").strip() or new_secret()
    env[SECRET_VARIABLE] = secret
    if omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    (port,) = free_ports(1)
    handler = _sealed_handler(host, port, secret, nodes=1)
    spec = WorkerSpec(
        role="worker",
        local_world_size=workers.maximum,
        rdzv_handler=handler,
        entrypoint=python,
        args=tuple(target),
        max_restarts=max_restarts,
        monitor_interval=_MONITOR_S,
        master_addr=host,
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
        )
        console.log(
            f"elastic job: {plural(workers.maximum, 'worker')} (-n {workers}, "
            f"--max-restarts {max_restarts}) on torch's elastic agent: {command}"
        )
        agent.run()
    outcome = agent.outcome or Outcome(1, "the elastic agent ended without a result")
    verb = "finished" if outcome.exit_code == 0 else "failed"
    console.log(f"job {verb}: {outcome.reason}")
    return outcome
