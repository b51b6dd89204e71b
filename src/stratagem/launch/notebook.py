"""``notebook_launcher(fn, args=(), num_processes=2)``: a local N-worker cluster from a function.

As Accelerate's, the workers are forked from the caller, so ``fn`` may be defined in a notebook
cell, in ``python -c`` or in a script without a ``__main__`` guard: nothing is pickled. Each
worker gets its own TF_CONFIG on free loopback ports (``MultiWorkerMirroredStrategy()`` finds
its cluster as under ``stratagem run``); its output is shown line by line with a ``[worker i]``
prefix, a traceback as one block. When a worker fails, the others get a grace period, then are
stopped, and ``WorkerFailedError`` names the worker, its exit status and its last error line.
Nothing is returned. Accelerate's ``num_processes`` (or ``num_workers``), ``use_port`` and
``master_addr`` are taken; what the launcher cannot do is refused with
``UnsupportedLaunchOption`` (``num_nodes`` > 1, ``node_rank`` > 0, ``mixed_precision`` not "no").
POSIX only (``fork``); call it before the notebook runs any torch computation or CUDA.
"""

from __future__ import annotations

import io
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from stratagem.cluster.job_secret import SECRET_VARIABLE, given_secret, new_secret
from stratagem.cluster.tasks import (
    CONFLICTING_ENV,
    LaunchError,
    build_tf_configs,
    free_ports,
    listen_address,
)
from stratagem.errors import StratagemError

#: Seconds the surviving workers get to notice a failed peer and exit by themselves.
GRACE_PERIOD_S = 5.0
_KILL_WAIT_S = 5.0


#: Marks a worker's traceback in its output pipe: this line, the traceback's length in bytes,
#: then the traceback, which the launcher shows whole (a NUL starts no line of printed text).
_BLOCK_MARK = b"\x00stratagem-traceback "


class WorkerFailedError(StratagemError, RuntimeError):
    """A worker of ``notebook_launcher`` exited with an error; the others were stopped."""


class UnsupportedLaunchOption(StratagemError, ValueError):
    """An Accelerate ``notebook_launcher`` keyword that stratagem's launcher cannot honour."""


def notebook_launcher(
    function: Callable[..., Any],
    args: Sequence[Any] = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: int | str | None = None,
    master_addr: str | None = None,
    node_rank: int = 0,
    num_nodes: int = 1,
    *,
    num_workers: int | None = None,
    grace_period: float = GRACE_PERIOD_S,
) -> None:
    """Run ``function(*args)`` in ``num_processes`` (default 2) forked workers of one local
    cluster, with Accelerate's keywords (see the module's docstring for which are taken)."""
    if not callable(function):
        raise TypeError(f"notebook_launcher needs a function, got {type(function).__name__}")
    count = _worker_count(num_processes, num_workers)
    _refuse_unsupported(mixed_precision=mixed_precision, node_rank=node_rank, num_nodes=num_nodes)
    if not hasattr(os, "fork"):
        raise RuntimeError("notebook_launcher forks its workers, which this platform cannot do")
    host = "localhost" if master_addr is None else master_addr
    addresses = [f"{host}:{port}" for port in _ports(count, host, use_port)]
    secret = new_secret()
    configs = build_tf_configs({"worker": addresses})
    threads = max(1, (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))
    threads = max(1, threads // count)
    out = sys.stdout  # a notebook cell's output, where the workers' lines go
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # or the children would print the parent's buffered text again
    workers: list[_Worker] = []
    output = _Output(out)
    try:
        for index in range(count):
            workers.append(
                _Worker.fork(
                    index, configs["worker", index], threads, secret, function, args, output
                )
            )
        _wait(workers, grace_period)
    finally:
        for worker in workers:
            worker.stop()


def _worker_count(num_processes: int | None, num_workers: int | None) -> int:
    """The number of workers: Accelerate's ``num_processes`` or stratagem's ``num_workers``."""
    if num_processes is not None and num_workers is not None:
        raise TypeError(
            f"notebook_launcher got num_processes={num_processes!r} and "
            f"num_workers={num_workers!r}; they are one setting, give one of them"
        )
    name, count = (
        ("num_workers", num_workers)
        if num_workers is not None
        else ("num_processes", num_processes)
    )
    if count is None:
        return 2
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"{name} must be a whole number of 1 or more, got {count!r}")
    return count


