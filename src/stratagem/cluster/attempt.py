"""One attempt at a local cluster job: start every task, stream its output, watch, stop.

Every task runs in its own session and process group, so that stopping a task also stops what
it started and a terminal's Ctrl-C reaches only the launcher, which forwards it. The first
failure decides the attempt, after a grace period in which the survivors may report the lost
peer themselves.

When the launcher's own output is a terminal, the chief's output is a terminal too (a pty), as
under torchrun or plain python: its progress bar is drawn in place (``\r``) and the launcher
shows each redraw as it comes, with the chief's prefix. The other tasks write to pipes, whose
output is shown line by line.
"""

from __future__ import annotations

import codecs
import fcntl
import json
import math
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, Any, TextIO

from stratagem.cluster.tasks import INCARNATION_VARIABLE, Task, count_tasks, plural

#: Seconds a task gets between SIGTERM and SIGKILL when the launcher stops it.
KILL_TIMEOUT_S = 5.0
_POLL_S = 0.05
# A line longer than this is printed in pieces, so a task writing binary without newlines cannot
# make the launcher buffer without bound.
_MAX_LINE_BYTES = 1 << 20
# How long to wait for a task's output to end after the task is gone; only a process that left
# the task's process group (its own setsid) can hold the pipe open longer.
_READER_JOIN_S = 2.0
_CLEAR_TO_END = "\x1b[K"  # ANSI: erase from the cursor to the end of the line


@dataclass(frozen=True)
class Outcome:
    """How one attempt ended: ``exit_code`` 0 on success, else what the launcher should return."""

    exit_code: int
    reason: str


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
    """Whole lines to the launcher's stdout (task output) and stderr (its own messages), and on
    a terminal one line drawn in place (a task's progress bar, ``task_draw``).

    One lock for both streams: on a terminal they meet, and lines must never mix mid-line. A
    line printed while another is drawn in place goes above it: the drawn line is erased, the
    line printed, and the drawn line drawn again below.
    """

    def __init__(self, out: TextIO, err: TextIO) -> None:
        self.out = out
        self.err = err
        self._lock = threading.Lock()
        self._closed: set[int] = set()
        self._drawn: tuple[str, str] | None = None  # (prefix, text) of the line drawn in place

    @property
    def is_terminal(self) -> bool:
        """Whether task output goes to a terminal (where a chief's progress bar can be live)."""
        try:
            return bool(self.out.isatty())
        except (AttributeError, OSError, ValueError):
            return False

    def task_line(self, prefix: str, text: str) -> None:
        self._line(self.out, prefix, text)

    def task_draw(self, prefix: str, text: str) -> None:
        """Draw ``prefix + text`` in place of the line drawn before (no newline): a task's
        ``\r`` redraw of its unfinished line."""
        with self._lock:
            self._drawn = (prefix, text)
            self._write(self.out, f"\r{prefix}{text}{_CLEAR_TO_END}")

    def log(self, message: str) -> None:
        self._line(self.err, "[stratagem] ", f"{message}\n")

    def _line(self, stream: TextIO, prefix: str, text: str) -> None:
        with self._lock:
            drawn = self._drawn
            if drawn is None:
                self._write(stream, prefix + text)
            elif stream is self.out and drawn[0] == prefix:  # the drawn line's own end
                self._drawn = None
                self._write(stream, f"\r{prefix}{text.rstrip(chr(10))}{_CLEAR_TO_END}\n")
            else:  # another line: above the drawn one, which is drawn again below it
                self._write(self.out, f"\r{_CLEAR_TO_END}")
                self._write(stream, prefix + text)
                self._write(self.out, drawn[0] + drawn[1])

    def _write(self, stream: TextIO, text: str) -> None:
        """Write and flush (the caller holds the lock)."""
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


