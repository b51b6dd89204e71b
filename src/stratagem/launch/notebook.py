"""``notebook_launcher(fn, args=(), num_workers=2)``: a local N-worker cluster from a function.

As Accelerate's ``notebook_launcher``, the workers are forked from the calling process, so
``fn`` may be defined in a notebook cell, in ``python -c`` or in a script without an
``if __name__ == "__main__":`` guard: nothing is pickled and nothing re-imports ``__main__``
(what the "spawn" start method would need). Each worker gets its own TF_CONFIG on free loopback
ports, so ``sg.distribute.MultiWorkerMirroredStrategy()`` inside ``fn`` finds its cluster as
under ``stratagem run``; its stdout and stderr are shown in the caller's output (a notebook
cell's) line by line with a ``[worker i]`` prefix. When a worker fails, the others get a grace
period to report the lost peer themselves, then are stopped, and ``WorkerFailedError`` names the
worker, its exit status and its last error line. Nothing is returned: a value would have to
cross back from another process.

POSIX only (``fork``). Call it before the notebook runs any torch computation or CUDA: a forked
child inherits the parent's thread pools and devices half-started (Accelerate has the same rule).
"""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from stratagem.cluster.job_secret import SECRET_VARIABLE, given_secret, new_secret
from stratagem.cluster.tasks import CONFLICTING_ENV, build_tf_configs, free_ports
from stratagem.errors import StratagemError

#: Seconds the surviving workers get to notice a failed peer and exit by themselves.
GRACE_PERIOD_S = 5.0
_KILL_WAIT_S = 5.0


class WorkerFailedError(StratagemError, RuntimeError):
    """A worker of ``notebook_launcher`` exited with an error; the others were stopped."""


def notebook_launcher(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    num_workers: int = 2,
    *,
    grace_period: float = GRACE_PERIOD_S,
) -> None:
    """Run ``function(*args)`` in ``num_workers`` forked workers of one local cluster."""
    if not callable(function):
        raise TypeError(f"notebook_launcher needs a function, got {type(function).__name__}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be a whole number of 1 or more, got {num_workers!r}")
    if not hasattr(os, "fork"):
        raise RuntimeError("notebook_launcher forks its workers, which this platform cannot do")
    addresses = [f"localhost:{port}" for port in free_ports(num_workers)]
    secret = new_secret()
    configs = build_tf_configs({"worker": addresses})
    threads = max(1, (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))
    threads = max(1, threads // num_workers)
    out = sys.stdout  # a notebook cell's output, where the workers' lines go
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # or the children would print the parent's buffered text again
    workers: list[_Worker] = []
    try:
        for index in range(num_workers):
            workers.append(
                _Worker.fork(index, configs["worker", index], threads, secret, function, args, out)
            )
        _wait(workers, grace_period)
    finally:
        for worker in workers:
            worker.stop()


class _Worker:
    """One forked worker: its pid (also its process group), and the thread that shows its output."""

    def __init__(self, index: int, pid: int, reader: threading.Thread, last: list[str]) -> None:
        self.index = index
        self.pid = pid
        self.reader = reader
        self.last = last  # its last output lines, for the error message
        self.status: int | None = None

    @property
    def name(self) -> str:
        return f"worker {self.index}"

    @classmethod
    def fork(
        cls,
        index: int,
        tf_config: str,
        threads: int,
        secret: str,
        function: Callable[..., Any],
        args: Sequence[Any],
        out: Any,
    ) -> _Worker:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker: never returns
            os.close(read_end)
            _run_worker(write_end, tf_config, threads, secret, function, args)
        os.close(write_end)
        last: list[str] = []
        reader = threading.Thread(
            target=_show, args=(read_end, f"[worker {index}] ", out, last), daemon=True
        )
        reader.start()
        return cls(index, pid, reader, last)

    def poll(self) -> int | None:
        """Its exit status once it has exited (128 + signal when killed), else None."""
        if self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
                if self.status < 0:
                    self.status = 128 - self.status
        return self.status

    def stop(self) -> None:
        """Stop it and what it started (its process group), then reap it and its output."""
        if self.poll() is None:
            _signal_group(self.pid, signal.SIGTERM)
            deadline = time.monotonic() + _KILL_WAIT_S
            while self.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.poll() is None:
                _signal_group(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                self.status = 128 + signal.SIGKILL
        _signal_group(self.pid, signal.SIGKILL)  # anything it left behind in its group
        self.reader.join(timeout=_KILL_WAIT_S)


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _run_worker(
    write_end: int,
    tf_config: str,
    threads: int,
    secret: str,
    function: Callable[..., Any],
    args: Sequence[Any],
) -> None:
    """In the forked child: its own group, its cluster, its output to the pipe; then exit."""
    code = 1
    try:
        os.setpgid(0, 0)  # a group of its own, so that stopping it stops what it started
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the notebook's interrupt is the parent's
        os.dup2(write_end, 1)
        os.dup2(write_end, 2)
        os.close(write_end)
        # A notebook's sys.stdout is the kernel's socket, which belongs to the parent.
        sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), line_buffering=True)
        sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0), line_buffering=True)
        for name in CONFLICTING_ENV:
            os.environ.pop(name, None)
        os.environ.update(TF_CONFIG=tf_config, STRATAGEM_RESTART_COUNT="0")
        if not given_secret():
            # This cluster's own secret, which only its workers hold (stratagem run's rule).
            os.environ[SECRET_VARIABLE] = secret
        os.environ["OMP_NUM_THREADS"] = str(threads)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(threads)
        function(*args)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            _close_connection(failed=code != 0)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            # Not sys.exit: the parent's atexit handlers and finalizers (a notebook kernel's)
            # must not run in a copy of it.
            os._exit(code)


