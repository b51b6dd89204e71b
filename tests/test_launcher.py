"""The local launcher: TF_CONFIGs, output streaming, fail-stop, restarts, signals.

Real processes: the launcher runs as ``python -m stratagem.cli run`` on child scripts written to
``tmp_path`` (or, where only its result matters, as ``launch()`` in this process, which starts
faster). Children synchronise through files they write (never sleep-and-hope), and the tests
check afterwards that the processes they started are gone.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from stratagem.cluster import launcher

pytestmark = pytest.mark.e2e

TIMEOUT_S = 60
# Seconds the launcher may take beyond its grace period to stop a job (SIGTERM, reap, exit);
# generous for loaded CI machines, far below anything that would mean a hang.
MARGIN_S = 6

# Written at the top of every child script: its task, and file-based synchronisation.
PRELUDE = """\
import json, os, signal, subprocess, sys, time
from pathlib import Path

TASK = json.loads(os.environ["TF_CONFIG"])["task"]
NAME = f"{TASK['type']}{TASK['index']}"
RESTART = int(os.environ["STRATAGEM_RESTART_COUNT"])

def mark(name, text=""):
    # Write-then-rename, so that a reader never sees a half-written file.
    tmp = Path(f"{name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, name)

def wait_for(*names):
    while not all(os.path.exists(n) for n in names):
        time.sleep(0.01)

def exit_marked(code):
    # The test measures how long the launcher takes to finish from here, not from its own start.
    mark(f"{NAME}.exit", repr(time.time()))
    sys.exit(code)

def serve_forever():
    mark(f"{NAME}.pid", str(os.getpid()))
    while True:
        time.sleep(60)
"""

START_LINE = re.compile(r"^\[stratagem\] (\w+(?: \d+)?) pid (\d+) at (\S+)$", re.MULTILINE)


def write_script(tmp_path: Path, body: str, name: str = "task.py") -> str:
    (tmp_path / name).write_text(PRELUDE + textwrap.dedent(body))
    return name


def base_env(**extra: str) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in launcher.CONFLICTING_ENV
        and not key.startswith(launcher.CONFLICTING_ENV_PREFIXES)
        and key != "OMP_NUM_THREADS"
    }
    env["PYTHONIOENCODING"] = "utf-8"  # the launcher's own stdout, whatever the locale
    env.update(extra)
    return env


def launcher_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "stratagem.cli", "run", *args]


def run_launcher(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        launcher_argv(*args),
        cwd=tmp_path,
        env=env or base_env(),
        capture_output=True,
        encoding="utf-8",
        timeout=TIMEOUT_S,
    )


def started_tasks(stderr: str) -> dict[str, tuple[int, str]]:
    """``{"worker 0": (pid, address), ...}`` from the launcher's start lines (the last attempt)."""
    return {name: (int(pid), address) for name, pid, address in START_LINE.findall(stderr)}


def is_gone(pid: int) -> bool:
    """True if ``pid`` has exited; a zombie nobody has reaped yet counts as exited."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state == "Z"


def wait_until_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    """The pids still alive after ``timeout``; grandchildren are reaped by init, not at once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(is_gone(pid) for pid in pids):
        time.sleep(0.02)
    return [pid for pid in pids if not is_gone(pid)]


def wait_for_files(
    tmp_path: Path, names: list[str], proc: subprocess.Popen[str], timeout: float = 30.0
) -> None:
    deadline = time.monotonic() + timeout
    while not all((tmp_path / name).exists() for name in names):
        assert proc.poll() is None, f"launcher exited early: {proc.communicate()}"
        assert time.monotonic() < deadline, f"no {names} after {timeout} s"
        time.sleep(0.02)


def seconds_since_exit(tmp_path: Path, task: str) -> float:
    """Seconds since ``task`` called ``exit_marked`` (wall clock, shared by all processes)."""
    return time.time() - float((tmp_path / f"{task}.exit").read_text())


def read_pids(tmp_path: Path, names: list[str]) -> list[int]:
    return [int((tmp_path / name).read_text()) for name in names]


@pytest.fixture
def launch_here(tmp_path, monkeypatch):
    """``launch(target, **options)`` in this process, in ``tmp_path``, with the environment of
    ``base_env()``; returns (exit code, stdout, stderr)."""
    monkeypatch.chdir(tmp_path)
    clean = base_env()
    for key in os.environ.keys() - clean.keys():
        monkeypatch.delenv(key)
    for key, value in clean.items():
        monkeypatch.setenv(key, value)

    def run(*target: str, **options: object) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        code = launcher.launch(list(target), out=out, err=err, **options)
        return code, out.getvalue(), err.getvalue()

    return run


@contextmanager
def background_launcher(tmp_path: Path, *args: str) -> Iterator[subprocess.Popen[str]]:
    """The launcher in its own process group; killed with its tasks if the test fails."""
    proc = subprocess.Popen(
        launcher_argv(*args),
        cwd=tmp_path,
        env=base_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        encoding="utf-8",
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=TIMEOUT_S)
        # Tasks live in their own groups: stop those the test saw, if the launcher did not.
        for pid_file in tmp_path.glob("*.pid"):
            pid = int(pid_file.read_text())
            if not is_gone(pid):
                os.killpg(pid, signal.SIGKILL)


# --- pure functions ----------------------------------------------------------------------------


def test_build_tf_configs_leaves_out_empty_jobs():
    cluster = {"worker": ["h:1", "h:2"], "ps": [], "evaluator": ["h:3"]}
    configs = launcher.build_tf_configs(cluster)
    assert sorted(configs) == [("evaluator", 0), ("worker", 0), ("worker", 1)]
    assert json.loads(configs["worker", 1]) == {
        "cluster": {"worker": ["h:1", "h:2"], "evaluator": ["h:3"]},
        "task": {"type": "worker", "index": 1},
    }


def test_free_ports_are_distinct():
    ports = launcher.free_ports(16)
    assert len(set(ports)) == 16
    assert all(0 < port < 65536 for port in ports)


def test_task_env_replaces_launcher_variables():
    base = {"PATH": "/bin", "RANK": "3", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "x"}
    env = launcher.task_env(base, '{"task": {}}', restart=2, omp_threads=4)
    assert env == {
        "PATH": "/bin",
        "TF_CONFIG": '{"task": {}}',
        "PYTHONUNBUFFERED": "1",
        "STRATAGEM_RESTART_COUNT": "2",
        "STRATAGEM_LAUNCHER": "1",
        "OMP_NUM_THREADS": "4",
    }
    assert "OMP_NUM_THREADS" not in launcher.task_env({}, "{}", restart=0, omp_threads=None)


def test_make_tasks_orders_and_names_tasks():
    tasks = launcher.make_tasks({"worker": 2, "ps": 1, "evaluator": 1, "chief": 1}, base_env={})
    assert [t.name for t in tasks] == ["chief", "worker 0", "worker 1", "ps 0", "evaluator"]
    assert all(t.address.startswith("localhost:") for t in tasks)
    with pytest.raises(launcher.LaunchError, match=r"unknown task types \['master'\]"):
        launcher.make_tasks({"master": 1})


def test_ports_are_picked_on_the_address_the_tasks_listen_on():
    # The tasks bind their own address (not 0.0.0.0): ports are checked free there, and a host
    # that is not this machine's is named before any task starts (192.0.2.1: TEST-NET-1, never
    # assigned to a machine).
    tasks = launcher.make_tasks({"worker": 2}, host="127.0.0.1", base_env={})
    assert all(t.address.startswith("127.0.0.1:") for t in tasks)
    with pytest.raises(launcher.LaunchError, match=r"192\.0\.2\.1.*not an address of this machine"):
        launcher.make_tasks({"worker": 1}, host="192.0.2.1", base_env={})


def test_describe_status_and_exit_code():
    assert launcher.describe_status(3) == "exit code 3"
    assert launcher.describe_status(-9) == "killed by signal 9 (SIGKILL)"
    assert launcher.exit_code_of(3) == 3
    assert launcher.exit_code_of(-15) == 143


# --- TF_CONFIG and environment of every task ---------------------------------------------------

PRINT_CONFIG = """
print("CONFIG " + os.environ["TF_CONFIG"])
keys = ["PYTHONUNBUFFERED", "STRATAGEM_RESTART_COUNT", "STRATAGEM_LAUNCHER", "OMP_NUM_THREADS",
        "RANK", "MASTER_PORT", "STRATAGEM_CONFIG", "TORCHELASTIC_RUN_ID", "KEEP_ME"]
print("ENV " + json.dumps({k: os.environ.get(k) for k in keys}))
"""


def task_reports(stdout: str) -> dict[str, dict[str, dict]]:
    """``{"worker 0": {"CONFIG": {...}, "ENV": {...}}}`` from the children's prefixed lines."""
    reports: dict[str, dict[str, dict]] = {}
    for prefix, kind, payload in re.findall(
        r"^\[([\w ]+)\] (CONFIG|ENV) (.*)$", stdout, re.MULTILINE
    ):
        reports.setdefault(prefix, {})[kind] = json.loads(payload)
    return reports


def test_tf_config_of_every_task(tmp_path):
    script = write_script(tmp_path, PRINT_CONFIG)
    env = base_env(
        RANK="3", MASTER_PORT="29500", STRATAGEM_CONFIG="{}", TORCHELASTIC_RUN_ID="x", KEEP_ME="1"
    )
    result = run_launcher(tmp_path, "-n", "2", "--ps", "2", "--evaluator", script, env=env)
    assert result.returncode == 0, result.stderr

    started = started_tasks(result.stderr)
    names = ["worker 0", "worker 1", "ps 0", "ps 1", "evaluator"]
    assert list(started) == names
    addresses = [address for _, address in started.values()]
    assert len(set(addresses)) == 5
    assert all(re.fullmatch(r"localhost:\d+", a) for a in addresses)
    cluster = {"worker": addresses[:2], "ps": addresses[2:4], "evaluator": addresses[4:]}

    reports = task_reports(result.stdout)
    assert sorted(reports) == sorted(names)
    omp = str(max(1, len(os.sched_getaffinity(0)) // 5))
    for name in names:
        task_type, _, index = name.partition(" ")
        expected_task = {"type": task_type, "index": int(index or 0)}
        assert reports[name]["CONFIG"] == {"cluster": cluster, "task": expected_task}
        assert reports[name]["ENV"] == {
            "PYTHONUNBUFFERED": "1",
            "STRATAGEM_RESTART_COUNT": "0",
            "STRATAGEM_LAUNCHER": "1",
            "OMP_NUM_THREADS": omp,
            "RANK": None,
            "MASTER_PORT": None,
            "STRATAGEM_CONFIG": None,
            "TORCHELASTIC_RUN_ID": None,
            "KEEP_ME": "1",
        }
    assert f"OMP_NUM_THREADS={omp} in each task" in result.stderr
    assert "[stratagem] job finished: 2 workers exited 0" in result.stderr


def test_workers_only_cluster_host_and_user_omp(tmp_path, launch_here, monkeypatch):
    script = write_script(tmp_path, PRINT_CONFIG)
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    code, out, err = launch_here(script, host="127.0.0.1")
    assert code == 0, err
    ((_, address),) = started_tasks(err).values()
    assert address.startswith("127.0.0.1:")
    report = task_reports(out)["worker 0"]
    assert report["CONFIG"] == {
        "cluster": {"worker": [address]},
        "task": {"type": "worker", "index": 0},
    }
    assert report["ENV"]["OMP_NUM_THREADS"] == "7"
    assert "OMP_NUM_THREADS=" not in err  # the user's setting is kept, without a word


def test_chief_task(tmp_path, launch_here):
    script = write_script(tmp_path, PRINT_CONFIG)
    code, out, err = launch_here(script, chief=True, workers=1)
    assert code == 0, err
    reports = task_reports(out)
    assert reports["chief"]["CONFIG"]["task"] == {"type": "chief", "index": 0}
    assert list(reports["chief"]["CONFIG"]["cluster"]) == ["chief", "worker"]
    assert "[stratagem] job finished: 1 chief and 1 worker exited 0" in err


# --- output --------------------------------------------------------------------------------------

CHATTY = """
long = "x" * 3000
for i in range(200):
    stream = sys.stdout if i % 2 == 0 else sys.stderr
    stream.write(f"{NAME} line {i} {long} end\\n")
sys.stdout.buffer.write(b"bad bytes \\xff\\xfe here\\n")
sys.stdout.write(f"{NAME} last line without newline")
"""


def test_output_is_prefixed_whole_lines_in_order(tmp_path):
    script = write_script(tmp_path, CHATTY)
    result = run_launcher(tmp_path, "-n", "3", script)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert not any(line.startswith("[stratagem]") for line in lines)  # those go to stderr
    per_task: dict[str, list[str]] = {}
    for line in lines:
        match = re.fullmatch(r"\[(worker \d)\] (.*)", line)
        assert match, f"line without a task prefix: {line[:200]!r}"
        per_task.setdefault(match[1], []).append(match[2])
    assert sorted(per_task) == ["worker 0", "worker 1", "worker 2"]
    for name, texts in per_task.items():
        short = name.replace(" ", "")
        expected = [f"{short} line {i} {'x' * 3000} end" for i in range(200)]
        assert texts == [
            *expected,
            "bad bytes \ufffd\ufffd here",
            f"{short} last line without newline",
        ]


@pytest.mark.parametrize(
    ("args", "expected_argv"),
    [
        (["task.py", "--lr", "3", "-n", "5", "--", "a b"], ["--lr", "3", "-n", "5", "--", "a b"]),
        (["-m", "task", "--flag", "-m", "x"], ["--flag", "-m", "x"]),
    ],
)
def test_script_arguments_are_passed_unchanged(tmp_path, args, expected_argv):
    write_script(tmp_path, 'print("ARGV " + json.dumps(sys.argv[1:]))\n')
    result = run_launcher(tmp_path, "-n", "1", *args)
    assert result.returncode == 0, result.stderr
    assert f"[worker 0] ARGV {json.dumps(expected_argv)}" in result.stdout.splitlines()


# --- failures ------------------------------------------------------------------------------------


def test_failed_worker_stops_the_job_and_its_processes(tmp_path):
    script = write_script(
        tmp_path,
        """
        if TASK["index"] == 0:
            # A grandchild in worker 0's process group: it must be stopped with it.
            code = "import os, time; open('gc.tmp', 'w').write(str(os.getpid())); " \\
                "os.replace('gc.tmp', 'grandchild.pid'); time.sleep(600)"
            subprocess.Popen([sys.executable, "-c", code])
            wait_for("grandchild.pid")
            serve_forever()
        wait_for("worker0.pid")
        exit_marked(3)
        """,
    )
    result = run_launcher(tmp_path, "-n", "2", "--grace-period", "1", script)
    assert result.returncode == 3, result.stderr
    assert seconds_since_exit(tmp_path, "worker1") < 1 + MARGIN_S
    assert "[stratagem] worker 1 failed: exit code 3" in result.stderr
    assert "[stratagem] giving worker 0 up to 1 s to exit on its own" in result.stderr
    assert "[stratagem] stopping worker 0: SIGTERM" in result.stderr
    assert (
        "[stratagem] job failed: worker 1 failed: exit code 3 (after 0 restarts)" in result.stderr
    )
    worker0, grandchild = read_pids(tmp_path, ["worker0.pid", "grandchild.pid"])
    assert worker0 == started_tasks(result.stderr)["worker 0"][0]
    assert is_gone(worker0)  # reaped by the launcher before it exited
    assert wait_until_gone([grandchild]) == []


def test_survivor_may_report_the_lost_peer_within_the_grace_period(tmp_path):
    # Worker 1 learns of worker 0's death as a real peer would: its connection is closed.
    script = write_script(
        tmp_path,
        """
        import socket
        port = int(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"][0].split(":")[1])
        if TASK["index"] == 0:
            server = socket.create_server(("127.0.0.1", port))
            mark("worker0.listening")
            server.accept()
            os._exit(3)  # no interpreter shutdown: the kernel closes the connection as it exits
        wait_for("worker0.listening")
        peer = socket.create_connection(("127.0.0.1", port))
        assert peer.recv(1) == b""
        print("lost peer worker 0", flush=True)
        exit_marked(1)
        """,
    )
    result = run_launcher(tmp_path, "-n", "2", "--grace-period", "30", script)
    assert result.returncode == 3, result.stderr  # the first failure, not the survivor's
    # Once every task has exited, the rest of the grace period is not spent: a launcher that
    # spent it would end 30 s or more after worker 1's exit, however busy the machine (a
    # tighter bound would be a stopwatch, whose verdict depends on the load).
    assert seconds_since_exit(tmp_path, "worker1") < 30
    assert "[worker 1] lost peer worker 0" in result.stdout
    assert "[stratagem] worker 1 failed: exit code 1" in result.stderr
    assert "job failed: worker 0 failed: exit code 3" in result.stderr


def test_task_killed_by_a_signal(tmp_path, launch_here):
    script = write_script(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)\n")
    code, _, err = launch_here(script)
    assert code == 137, err
    assert "[stratagem] worker 0 failed: killed by signal 9 (SIGKILL)" in err
    assert "job failed: worker 0 failed: killed by signal 9 (SIGKILL)" in err


def test_task_ignoring_sigterm_is_killed(tmp_path, monkeypatch):
    # In-process Job with a short kill timeout: the launcher's is 5 s.
    monkeypatch.chdir(tmp_path)
    script = write_script(
        tmp_path,
        """
        if TASK["index"] == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            serve_forever()
        wait_for("worker0.pid")
        sys.exit(4)
        """,
    )
    tasks = launcher.make_tasks({"worker": 2}, base_env=base_env())
    out, err = io.StringIO(), io.StringIO()
    console = launcher.Console(out, err)
    with launcher.Job(tasks, [script], grace_period=0.2, console=console, kill_timeout=0.5) as job:
        job.start()
        outcome = job.wait()
    assert outcome == launcher.Outcome(4, "worker 1 failed: exit code 4")
    log = err.getvalue()
    assert "[stratagem] worker 0 still running: SIGKILL" in log
    assert "[stratagem] worker 0 stopped: killed by signal 9 (SIGKILL)" in log
    assert is_gone(read_pids(tmp_path, ["worker0.pid"])[0])


def test_a_ps_job_with_a_range_of_workers_goes_on_down_to_its_minimum(tmp_path):
    """``-n 2:3 --ps 1``, workers 1 and 2 lost: the first lost, the job goes on (2 left); the
    second, the job fails: 1 would be left, fewer than 2."""
    script = write_script(
        tmp_path,
        """
        if TASK["type"] == "ps" or TASK["index"] == 0:
            serve_forever()
        os.kill(os.getpid(), signal.SIGKILL)
        """,
    )
    result = run_launcher(tmp_path, "-n", "2:3", "--ps", "1", "--grace-period", "1", script)
    assert result.returncode == 137, result.stderr
    log = result.stderr
    lost = r"worker (\d) was lost: killed by signal 9 \(SIGKILL\); "
    gone_on = re.findall(lost + "the job goes on", log)
    refused = re.findall(lost + "1 worker left, fewer than the 2 the job needs", log)
    assert len(gone_on) == 1 and len(refused) == 1, log
    assert sorted(gone_on + refused) == ["1", "2"], log
    assert f"job failed: worker {refused[0]} failed: killed by signal 9 (SIGKILL)" in log, log


def test_ps_failure_fails_the_job(tmp_path):
    script = write_script(
        tmp_path,
        """
        if TASK["type"] == "ps":
            wait_for("worker0.pid", "worker1.pid")
            sys.exit(5)
        serve_forever()
        """,
    )
    result = run_launcher(tmp_path, "-n", "2", "--ps", "1", "--grace-period", "1", script)
    assert result.returncode == 5, result.stderr
    assert "[stratagem] ps 0 failed: exit code 5" in result.stderr
    assert is_gone(read_pids(tmp_path, ["worker0.pid"])[0])


# --- restarts ------------------------------------------------------------------------------------


def test_restart_after_failure_then_success(tmp_path):
    script = write_script(
        tmp_path,
        """
        print(f"restart {RESTART}")
        if RESTART == 0:
            if TASK["index"] == 0:
                serve_forever()
            wait_for("worker0.pid")
            sys.exit(3)
        """,
    )
    result = run_launcher(tmp_path, "-n", "2", "--max-restarts", "1", "--grace-period", "1", script)
    assert result.returncode == 0, result.stderr
    assert "[stratagem] restarting the job (restart 1 of 1)" in result.stderr
    assert "(attempt 2 of 2)" in result.stderr
    assert len(START_LINE.findall(result.stderr)) == 4
    for name in ["worker 0", "worker 1"]:
        assert f"[{name}] restart 0" in result.stdout
        assert f"[{name}] restart 1" in result.stdout
    assert "[stratagem] job finished: 2 workers exited 0" in result.stderr
    assert is_gone(read_pids(tmp_path, ["worker0.pid"])[0])


def test_restarts_exhausted(tmp_path, launch_here):
    script = write_script(tmp_path, 'print(f"restart {RESTART}")\nsys.exit(4)\n')
    code, out, err = launch_here(script, max_restarts=2, grace_period=1)
    assert code == 4, err
    assert out.splitlines() == [f"[worker 0] restart {i}" for i in range(3)]
    assert len(START_LINE.findall(err)) == 3
    assert "[stratagem] restarting the job (restart 2 of 2)" in err
    assert "[stratagem] job failed: worker 0 failed: exit code 4 (after 2 restarts)" in err


# --- the end of a job ----------------------------------------------------------------------------


def test_ps_and_evaluator_are_stopped_after_the_workers_succeed(tmp_path):
    script = write_script(
        tmp_path,
        """
        if TASK["type"] in ("ps", "evaluator"):
            serve_forever()
        wait_for("ps0.pid", "ps1.pid", "evaluator0.pid")
        exit_marked(0)
        """,
    )
    args = ["-n", "2", "--ps", "2", "--evaluator", "--grace-period", "1", script]
    result = run_launcher(tmp_path, *args)
    assert result.returncode == 0, result.stderr
    last_worker = max(
        seconds_since_exit(tmp_path, "worker0"), seconds_since_exit(tmp_path, "worker1")
    )
    assert last_worker < 1 + MARGIN_S
    assert "[stratagem] stopping ps 0, ps 1, evaluator: SIGTERM" in result.stderr
    assert "[stratagem] job finished: 2 workers exited 0" in result.stderr
    pids = read_pids(tmp_path, ["ps0.pid", "ps1.pid", "evaluator0.pid"])
    assert [pid for pid in pids if not is_gone(pid)] == []


@pytest.mark.parametrize(("signum", "exit_code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_to_the_launcher_stops_every_task(tmp_path, signum, exit_code):
    script = write_script(
        tmp_path,
        """
        if TASK["type"] == "evaluator":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # it gets SIGKILL after the grace period
        serve_forever()
        """,
    )
    pid_files = ["worker0.pid", "worker1.pid", "ps0.pid", "evaluator0.pid"]
    args = ["-n", "2", "--ps", "1", "--evaluator", "--grace-period", "1", script]
    with background_launcher(tmp_path, *args) as proc:
        wait_for_files(tmp_path, pid_files, proc)
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=TIMEOUT_S)
        assert proc.returncode == exit_code, stderr
        assert f"[stratagem] received {signum.name}; stopping the job" in stderr
        assert "[stratagem] evaluator stopped: killed by signal 9 (SIGKILL)" in stderr
        assert [pid for pid in read_pids(tmp_path, pid_files) if not is_gone(pid)] == []
