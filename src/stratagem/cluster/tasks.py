"""The tasks of a local cluster job: their roles, free loopback addresses and TF_CONFIGs.

Pure data and environment building: nothing here starts a process (``attempt.py`` does).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from stratagem.cluster.job_secret import SECRET_FILE_VARIABLE, SECRET_VARIABLE, new_secret
from stratagem.cluster.resolver import env_int
from stratagem.errors import StratagemError

#: Task types in the order they are started and listed, named as in TF_CONFIG.
TASK_TYPES = ("chief", "worker", "ps", "evaluator")
#: Variables set by an enclosing launcher (torchrun, an outer stratagem) that would contradict
#: the TF_CONFIG given to each task: a resolver could read them instead.
CONFLICTING_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_NAME",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "STRATAGEM_CONFIG",
    "STRATAGEM_TASK_INCARNATION",  # a task of ours restarted alone: its own tasks start as 1
)
CONFLICTING_ENV_PREFIXES = ("TORCHELASTIC_",)
#: Set by the launcher in a task it restarted alone (2, 3, ...): the task rejoins the running
#: job under its rank as that incarnation (``comm.rendezvous.reclaim``). Unset: 1.
INCARNATION_VARIABLE = "STRATAGEM_TASK_INCARNATION"
#: Set by the launcher in every task of a job whose workers it restarts alone (R of
#: ``--restart-workers R``): a coordinator that lost every worker waits for one to rejoin.
RESTART_WORKERS_VARIABLE = "STRATAGEM_RESTART_WORKERS"


class LaunchError(StratagemError, ValueError):
    """The arguments of a launch are invalid; nothing was started."""


@dataclass(frozen=True)
class Task:
    """One process of the job: its role in the cluster, its address, its full environment."""

    type: str
    index: int
    address: str
    env: Mapping[str, str] = field(repr=False)

    @property
    def name(self) -> str:
        # A job has at most one chief and one evaluator: "[evaluator]", not "[evaluator 0]".
        return self.type if self.type in ("chief", "evaluator") else f"{self.type} {self.index}"


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 or noun == "ps" else f"{n} {noun}s"


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Pick ``count`` distinct free TCP ports by binding to port 0 on ``host``.

    All sockets stay open until every port is picked, so the OS cannot hand out one port twice.
    They are closed before the tasks start, so another program could take a port in between;
    the task that then fails to bind fails the attempt, which a restart retries on new ports.
    """
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def build_tf_configs(cluster: Mapping[str, Sequence[str]]) -> dict[tuple[str, int], str]:
    """TF_CONFIG (JSON) of every task of ``cluster`` (job name -> addresses), by (type, index).

    Jobs without tasks are left out of the cluster, as TensorFlow writes it.
    """
    spec = {job: list(addresses) for job, addresses in cluster.items() if addresses}
    return {
        (job, index): json.dumps({"cluster": spec, "task": {"type": job, "index": index}})
        for job, addresses in spec.items()
        for index in range(len(addresses))
    }


@dataclass(frozen=True)
class WorkerRange:
    """``-n MIN:MAX`` (or ``--nnodes MIN:MAX``): the job runs while at least ``minimum`` workers
    (nodes) live, up to ``maximum``."""

    minimum: int
    maximum: int

    @classmethod
    def parse(cls, text: str, *, what: str = "workers") -> WorkerRange:
        low, sep, high = text.partition(":")
        try:
            minimum, maximum = int(low), int(high if sep else low)
        except ValueError:
            raise LaunchError(
                f"expected a number of {what} N or a range MIN:MAX (as torchrun's --nnodes), "
                f"got {text!r}"
            ) from None
        if not 1 <= minimum <= maximum:
            raise LaunchError(
                f"a range of {what} needs 1 <= MIN <= MAX, got {text!r} (MIN={minimum}, "
                f"MAX={maximum})"
            )
        return cls(minimum, maximum)

    def __str__(self) -> str:
        return f"{self.minimum}:{self.maximum}"