def _close_connection(*, failed: bool) -> None:
    """End this worker's part in the job as a normal exit would (atexit does not run here)."""
    if "stratagem.comm.process_group" not in sys.modules:
        return
    from stratagem.comm import process_group

    connection = process_group.live_connection()
    if connection is not None:
        if failed:
            process_group.mark_failing()
        connection.shutdown()


def _show(fd: int, prefix: str, out: Any, last: list[str]) -> None:
    """Copy a worker's output to ``out`` line by line with its prefix; keep its last lines."""
    with os.fdopen(fd, "rb") as pipe:
        for raw in pipe:
            text = raw.decode("utf-8", errors="replace").rstrip("\n")
            last.append(text)
            del last[:-20]
            try:
                out.write(prefix + text + "\n")
                out.flush()
            except (OSError, ValueError):
                pass


def _wait(workers: list[_Worker], grace_period: float) -> None:
    """Until every worker has exited; on the first failure, the grace period, then stop all."""
    failed: _Worker | None = None
    failed_at = 0.0
    while True:
        running = [w for w in workers if w.poll() is None]
        if failed is None:
            failed = next((w for w in workers if w.poll() not in (None, 0)), None)
            failed_at = time.monotonic()
        if not running:
            break
        if failed is not None and time.monotonic() - failed_at >= grace_period:
            break
        time.sleep(0.05)
    if failed is None:
        return
    for worker in workers:
        worker.stop()
    error = next((line for line in reversed(failed.last) if line and not line.startswith(" ")), "")
    others = [f"{w.name} ({_describe(w.status)})" for w in workers if w is not failed]
    raise WorkerFailedError(
        f"{failed.name} {_describe(failed.status)}"
        + (f": {error}" if error else "")
        + (f"; the others: {', '.join(others)}" if others else "")
    )


def _describe(status: int | None) -> str:
    if status is None:
        return "still running"
    if status > 128:
        try:
            return f"killed by {signal.Signals(status - 128).name}"
        except ValueError:
            pass
    return f"exited {status}"
