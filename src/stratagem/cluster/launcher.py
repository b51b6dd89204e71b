"""Run a script as a TF_CONFIG cluster of local processes (``stratagem run``).

Every task (chief, workers, parameter servers, an evaluator) is ``python script args`` with its
own ``TF_CONFIG``, in its own session and process group, so that stopping a task also stops what
it started and a terminal's Ctrl-C reaches only the launcher, which forwards it. The launcher
streams each task's output with a prefix, stops the whole job when one task fails (after a grace
period in which the survivors may report the lost peer themselves), and restarts it when asked.

POSIX only (sessions, process groups, ``waitid``). It imports nothing heavy itself (no torch),
so that it starts fast and depends on nothing it launches.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, TextIO

from stratagem.errors import StratagemError

#: Task types in the order they are started and listed, named as in TF_CONFIG.
TASK_TYPES = ("chief", "worker", "ps", "evaluator")
#: Seconds a task gets between SIGTERM and SIGKILL when the launcher stops it.
KILL_TIMEOUT_S = 5.0
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
)
CONFLICTING_ENV_PREFIXES = ("TORCHELASTIC_",)

_POLL_S = 0.05
# A line longer than this is printed in pieces, so a task writing binary without newlines cannot
# make the launcher buffer without bound.
_MAX_LINE_BYTES = 1 << 20
# How long to wait for a task's output to end after the task is gone; only a process that left
# the task's process group (its own setsid) can hold the pipe open longer.
_READER_JOIN_S = 2.0


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


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 or noun == "ps" else f"{n} {noun}s"


@dataclass(frozen=True)
class Outcome:
    """How one attempt ended: ``exit_code`` 0 on success, else what the launcher should return."""

    exit_code: int
    reason: str


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


def task_env(
    base: Mapping[str, str], tf_config: str, restart: int, omp_threads: int | None
) -> dict[str, str]:
    """The environment of one task: ``base`` without conflicting launcher variables, plus ours."""
    env = {
        key: value
        for key, value in base.items()
        if key not in CONFLICTING_ENV and not key.startswith(CONFLICTING_ENV_PREFIXES)
    }
    env.update(
        TF_CONFIG=tf_config,
        PYTHONUNBUFFERED="1",  # lines reach the launcher when printed, not when a buffer fills
        STRATAGEM_RESTART_COUNT=str(restart),
        STRATAGEM_LAUNCHER="1",
    )
    if omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    return env


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
    ports = iter(free_ports(sum(counts.values())))
    cluster = {
        job: [f"{host}:{next(ports)}" for _ in range(counts.get(job, 0))] for job in TASK_TYPES
    }
    configs = build_tf_configs(cluster)
    base = os.environ if base_env is None else base_env
    return [
        Task(job, index, address, task_env(base, configs[job, index], restart, omp_threads))
        for job in TASK_TYPES
        for index, address in enumerate(cluster[job])
    ]


def describe_status(returncode: int) -> str:
    """``exit code 3`` or ``killed by signal 9 (SIGKILL)``, from a ``Popen.returncode``."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:  # a real-time signal has no name
        return f"killed by signal {-returncode}"
    return f"killed by signal {-returncode} ({name})"


def exit_code_of(returncode: int) -> int:
    """The launcher's exit code for a task's status: the code, or 128 + signal as shells do."""
    return returncode if returncode >= 0 else 128 - returncode


