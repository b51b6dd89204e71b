"""Starting real multi-process clusters from tests: free ports, timeouts, no leftovers.

Every process is started in its own session (process group) so that a timeout or a failed
assertion can stop it and anything it started; ``Cluster`` always does so on exit.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"

# Variables that would make a child join some other cluster than the one we give it.
CLUSTER_VARS = (
    "TF_CONFIG",
    "STRATAGEM_CONFIG",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_STEP_ID",
    "STRATAGEM_RESTART_COUNT",
    "STRATAGEM_TASK_INCARNATION",
    "STRATAGEM_RESTART_WORKERS",
    # The job's secret: a test's job uses this user's own (a local job) unless it gives one.
    "STRATAGEM_JOB_SECRET",
    "STRATAGEM_JOB_SECRET_FILE",
    "STRATAGEM_INSECURE",
)


def free_ports(count: int) -> list[int]:
    """Distinct ports that were free a moment ago (bound to 0, then released)."""
    socks, ports = [], []
    try:
        while len(ports) < count:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def tf_config(workers: list[str], index: int, task_type: str = "worker") -> str:
    return json.dumps({"cluster": {"worker": workers}, "task": {"type": task_type, "index": index}})


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), env.get("PYTHONPATH", "")])
    env.update(extra or {})
    return env


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def check(self, what: str) -> Result:
        assert self.returncode == 0, (
            f"{what} exited {self.returncode}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"
        )
        return self


def _processes() -> list[tuple[int, int, int]]:
    """``(pid, parent, process group)`` of every live process (Linux: read from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found.append((int(entry), int(fields[1]), int(fields[2])))
    return found


def _descendants(pid: int) -> list[int]:
    """Every live process descended from ``pid``."""
    children: dict[int, list[int]] = {}
    for child, parent, _ in _processes():
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class Process:
    """One child in its own process group, with captured output files."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        workdir: Path,
        name: str,
        *,
        merge_output: bool = False,
    ) -> None:
        """``merge_output``: stderr goes to stdout, keeping the order of the two."""
        self.name = name
        self._out = open(workdir / f"{name}.out", "w+")  # noqa: SIM115 - closed in finish()
        self._err = open(workdir / f"{name}.err", "w+")  # noqa: SIM115
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            argv,
            env=env,
            cwd=workdir,
            stdout=self._out,
            stderr=subprocess.STDOUT if merge_output else self._err,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        """Signal the child's process group. Once the child is reaped its pid is free: while a
        process of its group lives the kernel gives that id to no new process, but with the
        group empty a new session leader (a busy machine wraps pid_max) could hold it."""
        if self.proc.returncode is not None and not any(
            group == self.proc.pid for _, _, group in _processes()
        ):
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def end_all(self) -> None:
        """Kill the child's group and the groups of every process it started (a launcher's
        tasks run in sessions of their own: killing the launcher alone would leave them). Only
        while the child lives (not yet reaped): its pid is still its own."""
        leaders = _descendants(self.proc.pid)
        self.kill_group()
        for pid in leaders:
            try:
                if os.getpgid(pid) == pid:
                    os.killpg(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def wait(self, timeout: float) -> Result:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.end_all()
            self.proc.wait(timeout=10)
            raise AssertionError(f"{self.name} did not finish within {timeout}s") from None
        return self.finish(code)

    def finish(self, code: int) -> Result:
        self.kill_group()  # anything the child left behind in its group
        outputs = []
        for f in (self._out, self._err):
            f.flush()
            f.seek(0)
            outputs.append(f.read())
            f.close()
        return Result(code, outputs[0], outputs[1], time.monotonic() - self.started)

    def output_so_far(self) -> str:
        self._out.flush()
        with open(self._out.name) as f:
            return f.read()

    def errors_so_far(self) -> str:
        self._err.flush()
        with open(self._err.name) as f:
            return f.read()


class Cluster:
    """N processes of one script, each with its TF_CONFIG, stopped on exit whatever happens."""

    def __init__(
        self,
        script: Path | str,
        n: int,
        workdir: Path,
        *,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        per_worker_env: list[dict[str, str]] | None = None,
        ports: list[int] | None = None,
    ) -> None:
        self.ports = ports or free_ports(n)
        workers = [f"localhost:{p}" for p in self.ports]
        self.processes: list[Process] = []
        for i in range(n):
            extra = {"TF_CONFIG": tf_config(workers, i), **(env or {})}
            if per_worker_env:
                extra.update(per_worker_env[i])
            argv = [sys.executable, str(script), *(args or [])]
            self.processes.append(Process(argv, child_env(extra), workdir, f"worker{i}"))

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.processes:
            if p.proc.poll() is None:
                p.kill_group()
                p.proc.wait(timeout=10)
            p.kill_group()

    def wait(self, timeout: float = 120) -> list[Result]:
        deadline = time.monotonic() + timeout
        return [p.wait(max(1.0, deadline - time.monotonic())) for p in self.processes]


def run_cluster(script: Path | str, n: int, workdir: Path, **kwargs: object) -> list[Result]:
    timeout = float(kwargs.pop("timeout", 120))  # type: ignore[arg-type]
    with Cluster(script, n, workdir, **kwargs) as cluster:  # type: ignore[arg-type]
        return cluster.wait(timeout)


# ``stratagem run``'s cluster for a coordinator with one worker: a chief, the worker, a ps.
ONE_WORKER_COORDINATOR = ("--chief", "-n", "1", "--ps", "1")


def launch_checks(script: Path, out: Path, mode: str, *cluster: str, done: str) -> None:
    """``stratagem run CLUSTER script mode out`` (a worker script of checks run by the
    launcher, each task its role); checks that the job exited 0 and printed ``done``."""
    argv = [sys.executable, "-m", "stratagem.cli", "run", *cluster, str(script), mode, str(out)]
    result = Process(argv, child_env(), out, "launcher", merge_output=True).wait(timeout=300)
    assert result.returncode == 0, result.stdout
    assert done in result.stdout, result.stdout