def _refuse_unsupported(*, mixed_precision: str, node_rank: int, num_nodes: int) -> None:
    """Accelerate's keywords that would change what the job does, and that this launcher
    cannot do: refused by name rather than ignored."""
    if num_nodes != 1:
        raise UnsupportedLaunchOption(
            f"notebook_launcher(num_nodes={num_nodes!r}): stratagem's notebook launcher starts "
            "the workers of this machine only (num_nodes=1); for a job over several machines, "
            "run `stratagem run --nnodes N --node-rank R --master-addr HOST script.py` on each"
        )
    if node_rank != 0:
        raise UnsupportedLaunchOption(
            f"notebook_launcher(node_rank={node_rank!r}): with one machine (num_nodes=1) the "
            "only node is 0; for a job over several machines, run `stratagem run --nnodes N "
            "--node-rank R --master-addr HOST script.py` on each"
        )
    if mixed_precision != "no":
        raise UnsupportedLaunchOption(
            f"notebook_launcher(mixed_precision={mixed_precision!r}): stratagem sets mixed "
            "precision in the training code, not in the launcher; expected 'no', and inside "
            "the function sg.keras.mixed_precision.set_global_policy('mixed_float16') (or "
            "'mixed_bfloat16') for a Keras model, or torch.autocast for a custom loop"
        )


def _ports(count: int, host: str, use_port: int | str | None) -> list[int]:
    """One free port per worker on ``host``; worker 0's is ``use_port`` when given (Accelerate
    gives it as a string, "29500")."""
    try:
        listen = listen_address(host)
    except LaunchError as e:
        raise ValueError(f"notebook_launcher(master_addr={host!r}): {e}") from None
    if use_port is None:
        return free_ports(count, listen)
    text = str(use_port)
    if isinstance(use_port, bool) or not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"use_port must be a port number 1..65535, got {use_port!r}")
    port = int(text)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((listen, port))
        except OSError as e:
            raise ValueError(
                f"notebook_launcher(use_port={use_port!r}): worker 0 cannot listen on "
                f"{host}:{port} ({e.strerror or e}); give a free port, or none for any free one"
            ) from None
        others = free_ports(count - 1, listen)  # while it is held: none of them is the same
    return [port, *others]


class _Output:
    """The caller's output, shared by every worker's reader: one write per line or block, under
    one lock, so that a block (a traceback) is never cut by another worker's lines."""

    def __init__(self, out: Any) -> None:
        self._out = out
        self._lock = threading.Lock()

    def write(self, text: str) -> None:
        with self._lock:
            try:
                self._out.write(text)
                self._out.flush()
            except (OSError, ValueError):
                pass


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
        out: _Output,
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
        _send_traceback(traceback.format_exc())
    finally:
        try:
            _close_connection(failed=code != 0)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            # Not sys.exit: the parent's atexit handlers and finalizers (a notebook kernel's)
            # must not run in a copy of it.
            os._exit(code)


def _send_traceback(text: str) -> None:
    """Send the traceback to the launcher as one marked block, after what was printed before."""
    sys.stdout.flush()
    sys.stderr.flush()
    data = text.encode("utf-8", errors="replace")
    view = _BLOCK_MARK + str(len(data)).encode() + b"\n" + data
    while view:
        view = view[os.write(1, view) :]


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


def _show(fd: int, prefix: str, out: _Output, last: list[str]) -> None:
    """Copy a worker's output to ``out`` with its prefix, line by line, and a marked block (its
    traceback) whole; keep its last lines."""
    with os.fdopen(fd, "rb") as pipe:
        for raw in pipe:
            if raw.startswith(_BLOCK_MARK):
                size = raw[len(_BLOCK_MARK) :].strip()
                if size.isdigit():
                    raw = pipe.read(int(size))
            lines = raw.decode("utf-8", errors="replace").splitlines() or [""]
            last.extend(lines)
            del last[:-20]
            out.write("".join(f"{prefix}{line}\n" for line in lines))


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