def launched_env(base: Mapping[str, str]) -> dict[str, str]:
    """What a process the launcher starts inherits: ``base`` without conflicting launcher
    variables (an enclosing torchrun's, an outer stratagem's), plus the launcher's own marks."""
    env = {
        key: value
        for key, value in base.items()
        if key not in CONFLICTING_ENV and not key.startswith(CONFLICTING_ENV_PREFIXES)
    }
    env.update(
        PYTHONUNBUFFERED="1",  # lines reach the launcher when printed, not when a buffer fills
        STRATAGEM_LAUNCHER="1",
    )
    return env


def task_env(
    base: Mapping[str, str], tf_config: str, restart: int, omp_threads: int | None
) -> dict[str, str]:
    """The environment of one task: ``launched_env(base)`` with its TF_CONFIG and attempt."""
    env = launched_env(base)
    env.update(TF_CONFIG=tf_config, STRATAGEM_RESTART_COUNT=str(restart))
    if omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    return env


def task_incarnation(environ: Mapping[str, str]) -> int:
    """This task's incarnation: 1, or the launcher's count when it restarted the task alone."""
    value = env_int(environ, INCARNATION_VARIABLE, minimum=1, default=1)
    assert value is not None
    return value


def restart_workers_of(environ: Mapping[str, str]) -> int:
    """How many times the launcher restarts each worker alone (0: it does not)."""
    value = env_int(environ, RESTART_WORKERS_VARIABLE, minimum=0, default=0)
    assert value is not None
    return value


def listen_address(host: str) -> str:
    """The address the tasks will listen on (their own: see ``comm/binding.py``), where their
    ports must be free: a port free on 127.0.0.1 may be taken on a routable address."""
    try:
        address = socket.gethostbyname(host)
    except OSError as e:
        raise LaunchError(
            f"--host {host!r} does not resolve ({e}); expected a name or address of this machine"
        ) from None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
    except OSError as e:
        raise LaunchError(
            f"--host {host!r} resolves to {address}, which is not an address of this machine "
            f"({e}); the tasks listen on their own address"
        ) from None
    return address


def make_tasks(
    counts: Mapping[str, int],
    *,
    host: str = "localhost",
    restart: int = 0,
    base_env: Mapping[str, str] | None = None,
    omp_threads: int | None = None,
) -> list[Task]:
    """The tasks of one attempt: ``counts[type]`` tasks of each type, on fresh free ports."""
    unknown = sorted(set(counts) - set(TASK_TYPES))
    if unknown:
        raise LaunchError(f"unknown task types {unknown}, expected some of {list(TASK_TYPES)}")
    ports = iter(free_ports(sum(counts.values()), listen_address(host)))
    cluster = {
        job: [f"{host}:{next(ports)}" for _ in range(counts.get(job, 0))] for job in TASK_TYPES
    }
    configs = build_tf_configs(cluster)
    base = dict(os.environ if base_env is None else base_env)
    if not (base.get(SECRET_VARIABLE, "").strip() or base.get(SECRET_FILE_VARIABLE, "").strip()):
        # A fresh secret for each attempt, which only this attempt's tasks hold; a secret the
        # user gave (a job whose other tasks another launcher starts) is kept.
        base[SECRET_VARIABLE] = new_secret()
    return [
        Task(job, index, address, task_env(base, configs[job, index], restart, omp_threads))
        for job in TASK_TYPES
        for index, address in enumerate(cluster[job])
    ]


def count_tasks(tasks: Iterable[Task]) -> str:
    """``2 workers``, ``1 chief and 2 workers``, ``2 workers, 2 ps and 1 evaluator``."""
    counts = dict.fromkeys(TASK_TYPES, 0)
    for task in tasks:
        counts[task.type] += 1
    parts = [plural(n, job) for job, n in counts.items() if n]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
