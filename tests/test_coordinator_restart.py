"""A coordinator's worker restarted alone rejoins the running job.

The rendezvous rules of a re-claim (single process, on a sealed in-memory store): a restarted
rank is accepted with the job's secret once its earlier process has ended; a live claim, a
second restart of one incarnation, a restart of a rank that never joined and a process without
the secret are refused. The launcher's side (tiny scripts, no torch): a failed worker is
restarted alone while the chief runs, up to ``--restart-workers`` times. And one real job (1
chief, 2 workers, 1 ps): worker 1 is killed (-9) mid-function, restarted, and takes work again;
every function completes once.
"""

from __future__ import annotations

import io
import json
import re
import socket
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from cluster_utils import WORKERS, Process, child_env, free_ports
from stratagem.cluster import SimpleClusterResolver, launcher
from stratagem.cluster.tasks import INCARNATION_VARIABLE
from stratagem.comm import rendezvous
from stratagem.comm.liveness import LivenessServer
from stratagem.comm.rendezvous import Member, reclaim, roll_call
from stratagem.comm.rpc_world import RpcWorld
from stratagem.comm.sealed_store import SealedStore
from stratagem.errors import RendezvousError

SECRET = b"job-secret-of-the-restart-test-0123456789"


def _member(rank: int, liveness: str, incarnation: int = 1, pid: int = 100) -> Member:
    return Member(
        rank=rank,
        world_size=2,
        name=f"worker {rank} (h:{rank + 1})",
        cluster='{"chief": 1, "worker": 1}',
        pid=pid + rank,
        host="box",
        liveness=liveness,
        incarnation=incarnation,
    )


def _names(rank: int) -> str:
    return f"worker {rank} (h:{rank + 1})"


def _ended_address() -> str:
    """A liveness address whose process is gone: nothing listens there (connections refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"127.0.0.1:{port}"


def _job_store() -> tuple[dist.Store, SealedStore]:
    """A job's store, sealed with its secret, where both ranks signed in (incarnation 1)."""
    base = dist.HashStore()
    store = SealedStore(base, SECRET, where="chief (h:1)")
    return base, store


def _sign_in(store: dist.Store, liveness_of_1: str) -> None:
    store.set("member/0", rendezvous._encode(_member(0, "127.0.0.1:1")))
    first = _member(1, liveness_of_1)
    assert roll_call(store, first, timeout_s=5, peer_name=_names, report=print)[1] == first


@pytest.mark.parametrize("secret", [True, False], ids=["sealed", "insecure"])
def test_a_restarted_rank_is_accepted_with_the_secret_once_its_process_ended(secret):
    # A job run insecure (STRATAGEM_INSECURE=1) has a plain store: the same rules, no seal.
    store = _job_store()[1] if secret else dist.HashStore()
    _sign_in(store, _ended_address())
    again = _member(1, "127.0.0.1:7", incarnation=2, pid=200)
    members = roll_call(store, again, timeout_s=5, peer_name=_names, report=print)
    assert [m.incarnation for m in members] == [1, 2] and members[1] == again
    record = rendezvous.decode_member(store.get("member/1"), key="member/1", me="test")
    assert record == again  # what the other members read when they look the rank up again
    # A third incarnation takes it back from the second the same way.
    third = _member(1, "127.0.0.1:8", incarnation=3, pid=300)
    assert reclaim(store, third, ended=lambda address: True) == again


def test_a_duplicate_live_claim_and_a_repeated_restart_are_refused():
    _, store = _job_store()
    alive = LivenessServer("127.0.0.1")
    try:
        _sign_in(store, alive.address)
        # A second first-incarnation process: refused, as before.
        with pytest.raises(RendezvousError, match=r"two processes claim worker 1 \(h:2\)"):
            roll_call(store, _member(1, "127.0.0.1:9", pid=900), timeout_s=5, peer_name=_names)
        # A restart while the first process still answers: refused, naming it.
        with pytest.raises(RendezvousError, match=r"still answers at 127\.0\.0\.1:") as refused:
            reclaim(store, _member(1, "127.0.0.1:9", incarnation=2, pid=900))
        assert "incarnation 1 (pid 101 on box)" in str(refused.value)
        assert "restarted as incarnation 2" in str(refused.value)
    finally:
        alive.close("ok")
    # Once it ended, one restart wins; the same incarnation again is refused.
    reclaim(store, _member(1, "127.0.0.1:9", incarnation=2, pid=900))
    with pytest.raises(RendezvousError, match=r"two processes claim .* as incarnation 2"):
        reclaim(store, _member(1, "127.0.0.1:10", incarnation=2, pid=901), ended=lambda a: True)


