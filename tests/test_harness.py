"""The test harness's own promise: a child that times out is ended with everything it started,
also the processes it put in sessions of their own (as the launcher does with its tasks), so a
hung job never outlives its test."""

from __future__ import annotations

import os
import sys
import time

import pytest

from cluster_utils import Process, child_env

LAUNCHER = (
    "import subprocess, sys, time\n"
    "task = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'],"
    " start_new_session=True)\n"
    "print(task.pid, flush=True)\n"
    "time.sleep(300)\n"
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_child_that_times_out_is_ended_with_the_tasks_it_started_in_their_own_sessions(
    tmp_path,
):
    launcher = Process([sys.executable, "-c", LAUNCHER], child_env(), tmp_path, "launcher")
    deadline = time.monotonic() + 60
    while not launcher.output_so_far().strip():
        assert time.monotonic() < deadline, "the launcher never started its task"
        time.sleep(0.02)
    task = int(launcher.output_so_far().split()[0])
    assert os.getpgid(task) == task  # a session of its own, as the launcher's tasks
    with pytest.raises(AssertionError, match="did not finish within 1s"):
        launcher.wait(timeout=1)
    deadline = time.monotonic() + 10
    while _alive(task):  # SIGKILL was sent; the kernel ends it at once
        assert time.monotonic() < deadline, f"the task {task} outlived its launcher's timeout"
        time.sleep(0.02)


def test_a_reaped_childs_group_is_signalled_only_while_a_process_of_it_lives(tmp_path, monkeypatch):
    # The first child leaves a process in its group; the second leaves nothing. Once each is
    # reaped, only the first's group may be signalled: the second's id is free for any new
    # process (a busy machine wraps pid_max), and killpg would reach whoever holds it.
    leaves = (
        "import subprocess, sys\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
    )
    left = Process([sys.executable, "-c", leaves], child_env(), tmp_path, "leaves")
    alone = Process([sys.executable, "-c", "pass"], child_env(), tmp_path, "alone")
    assert left.proc.wait(timeout=60) == 0 and alone.proc.wait(timeout=60) == 0
    signalled: list[int] = []
    real_killpg = os.killpg
    monkeypatch.setattr(
        os, "killpg", lambda pgid, sig: (signalled.append(pgid), real_killpg(pgid, sig))
    )
    alone.kill_group()
    left.kill_group()
    assert signalled == [left.pid]
    left.finish(0)
    alone.finish(0)