class Interrupts:
    """SIGINT, SIGTERM and SIGHUP received by the launcher.

    The handler only records the signal and takes no lock: it runs between two bytecodes of the
    main thread, possibly while that thread holds the very lock. The watch loops poll it.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.signum: int | None = None  # the first signal received
        self.count = 0

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
        self.count += 1

    @contextmanager
    def installed(self) -> Iterator[Interrupts]:
        """Handle the signals while in the block (only possible in the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {signum: signal.signal(signum, self) for signum in self.SIGNALS}
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


class Console:
    """Whole lines to the launcher's stdout (task output) and stderr (its own messages).

    One lock for both streams: on a terminal they meet, and lines must never mix mid-line.
    """

    def __init__(self, out: TextIO, err: TextIO) -> None:
        self.out = out
        self.err = err
        self._lock = threading.Lock()
        self._closed: set[int] = set()

    def task_line(self, prefix: str, text: str) -> None:
        self._write(self.out, prefix + text)

    def log(self, message: str) -> None:
        self._write(self.err, f"[stratagem] {message}\n")

    def _write(self, stream: TextIO, text: str) -> None:
        with self._lock:
            if id(stream) in self._closed:
                return
            try:
                try:
                    stream.write(text)
                except UnicodeEncodeError:  # a terminal that cannot show the replacement character
                    stream.write(text.encode("ascii", "backslashreplace").decode("ascii"))
                stream.flush()
            except (OSError, ValueError):
                # Nobody reads any more (`stratagem run ... | head`): drop the output, but keep
                # draining the tasks' pipes so that they do not block on a full pipe.
                self._closed.add(id(stream))


def _pump(pipe: IO[bytes], prefix: str, console: Console) -> None:
    """Copy a task's output to the console line by line, until every writer has closed it."""
    with pipe:
        for raw in iter(lambda: pipe.readline(_MAX_LINE_BYTES), b""):
            text = raw.decode("utf-8", errors="replace")
            if not text.endswith("\n"):  # the last line without newline, or a piece of a long one
                text += "\n"
            console.task_line(prefix, text)


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass  # the group is empty (macOS answers EPERM when only a zombie is left)


@dataclass(eq=False)
class _Running:
    task: Task
    proc: subprocess.Popen[bytes]
    reader: threading.Thread  # copies the output
    watcher: threading.Thread = field(init=False)  # sets `exit` when the task exits
    exit: tuple[float, int] | None = None  # (time.monotonic(), status), set by the watcher
    status: int | None = None  # as Popen.returncode, once the watch loop has seen the exit
    stopped: bool = False  # the launcher signalled it: its exit is no failure of its own


def _watch_exit(running: _Running) -> None:
    # One thread per task that blocks until it exits records when it did: two tasks dying within
    # one poll of the watch loop are still told apart, and the first failure is the true first.
    running.exit = (time.monotonic(), _wait_without_reaping(running.proc))


def _wait_without_reaping(proc: subprocess.Popen[bytes]) -> int:
    """Wait for a task to exit; return its status as ``Popen.returncode`` would be.

    The task stays unreaped (a zombie) where the OS allows: it keeps its pid, hence its
    process-group id, so no unrelated process can get that id before ``Job.stop`` has signalled
    the group, which also reaps it.
    """
    if not hasattr(os, "waitid"):  # macOS before Python 3.13: reap, accepting the tiny window
        return proc.wait()
    info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    assert info is not None  # only None with WNOHANG
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


class Job:
    """One attempt at running every task: start, stream output, watch, stop what remains.

    Use as a context manager: leaving the block stops every task still running, reaps every
    process and joins the output threads, whatever happened in between.
    """

    def __init__(
        self,
        tasks: Sequence[Task],
        target: Sequence[str],
        *,
        grace_period: float = 5.0,
        python: str = sys.executable,
        console: Console | None = None,
        interrupts: Interrupts | None = None,
        kill_timeout: float = KILL_TIMEOUT_S,
        tolerate_worker_loss: bool = False,
    ) -> None:
        self.tasks = list(tasks)
        # Asynchronous parameter-server training goes on without a lost worker (not the chief).
        self.tolerate_worker_loss = tolerate_worker_loss
        self._lost: list[_Running] = []
        self.target = list(target)
        self.grace_period = grace_period
        self.python = python
        self.kill_timeout = kill_timeout
        self.console = console or Console(sys.stdout, sys.stderr)
        self.interrupts = interrupts or Interrupts()
        self._running: list[_Running] = []
        self._first_failure: _Running | None = None
        self._stopped = False

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start every task; print ``<task> pid <pid> at <address>`` for each."""
        for task in self.tasks:
            proc = subprocess.Popen(
                [self.python, *self.target],
                env=dict(task.env),
                stdin=subprocess.DEVNULL,  # N tasks reading one terminal would steal its input
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,  # one pipe keeps the order of stdout and stderr lines
                start_new_session=True,  # its own process group: pid == pgid
            )
            assert proc.stdout is not None
            reader = threading.Thread(
                target=_pump,
                args=(proc.stdout, f"[{task.name}] ", self.console),
                name=f"stratagem-output-{task.name}",
                daemon=True,  # an escaped grandchild holding the pipe must not keep us alive
            )
            running = _Running(task, proc, reader)
            running.watcher = threading.Thread(
                target=_watch_exit, args=(running,), name=f"stratagem-exit-{task.name}", daemon=True
            )
            reader.start()
            running.watcher.start()
            self._running.append(running)
            self.console.log(f"{task.name} pid {proc.pid} at {task.address}")

    def wait(self) -> Outcome | None:
        """Watch the tasks until the attempt is decided; None if the launcher was interrupted.

        The first failure decides it: the others get the grace period to exit on their own, so
        that a survivor can print its own error naming the lost peer. Otherwise it succeeds when
        the chief and every worker have exited 0; ps and evaluator tasks, which may serve
        forever, get the grace period too. Whatever still runs then is left to ``stop``.
        """
        outcome: Outcome | None = None
        deadline = math.inf
        while self.interrupts.signum is None:
            self._collect_exits()
            if outcome is None:
                outcome = self._decide()
                if outcome is not None:
                    deadline = time.monotonic() + self.grace_period
                    waiting = self._names(r for r in self._running if r.status is None)
                    if waiting:
                        self.console.log(
                            f"giving {waiting} up to {self.grace_period:g} s to exit on their own"
                        )
            if outcome is not None and (
                all(r.status is not None for r in self._running) or time.monotonic() >= deadline
            ):
                return outcome
            time.sleep(_POLL_S)
        self.console.log(
            f"received {signal.Signals(self.interrupts.signum).name}; stopping the job"
        )
        return None

    def stop(self) -> None:
        """SIGTERM the tasks still running, SIGKILL what remains, reap them, join the output.

        Interrupted, the tasks get the grace period between SIGTERM and SIGKILL; otherwise
        ``kill_timeout``. A second signal to the launcher skips the wait.
        """
        if self._stopped:  # the leaders are reaped: their group ids may belong to others now
            return
        self._stopped = True
        self._collect_exits()
        running = [r for r in self._running if r.status is None]
        if running:
            wait_s = self.grace_period if self.interrupts.signum is not None else self.kill_timeout
            self.console.log(f"stopping {self._names(running)}: SIGTERM")
            for r in running:
                r.stopped = True
                _signal_group(r.proc.pid, signal.SIGTERM)
            interrupts_before = self.interrupts.count
            deadline = time.monotonic() + wait_s
            while (
                any(r.status is None for r in running)
                and time.monotonic() < deadline
                and self.interrupts.count == interrupts_before
            ):
                time.sleep(_POLL_S)
                self._collect_exits()
            left = [r for r in running if r.status is None]
            if left:
                self.console.log(f"{self._names(left)} still running: SIGKILL")
        # Every group, also of tasks that exited: this stops what a task left behind, which would
        # hold its output pipe open. The leaders are not reaped yet, so no group id was reused.
        for r in self._running:
            _signal_group(r.proc.pid, signal.SIGKILL)
        for r in self._running:
            r.watcher.join()  # before reaping: the watcher's waitid needs the zombie
            r.proc.wait()
        self._collect_exits()
        for r in self._running:
            r.reader.join(_READER_JOIN_S)
            if r.reader.is_alive():
                self.console.log(
                    f"output of {r.task.name} still open (a process it started left its process"
                    " group); not waiting for it"
                )

    def _collect_exits(self) -> None:
        """Take in the exits the watchers saw since the last call, in the order they happened."""
        exits = []
        for r in self._running:
            seen = r.exit  # read once: a watcher may set it at any moment
            if r.status is None and seen is not None:
                exits.append((seen, r))
        for (_, status), r in sorted(exits, key=lambda e: e[0][0]):
            r.status = status
            if r.stopped:
                self.console.log(f"{r.task.name} stopped: {describe_status(r.status)}")
            elif r.status != 0 and self._may_lose(r):
                self.console.log(
                    f"{r.task.name} was lost: {describe_status(r.status)}; the job goes on "
                    "without it (--tolerate-worker-loss)"
                )
                self._lost.append(r)
            elif r.status != 0:
                self.console.log(f"{r.task.name} failed: {describe_status(r.status)}")
                self._first_failure = self._first_failure or r
            else:
                self.console.log(f"{r.task.name} exited 0")

    def _decide(self) -> Outcome | None:
        failed = self._first_failure
        if failed is not None:
            assert failed.status is not None
            reason = f"{failed.task.name} failed: {describe_status(failed.status)}"
            return Outcome(exit_code_of(failed.status), reason)
        leaders = [
            r for r in self._running if r.task.type in ("chief", "worker") and r not in self._lost
        ]
        if all(r.status == 0 for r in leaders):
            lost = f" ({_plural(len(self._lost), 'worker')} lost)" if self._lost else ""
            return Outcome(0, f"{_count_tasks(r.task for r in leaders)} exited 0{lost}")
        return None

    def _may_lose(self, r: _Running) -> bool:
        """Whether a failed task is a worker the job may go on without: never the chief."""
        if not self.tolerate_worker_loss or r.task.type != "worker" or r.stopped:
            return False
        has_chief = any(t.type == "chief" for t in self.tasks)
        return has_chief or r.task.index != 0

    @staticmethod
    def _names(running: Iterable[_Running]) -> str:
        return ", ".join(r.task.name for r in running)


def _count_tasks(tasks: Iterable[Task]) -> str:
    """``2 workers``, ``1 chief and 2 workers``, ``2 workers, 2 ps and 1 evaluator``."""
    counts = dict.fromkeys(TASK_TYPES, 0)
    for task in tasks:
        counts[task.type] += 1
    parts = [_plural(n, job) for job, n in counts.items() if n]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _usable_cpus() -> int:
    # The CPUs this process may run on (taskset, cgroup cpusets), not all of the machine's.
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check_arguments(
    target: Sequence[str],
    *,
    workers: int,
    ps: int,
    max_restarts: int,
    grace_period: float,
    host: str,
    chief: bool = False,
) -> None:
    """Raise ``LaunchError`` for arguments ``launch`` cannot run; it starts nothing before this.

    A job with a chief may have no workers (a chief alone is a job of one, as on Vertex AI).
    """
    if workers < (0 if chief else 1):
        if chief:
            raise LaunchError(f"the number of workers must be 0 or more, got {workers}")
        raise LaunchError(f"the number of workers must be at least 1, got {workers}")
    if ps < 0:
        raise LaunchError(f"the number of ps tasks must be 0 or more, got {ps}")
    if max_restarts < 0:
        raise LaunchError(f"the number of restarts must be 0 or more, got {max_restarts}")
    if not (math.isfinite(grace_period) and grace_period >= 0):
        raise LaunchError(f"the grace period must be 0 or more seconds, got {grace_period}")
    if not host or any(c.isspace() for c in host):
        raise LaunchError(f"the host must be a host name or IP address, got {host!r}")
    if not target:
        raise LaunchError(
            "no script given; expected a script path or -m module, then its arguments"
        )
    if target[0] == "-m":
        if len(target) < 2 or not target[1]:
            raise LaunchError("-m needs a module name, as in -m package.train")
        return
    script = target[0]
    if script.startswith("-"):
        raise LaunchError(f"expected a script path or -m module, got option {script!r}")
    if not os.path.exists(script):
        raise LaunchError(f"script {script!r} not found")
    if os.path.isdir(script):
        raise LaunchError(f"script {script!r} is a directory, expected a Python file")


def launch(
    target: Sequence[str],
    *,
    workers: int = 1,
    ps: int = 0,
    evaluator: bool = False,
    chief: bool = False,
    max_restarts: int = 0,
    grace_period: float = 5.0,
    host: str = "localhost",
    python: str | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
    tolerate_worker_loss: bool = False,
) -> int:
    """Run ``python *target`` as a local cluster job; return the exit code for the launcher.

    With ``tolerate_worker_loss`` (asynchronous parameter-server training), a worker other than
    the chief that fails is reported as lost and the job goes on without it.

    ``target`` is what follows the interpreter: ``["train.py", *args]`` or
    ``["-m", "package.train", *args]``. Returns 0 when the chief and workers exited 0; the
    failed task's exit code (128 + signal when killed) when restarts ran out; 128 + signal when
    the launcher was interrupted. Raises ``LaunchError`` for bad arguments, before starting
    anything.
    """
    return run_job(
        target,
        workers=workers,
        ps=ps,
        evaluator=evaluator,
        chief=chief,
        max_restarts=max_restarts,
        grace_period=grace_period,
        host=host,
        python=python,
        console=Console(out or sys.stdout, err or sys.stderr),
        tolerate_worker_loss=tolerate_worker_loss,
    ).exit_code


def run_job(
    target: Sequence[str],
    *,
    workers: int = 1,
    ps: int = 0,
    evaluator: bool = False,
    chief: bool = False,
    max_restarts: int = 0,
    grace_period: float = 5.0,
    host: str = "localhost",
    python: str | None = None,
    console: Console | None = None,
    base_env: Mapping[str, str] | None = None,
    omp_threads: int | None = None,
    interrupts: Interrupts | None = None,
    tolerate_worker_loss: bool = False,
) -> Outcome:
    """``launch``, returning the job's ``Outcome`` (exit code and reason) instead of the code.

    For callers that run jobs themselves (``sg.jobs.CustomJob``, tuning trials): ``base_env``
    replaces ``os.environ`` as the tasks' environment; ``omp_threads`` sets OMP_NUM_THREADS in
    every task (default: the usable CPUs divided by the tasks, unless ``base_env`` sets it);
    ``interrupts`` stops the job when called (``interrupts(signal.SIGTERM, None)``) from another
    thread, as a signal to the launcher would.
    """
    check_arguments(
        target,
        workers=workers,
        ps=ps,
        max_restarts=max_restarts,
        grace_period=grace_period,
        host=host,
        chief=chief,
    )
    counts = {"chief": int(chief), "worker": workers, "ps": ps, "evaluator": int(evaluator)}
    num_tasks = sum(counts.values())
    base_env = dict(os.environ if base_env is None else base_env)
    if omp_threads is None and "OMP_NUM_THREADS" not in base_env:
        omp_threads = max(1, _usable_cpus() // num_tasks)
    python = python or sys.executable
    console = console or Console(sys.stdout, sys.stderr)
    command = shlex.join([os.path.basename(python), *target])

    # Said once, in the first start message: the one setting the launcher makes for the user.
    omp_note = (
        ""
        if omp_threads is None
        else f"; OMP_NUM_THREADS={omp_threads} in each task ({_plural(_usable_cpus(), 'CPU')} /"
        f" {_plural(num_tasks, 'task')}, to avoid oversubscription; set it to override)"
    )

    with (interrupts or Interrupts()).installed() as interrupts:
        attempt = 0
        while True:
            tasks = make_tasks(
                counts, host=host, restart=attempt, base_env=base_env, omp_threads=omp_threads
            )
            with Job(
                tasks,
                target,
                grace_period=grace_period,
                python=python,
                console=console,
                interrupts=interrupts,
                tolerate_worker_loss=tolerate_worker_loss,
            ) as job:
                try:
                    job.start()
                except OSError as exc:
                    console.log(f"could not start {command}: {exc}")
                    return Outcome(1, f"could not start {command}: {exc}")
                attempts = f" (attempt {attempt + 1} of {max_restarts + 1})" if max_restarts else ""
                console.log(f"started {_count_tasks(tasks)}: {command}{attempts}{omp_note}")
                omp_note = ""
                outcome = job.wait()
            if interrupts.signum is not None:  # the user's stop wins over any outcome
                name = signal.Signals(interrupts.signum).name
                console.log(f"job stopped: received {name}")
                return Outcome(128 + interrupts.signum, f"stopped: received {name}")
            assert outcome is not None
            if outcome.exit_code == 0:
                console.log(f"job finished: {outcome.reason}")
                return outcome
            if attempt == max_restarts:
                restarts = _plural(max_restarts, "restart")
                console.log(f"job failed: {outcome.reason} (after {restarts})")
                return Outcome(outcome.exit_code, f"{outcome.reason} (after {restarts})")
            attempt += 1
            console.log(f"restarting the job (restart {attempt} of {max_restarts})")