def _pump_terminal(fd: int, prefix: str, console: Console) -> None:
    """Copy a task's terminal output (the master side of its pty) to the console: whole lines
    as ``_pump``, and every ``\r`` redraw of an unfinished line (a progress bar) as it comes,
    until every writer has closed the terminal."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pending = ""
    shown = ""  # the unfinished line's text last drawn, not drawn twice in a row
    try:
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:  # EIO: the last writer closed the terminal (Linux)
                break
            if not chunk:
                break
            pending += decoder.decode(chunk)
            *lines, pending = pending.split("\n")
            for line in lines:
                *draws, last = line.rstrip("\r").split("\r")
                for draw in draws:
                    if draw and draw != shown:
                        console.task_draw(prefix, draw)
                console.task_line(prefix, last + "\n")
                shown = ""
            *draws, pending = pending.split("\r")
            for draw in [*draws, pending]:
                if draw and draw != shown:
                    console.task_draw(prefix, draw)
                    shown = draw
            if len(pending) > _MAX_LINE_BYTES:  # no newline in sight: a piece, as _pump's
                console.task_line(prefix, pending + "\n")
                pending = ""
        pending += decoder.decode(b"", final=True)
        if pending:
            console.task_line(prefix, pending + "\n")
    finally:
        os.close(fd)


def _open_terminal(out: TextIO, prefix: str) -> tuple[int, int]:
    """A pty for a task's output: (master, slave). It passes bytes as written (no ``\n`` to
    ``\r\n``), and has the launcher's terminal's size less the prefix, for tools that fit
    their bars to it."""
    master, slave = pty.openpty()
    try:
        attrs = termios.tcgetattr(slave)
        attrs[1] &= ~termios.OPOST
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
    except (OSError, termios.error):
        os.close(master)
        os.close(slave)
        raise OSError("cannot set up the pty") from None
    try:
        size = fcntl.ioctl(out.fileno(), termios.TIOCGWINSZ, b"\0" * 8)
        rows, cols, *_ = struct.unpack("HHHH", size)
        if cols:
            size = struct.pack("HHHH", rows, max(20, cols - len(prefix)), 0, 0)
            fcntl.ioctl(slave, termios.TIOCSWINSZ, size)
    except (AttributeError, OSError, ValueError):
        pass  # not a real terminal's stream: the pty keeps its default size
    return master, slave


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
    incarnation: int = 1  # 2 and up: the launcher restarted this task alone


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


@dataclass(frozen=True)
class TaskStates:
    """Where a job's tasks stand (``Job.poll``): failures in the order they happened, with
    their status as ``Popen.returncode``; tasks the launcher stopped are in none of the lists."""

    running: list[Task]
    finished: list[Task]
    failed: list[tuple[Task, int]]


def _cluster_has_chief(tasks: Sequence[Task]) -> bool:
    """Whether the tasks' cluster (their TF_CONFIG, which the launcher wrote) has a chief; the
    tasks themselves say so when they carry none."""
    for task in tasks:
        try:
            cluster = json.loads(task.env.get("TF_CONFIG", "")).get("cluster", {})
        except (ValueError, AttributeError):
            continue
        return isinstance(cluster, dict) and "chief" in cluster
    return any(t.type == "chief" for t in tasks)


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
        restart_workers: int = 0,
        remote: Callable[[], Outcome | None] | None = None,
        min_workers: int = 0,
    ) -> None:
        self.tasks = list(tasks)
        # What decides the attempt from outside this node (another node's failure, node 0's
        # word): polled as the tasks' exits are, and decides as a failure here would.
        self.remote = remote
        # Asynchronous parameter-server training goes on without a lost worker (not the chief).
        self.tolerate_worker_loss = tolerate_worker_loss
        # ... while at least this many workers are left (``-n MIN:MAX`` of a ps job).
        self.min_workers = min_workers
        # A coordinator's worker that fails is restarted alone, up to this many times each.
        self.restart_workers = restart_workers
        self._restarts: dict[str, int] = {}  # task name -> times restarted
        self._lost: list[_Running] = []
        self.target = list(target)
        self.grace_period = grace_period
        self.python = python
        self.kill_timeout = kill_timeout
        self.console = console or Console(sys.stdout, sys.stderr)
        self.interrupts = interrupts or Interrupts()
        self._running: list[_Running] = []
        self._failures: list[_Running] = []  # in the order they happened; the first decides
        self._stopped = False
        # Whether the job has a chief, perhaps on another node of a multi-node job: then no
        # worker here is the chief, whatever this launcher's own tasks are.
        self._has_chief = _cluster_has_chief(self.tasks)

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start every task; print ``<task> pid <pid> at <address>`` for each."""
        for task in self.tasks:
            running = self._spawn(task, dict(task.env))
            self._running.append(running)
            self.console.log(f"{task.name} pid {running.proc.pid} at {task.address}")

    def _is_chief(self, task: Task) -> bool:
        """The task that prints the job's progress: the chief, else worker 0."""
        if task.type == "chief":
            return True
        return task.type == "worker" and task.index == 0 and not self._has_chief

    def _spawn(self, task: Task, env: dict[str, str], incarnation: int = 1) -> _Running:
        prefix = f"[{task.name}] "
        terminal = None
        if self.console.is_terminal and self._is_chief(task):
            # A terminal for the chief, as it would have without the launcher: its progress
            # bar is drawn live (a pipe would make it print the finished line only).
            try:
                terminal = _open_terminal(self.console.out, prefix)
            except OSError as e:  # no pty left on this machine: a pipe, as for the others
                self.console.log(f"no terminal for {task.name} ({e}); its output is piped")
        if terminal is not None:
            master, slave = terminal
            try:
                proc = subprocess.Popen(
                    [self.python, *self.target],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=slave,
                    stderr=slave,
                    start_new_session=True,  # no controlling terminal: Ctrl-C stays ours
                )
            except BaseException:
                os.close(master)
                raise
            finally:
                os.close(slave)
            target: Any = _pump_terminal
            source: Any = master
        else:
            proc = subprocess.Popen(
                [self.python, *self.target],
                env=env,
                stdin=subprocess.DEVNULL,  # N tasks reading one terminal would steal its input
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,  # one pipe keeps the order of stdout and stderr lines
                start_new_session=True,  # its own process group: pid == pgid
            )
            assert proc.stdout is not None
            target, source = _pump, proc.stdout
        reader = threading.Thread(
            target=target,
            args=(source, prefix, self.console),
            name=f"stratagem-output-{task.name}",
            daemon=True,  # an escaped grandchild holding the pipe must not keep us alive
        )
        running = _Running(task, proc, reader, incarnation=incarnation)
        running.watcher = threading.Thread(
            target=_watch_exit, args=(running,), name=f"stratagem-exit-{task.name}", daemon=True
        )
        reader.start()
        running.watcher.start()
        return running

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
            # A worker is restarted only while the attempt is undecided: not once the job ends.
            self._collect_exits(restart=outcome is None)
            if outcome is None:
                outcome = self._decide()
                if outcome is None and self.remote is not None:
                    outcome = self.remote()
                    if outcome is not None:
                        self.console.log(f"the attempt ends on another node: {outcome.reason}")
                if outcome is not None:
                    deadline = time.monotonic() + self.grace_period
                    waiting = [r for r in self._running if r.status is None]
                    if waiting:
                        own = "its own" if len(waiting) == 1 else "their own"
                        self.console.log(
                            f"giving {self._names(waiting)} up to {self.grace_period:g} s to "
                            f"exit on {own}"
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

    def _collect_exits(self, *, restart: bool = False) -> None:
        """Take in the exits the watchers saw since the last call, in the order they happened;
        with ``restart``, a coordinator's worker that failed is restarted if it may be."""
        restarting: list[_Running] = []
        exits = []
        for r in self._running:
            seen = r.exit  # read once: a watcher may set it at any moment
            if r.status is None and seen is not None:
                exits.append((seen, r))
        for (_, status), r in sorted(exits, key=lambda e: e[0][0]):
            r.status = status
            if r.stopped:
                self.console.log(f"{r.task.name} stopped: {describe_status(r.status)}")
            elif r.status != 0 and restart and self._may_restart(r):
                restarting.append(r)
            elif r.status != 0 and self._may_lose(r):
                why = (
                    f"{plural(self.min_workers, 'worker')} or more left"
                    if self.min_workers
                    else "--tolerate-worker-loss"
                )
                self.console.log(
                    f"{r.task.name} was lost: {describe_status(r.status)}; the job goes on "
                    f"without it ({why})"
                )
                self._lost.append(r)
            elif r.status != 0:
                self.console.log(f"{r.task.name} failed: {describe_status(r.status)}")
                self._failures.append(r)
            else:
                self.console.log(f"{r.task.name} exited 0")
        for r in restarting:
            self._restart(r)

    def set_aside(self, task: Task) -> None:
        """Count a failed task as lost, no longer a failure of the job (its peers went on in
        place without it: the elastic agent's decision)."""
        for r in list(self._failures):
            if r.task is task:
                self._failures.remove(r)
                self._lost.append(r)

    def pids(self) -> list[int]:
        """The tasks' process ids, in the order of ``tasks``."""
        return [r.proc.pid for r in self._running]

    def poll(self) -> TaskStates:
        """Take in the exits seen so far and say where every task stands (for a caller that
        decides itself what a failure means: the elastic agent)."""
        self._collect_exits()
        return TaskStates(
            running=[r.task for r in self._running if r.status is None],
            finished=[r.task for r in self._running if r.status == 0 and not r.stopped],
            failed=[(r.task, r.status) for r in self._failures if r.status is not None],
        )

    def _may_restart(self, r: _Running) -> bool:
        """Whether a failed task is a parameter-server job's worker to restart alone, with
        restarts left: a worker of a job whose chief (or, without one, worker 0, which hosts
        the rendezvous) still runs (a restart after its end would wait for a rendezvous that
        is gone)."""
        if r.task.type != "worker" or self._restarts.get(r.task.name, 0) >= self.restart_workers:
            return False
        chiefs = [
            c
            for c in self._running
            if c.task.type == "chief"
            or (not self._has_chief and c.task.type == "worker" and c.task.index == 0)
        ]
        return r not in chiefs and bool(chiefs) and all(c.status is None for c in chiefs)

    def _restart(self, r: _Running) -> None:
        """Start task ``r`` again, alone, as its next incarnation: the same address and
        TF_CONFIG, so it rejoins the running job under its rank (``comm.rendezvous.reclaim``)."""
        count = self._restarts[r.task.name] = self._restarts.get(r.task.name, 0) + 1
        assert r.status is not None
        self.console.log(
            f"{r.task.name} failed: {describe_status(r.status)}; restarting it alone "
            f"(restart {count} of {self.restart_workers}, --restart-workers)"
        )
        # What it left behind goes too; then it is reaped, joined, and replaced in the list.
        _signal_group(r.proc.pid, signal.SIGKILL)
        r.watcher.join()
        r.proc.wait()
        r.reader.join(_READER_JOIN_S)
        incarnation = r.incarnation + 1
        env = {**r.task.env, INCARNATION_VARIABLE: str(incarnation)}
        new = self._spawn(r.task, env, incarnation)
        self._running[self._running.index(r)] = new
        self.console.log(
            f"{r.task.name} restarted (incarnation {incarnation}): pid {new.proc.pid} at "
            f"{r.task.address}"
        )

    def _decide(self) -> Outcome | None:
        failed = self._failures[0] if self._failures else None
        if failed is not None:
            assert failed.status is not None
            reason = f"{failed.task.name} failed: {describe_status(failed.status)}"
            return Outcome(exit_code_of(failed.status), reason)
        # A restarted worker does not hold the job's end: it rejoined a running chief, and it
        # stops when the chief says goodbye (or ends), within the grace period.
        active = [r for r in self._running if r not in self._lost]
        leaders = [
            r
            for r in active
            if r.task.type in ("chief", "worker") and (r.incarnation == 1 or r.status is not None)
        ]
        if not any(r.task.type in ("chief", "worker") for r in active):
            # A node of a multi-node job without chief or workers (or whose workers were all
            # lost): its ps and evaluator tasks end on their own (a ps when every worker said
            # goodbye, an evaluator after its last evaluation); the chief is another node's.
            leaders = active
        if all(r.status == 0 for r in leaders):
            lost = f" ({plural(len(self._lost), 'worker')} lost)" if self._lost else ""
            done = f"{count_tasks(r.task for r in leaders)} exited 0" if leaders else "no task left"
            return Outcome(0, f"{done}{lost}")
        return None

    def _may_lose(self, r: _Running) -> bool:
        """Whether a failed task is a worker the job may go on without: never the chief, and
        never below ``min_workers`` workers left."""
        if not self.tolerate_worker_loss or r.task.type != "worker" or r.stopped:
            return False
        if not (self._has_chief or r.task.index != 0):
            return False
        left = sum(
            1
            for o in self._running
            if o.task.type == "worker"
            and o is not r
            and o not in self._lost
            and o.status in (None, 0)
        )
        if left < self.min_workers:
            self.console.log(
                f"{r.task.name} was lost: {describe_status(r.status or 0)}; "
                f"{plural(left, 'worker')} left, fewer than the {self.min_workers} the job needs"
            )
            return False
        return True

    @staticmethod
    def _names(running: Iterable[_Running]) -> str:
        return ", ".join(r.task.name for r in running)