def test_a_restart_without_the_secret_or_without_an_earlier_incarnation_is_refused():
    base, store = _job_store()
    with pytest.raises(RendezvousError, match="finds no earlier incarnation of rank 1"):
        reclaim(store, _member(1, "127.0.0.1:9", incarnation=2), ended=lambda a: True)
    _sign_in(store, _ended_address())
    # An impostor on the same store with another secret: the sealed key names differ, so it
    # does not even find the record it would replace, and the job's record is untouched.
    impostor = SealedStore(base, b"another-secret-of-an-impostor-0123456789", where="chief")
    with pytest.raises(RendezvousError, match="finds no earlier incarnation"):
        reclaim(impostor, _member(1, "127.0.0.1:9", incarnation=2), ended=lambda a: True)
    # What it wrote in its own names is nothing the job's store can read as a record.
    impostor.set("member/1", rendezvous._encode(_member(1, "127.0.0.1:9", incarnation=5)))
    record = rendezvous.decode_member(store.get("member/1"), key="member/1", me="test")
    assert record.incarnation == 1 and record.pid == 101


def test_every_members_view_of_a_restarted_worker_goes_from_ended_to_alive(monkeypatch):
    """Real ``RpcWorld``s in one process (a chief hosting the sealed store, a worker): the
    worker leaves, comes back as incarnation 2, and the chief's view follows it."""
    monkeypatch.setenv("STRATAGEM_JOB_SECRET", SECRET.decode())
    monkeypatch.delenv(INCARNATION_VARIABLE, raising=False)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # RpcWorld installs its own
    chief_port, worker_port = free_ports(2)
    cluster = {"chief": [f"localhost:{chief_port}"], "worker": [f"localhost:{worker_port}"]}

    def world(task_type: str) -> RpcWorld:
        resolver = SimpleClusterResolver(cluster, task_type=task_type, task_id=0)
        return RpcWorld(resolver, rendezvous_timeout=30)

    with ThreadPoolExecutor(1) as pool:
        chief_world = pool.submit(world, "chief")
        first = world("worker")
        chief = chief_world.result(timeout=30)
    try:
        assert chief.state(1) == "alive" and chief.incarnations[1] == 1
        monkeypatch.setenv(INCARNATION_VARIABLE, "2")
        with pytest.raises(RendezvousError, match="still answers"):
            world("worker")  # a restart while the first incarnation answers: refused
        first.shutdown()
        assert chief.state(1) == "ended"
        second = world("worker")
        try:
            assert chief.state(1) == "alive"
            assert chief.incarnations[1] == 2 and chief.liveness[1] == second.liveness[1]
            assert second.incarnations == {0: 1, 1: 2}
        finally:
            second.shutdown()
        assert chief.state(1) == "ended"
    finally:
        first.shutdown()
        chief.shutdown()


# --------------------------------------------------------------------------- the launcher

# A chief that waits (bounded) for worker 0's second incarnation; a worker that fails as
# incarnation 1, then, as incarnation 2, exits with WORKER_CODE.
SCRIPT = """\
import json, os, sys, time
from pathlib import Path

task = json.loads(os.environ["TF_CONFIG"])["task"]
incarnation = int(os.environ.get("STRATAGEM_TASK_INCARNATION", "1"))
print(f"{task['type']} incarnation {incarnation}", flush=True)
if task["type"] == "worker":
    if incarnation == 1:
        sys.exit(3)
    Path("second").touch()
    sys.exit(int(sys.argv[1]))
if task["type"] == "chief":
    deadline = time.monotonic() + 60
    while not Path("second").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
"""


@pytest.fixture
def launch_here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "task.py").write_text(textwrap.dedent(SCRIPT))
    for key in launcher.CONFLICTING_ENV:
        monkeypatch.delenv(key, raising=False)

    def run(code: int, **options: object) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        exit_code = launcher.launch(
            ["task.py", str(code)], chief=True, ps=1, out=out, err=err, **options
        )
        return exit_code, out.getvalue(), err.getvalue()

    return run


def test_the_launcher_restarts_a_failed_worker_alone(launch_here):
    code, out, err = launch_here(0, restart_workers=1, grace_period=1)
    assert code == 0, err
    assert "worker 0 failed: exit code 3; restarting it alone (restart 1 of 1" in err
    assert re.search(r"worker 0 restarted \(incarnation 2\): pid \d+ at localhost:\d+", err), err
    assert "[worker 0] worker incarnation 2" in out
    assert out.count("[chief] chief incarnation 1") == 1  # the chief was not restarted
    assert "job finished" in err and "restarting the job" not in err


def test_when_worker_restarts_run_out_the_failure_ends_the_job(launch_here):
    code, _, err = launch_here(4, restart_workers=1, grace_period=0.5)
    assert code == 4, err
    assert "restarting it alone (restart 1 of 1" in err
    assert "job failed: worker 0 failed: exit code 4" in err


def test_worker_restarts_need_a_parameter_server_cluster():
    common = {"workers": 2, "max_restarts": 0, "grace_period": 1.0, "host": "localhost"}
    for chief in (False, True):
        with pytest.raises(launcher.LaunchError) as refused:
            launcher.check_arguments(
                [sys.executable], chief=chief, ps=0, restart_workers=1, **common
            )
        assert "needs ps tasks (got ps=0)" in str(refused.value)
        assert "--max-restarts" in str(refused.value)
    # Between-graph ps workers (no chief) come back alone too.
    launcher.check_arguments([sys.executable], chief=False, ps=1, restart_workers=1, **common)
    with pytest.raises(launcher.LaunchError, match="0 or more, got -1"):
        launcher.check_arguments([sys.executable], chief=True, ps=1, restart_workers=-1, **common)
    launcher.check_arguments([sys.executable], chief=True, ps=1, restart_workers=2, **common)


# --------------------------------------------------------------------------- one real job


@pytest.mark.multiprocess
def test_a_killed_worker_is_restarted_rejoins_and_takes_work_again(tmp_path):
    argv = [sys.executable, "-m", "stratagem.cli", "run", "--chief", "-n", "2", "--ps", "1"]
    # A long grace period costs nothing (tasks that exit are not waited for) and keeps the
    # verdict on "exited 0" free of the machine's load.
    argv += ["--restart-workers", "3", "--grace-period", "60"]
    argv += [str(WORKERS / "coordinator_restart_job.py"), str(tmp_path)]
    env = child_env({"STRATAGEM_JOB_SECRET": "job-secret-of-the-restart-test-0123456789abcdef"})
    result = Process(argv, env, tmp_path, "launcher", merge_output=True).wait(timeout=300)
    output = result.stdout
    assert result.returncode == 0, output
    assert "[chief] restart job done" in output, output
    # The launcher restarted worker 1 alone; the chief reconnected to it.
    assert "worker 1 failed: killed by signal 9 (SIGKILL); restarting it alone" in output, output
    restarted = re.search(r"worker 1 restarted \(incarnation 2\): pid (\d+)", output)
    assert restarted, output
    new_pid = int(restarted.group(1))
    assert re.search(r"\[chief\] worker 1 \(\S+\) restarted \(incarnation 2\); rejoined", output)
    assert "restarting the job" not in output, output
    r = json.loads((tmp_path / "result.json").read_text())
    # Before the kill each worker read its own iterator once.
    assert sorted((w, v) for _, w, v in r["reads"]) == [(0, 0.0), (1, 1000.0)]
    # The function worker 1 died in ran again: every one of them returned, once.
    assert sorted(i for i, _ in r["killed"]) == [0, 1, 2, 3]
    # After the restart, the new worker 1 (its new pid) ran functions, on a dataset and an
    # iterator it made afresh (replayed): its values start again at 1000.
    assert sorted(i for i, *_ in r["after"]) == [0, 1, 2, 3]
    on_1 = [(v, pid) for _, w, v, pid in r["after"] if w == 1]
    assert on_1, r["after"]
    assert all(pid == new_pid for _, pid in on_1), (on_1, new_pid)
    assert sorted(v for v, _ in on_1) == [1000.0 + k for k in range(len(on_1))]
    on_0 = sorted(v for _, w, v, _ in r["after"] if w == 0)
    assert on_0 == [1.0 + k for k in range(len(on_0))]  # worker 0's iterator went on
    # Killed idle (by the chief, between joins), worker 1 came back as incarnation 3.
    assert r["second_pid"] == new_pid
    assert "worker 1 failed: killed by signal 9 (SIGKILL); restarting it alone (restart 2 of 3" in (
        output
    )
    third = re.search(r"worker 1 restarted \(incarnation 3\): pid (\d+)", output)
    assert third, output
    assert sorted(i for i, *_ in r["idle"]) == [0, 1, 2, 3]
    on_1 = [(v, pid) for _, w, v, pid in r["idle"] if w == 1]
    assert on_1 and all(pid == int(third.group(1)) for _, pid in on_1), (on_1, output)
    assert sorted(v for v, _ in on_1) == [1000.0 + k for k in range(len(on_1))]
    # Both killed idle: with no worker left the coordinator waited; both came back (worker 0's
    # first restart, worker 1's third) and ran the last functions, each on a new process.
    assert "restarting it alone (restart 3 of 3" in output, output
    assert re.search(r"\[chief\] worker 0 \(\S+\) restarted \(incarnation 2\); rejoined", output)
    assert re.search(r"\[chief\] worker 1 \(\S+\) restarted \(incarnation 4\); rejoined", output)
    assert sorted(i for i, *_ in r["all_lost"]) == [0, 1, 2, 3]
    assert {w for _, w, _ in r["all_lost"]} == {0, 1}
    assert not {pid for *_, pid in r["all_lost"]} & {*r["all_killed"], new_pid}
    assert r["completed"] == 18  # 2 reads + 4 + 4 + 4 + 4, each counted once
    assert "worker 1 exited 0" in output and "ps 0 exited 0" in output, output
