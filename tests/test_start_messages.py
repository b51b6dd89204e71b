"""A start you can watch: roll-call progress (who arrived, who is missing), the start line of
every strategy, and the switches that silence them (STRATAGEM_LOG_LEVEL, ``run --quiet``).

The in-process checks stop a wait through the report callback itself, so that no verdict
depends on how long anything takes; the two-process check starts worker 0 alone, reads its
"missing: worker 1" line, and only then starts worker 1.
"""

from __future__ import annotations

import io
import sys
import textwrap
import time

import pytest
import torch.distributed as dist

import stratagem as sg
from cluster_utils import Process, child_env, free_ports, tf_config
from stratagem.cluster import launcher, progress
from stratagem.comm import rendezvous
from stratagem.comm.rendezvous import Member, roll_call


class _Stop(Exception):
    """Raised by a report callback: the wait is over as soon as a line was said."""


def _member(rank: int, world: int = 3) -> Member:
    return Member(
        rank=rank,
        world_size=world,
        name=f"worker {rank} (h:{rank + 1})",
        cluster=f"worker={world}",
        pid=100 + rank,
        host="box",
        liveness="127.0.0.1:1",
    )


def _names(rank: int) -> str:
    return f"worker {rank} (h:{rank + 1})"


def test_roll_call_names_who_arrived_and_who_is_missing():
    store = dist.HashStore()
    store.set("member/2", rendezvous._encode(_member(2)))  # worker 2 signed in already
    lines: list[str] = []

    def report(line: str) -> None:
        lines.append(line)
        raise _Stop

    with pytest.raises(_Stop):
        roll_call(
            store, _member(0), timeout_s=60, peer_name=_names, report=report, first_report_s=0
        )
    assert len(lines) == 1
    assert lines[0].startswith("worker 0 (h:1) waiting for the job's processes (0s of 60s): ")
    assert (
        "2 of 3 arrived: worker 0 (h:1) pid 100 on box; worker 2 (h:3) pid 102 on box" in lines[0]
    )
    assert lines[0].endswith("; missing: worker 1 (h:2)")


def test_roll_call_of_a_complete_job_says_nothing():
    store = dist.HashStore()
    store.set("member/1", rendezvous._encode(_member(1, world=2)))
    lines: list[str] = []
    members = roll_call(
        store,
        _member(0, world=2),
        timeout_s=60,
        peer_name=_names,
        report=lines.append,
        first_report_s=0,
    )
    assert [m.rank for m in members] == [0, 1]
    assert lines == []


def test_waiting_for_the_rendezvous_host_names_it(monkeypatch):
    monkeypatch.setattr(rendezvous, "FIRST_REPORT_S", 0.0)
    lines: list[str] = []

    def report(line: str) -> None:
        lines.append(line)
        raise _Stop

    (port,) = free_ports(1)  # nobody listens there
    with pytest.raises(_Stop):
        rendezvous.wait_for_port(
            "127.0.0.1",
            port,
            time.monotonic() + 60,
            owner=f"worker 0 (localhost:{port})",
            me="worker 1 (localhost:2)",
            report=report,
        )
    assert lines[0].startswith("worker 1 (localhost:2) waiting for the job's processes")
    assert lines[0].endswith(
        f"missing: worker 0 (localhost:{port}), which hosts the rendezvous at 127.0.0.1:{port}"
    )


def test_log_level_from_the_environment(monkeypatch, capsys):
    assert progress.log_level({}) == progress.LEVELS["info"]
    assert progress.log_level({"STRATAGEM_LOG_LEVEL": " WARNING "}) == progress.LEVELS["warning"]
    with pytest.raises(ValueError, match=r"STRATAGEM_LOG_LEVEL='loud' is not a log level; "):
        progress.log_level({"STRATAGEM_LOG_LEVEL": "loud"})
    monkeypatch.setenv("STRATAGEM_LOG_LEVEL", "warning")
    progress.info("not said")
    monkeypatch.setenv("STRATAGEM_LOG_LEVEL", "info")
    progress.info("said")
    progress.debug("not said either")
    assert capsys.readouterr().err == "[stratagem] said\n"


def test_a_local_strategy_says_its_start_at_debug(monkeypatch, capsys):
    monkeypatch.setenv("STRATAGEM_LOG_LEVEL", "info")
    sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    assert capsys.readouterr().err == ""  # one process: nothing to watch at INFO
    monkeypatch.setenv("STRATAGEM_LOG_LEVEL", "debug")
    sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("[stratagem] this process: MirroredStrategy started in ")
    assert line.endswith(": 2 replicas in sync, devices cpu:0, cpu:1, backend none")
    sg.distribute.MirroredStrategy(["cpu:0"])
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith(": 1 replica in sync, devices cpu:0, backend none")


START = """\
import os, time
import stratagem as sg
import torch  # imported by both workers at once; worker 1 then waits for the test's "go"
while not os.path.exists(os.environ["GO_FILE"]):
    time.sleep(0.01)
strategy = sg.distribute.MultiWorkerMirroredStrategy()
print("ready", strategy.num_replicas_in_sync, flush=True)
"""


def _stderr(proc: Process, tmp_path) -> str:
    return (tmp_path / f"{proc.name}.err").read_text()


@pytest.mark.multiprocess
def test_a_hand_started_worker_says_who_is_missing_then_that_it_started(tmp_path):
    script = tmp_path / "start.py"
    script.write_text(START)
    workers = [f"localhost:{p}" for p in free_ports(2)]
    go = tmp_path / "go"
    (tmp_path / "go0").touch()  # worker 0 goes at once; worker 1 when the test says so
    env = {"STRATAGEM_RENDEZVOUS_TIMEOUT": "120"}
    quiet = {**env, "STRATAGEM_LOG_LEVEL": "warning"}  # worker 1 says nothing of its start
    first = Process(
        [sys.executable, str(script)],
        child_env({"TF_CONFIG": tf_config(workers, 0), "GO_FILE": str(tmp_path / "go0"), **env}),
        tmp_path,
        "w0",
    )
    second = Process(
        [sys.executable, str(script)],
        child_env({"TF_CONFIG": tf_config(workers, 1), "GO_FILE": str(go), **quiet}),
        tmp_path,
        "w1",
    )
    try:
        missing = f"missing: worker 1 ({workers[1]})"
        deadline = time.monotonic() + 90
        while missing not in _stderr(first, tmp_path):
            assert first.proc.poll() is None, _stderr(first, tmp_path)
            assert time.monotonic() < deadline, "worker 0 never said who is missing"
            time.sleep(0.05)
        go.touch()
        results = [first.wait(90).check("worker 0"), second.wait(90).check("worker 1")]
    finally:
        for p in (first, second):
            if p.proc.poll() is None:
                p.kill_group()
    said = [line for line in results[0].stderr.splitlines() if line.startswith("[stratagem]")]
    assert said[0].startswith(
        f"[stratagem] worker 0 ({workers[0]}) waiting for the job's processes ("
    )
    assert f"1 of 2 arrived: worker 0 ({workers[0]}) pid {first.pid} on " in said[0]
    assert said[0].endswith(f"; missing: worker 1 ({workers[1]})")
    assert said[-1].startswith(
        "[stratagem] worker 0 of 2 workers (TF_CONFIG): MultiWorkerMirroredStrategy started in "
    )
    assert ": 2 replicas in sync, devices cpu:0, backend gloo" in said[-1]
    assert "since the process started" in said[-1]
    assert results[0].stdout == results[1].stdout == "ready 2\n"
    assert results[1].stderr == ""


QUIET = """\
import os
print("level", os.environ.get("STRATAGEM_LOG_LEVEL"))
"""


@pytest.mark.parametrize("quiet, level", [(False, "None"), (True, "warning")])
def test_run_quiet_sets_the_tasks_log_level(tmp_path, monkeypatch, quiet, level):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("STRATAGEM_LOG_LEVEL", raising=False)
    (tmp_path / "quiet.py").write_text(textwrap.dedent(QUIET))
    out, err = io.StringIO(), io.StringIO()
    code = launcher.launch(["quiet.py"], workers=2, quiet=quiet, out=out, err=err)
    assert code == 0, err.getvalue()
    lines = sorted(out.getvalue().splitlines())
    assert lines == [f"[worker 0] level {level}", f"[worker 1] level {level}"]


class _CountingStore(dist.Store):
    """A HashStore that counts the requests a client would send (one round trip each)."""

    def __init__(self) -> None:
        super().__init__()
        self._base = dist.HashStore()
        self.requests = 0

    def set(self, key, value):
        self.requests += 1
        self._base.set(key, value)

    def get(self, key):
        self.requests += 1
        return self._base.get(key)

    def multi_get(self, keys):
        self.requests += 1
        return self._base.multi_get(keys)

    def check(self, keys):
        self.requests += 1
        return self._base.check(keys)

    def add(self, key, amount):
        self.requests += 1
        return self._base.add(key, amount)


def test_the_roll_call_of_a_complete_job_costs_the_same_round_trips_at_any_size():
    """Each process's sign-in and read of the others are a fixed number of round trips to the
    store, whatever the job's size: asking after each peer in turn made the start O(N) round
    trips per process and O(N²) at the store."""
    costs = {}
    for world in (2, 32):
        store = _CountingStore()
        for rank in range(1, world):
            store._base.set(f"member/{rank}", rendezvous._encode(_member(rank, world=world)))
        members = roll_call(store, _member(0, world=world), timeout_s=60, peer_name=_names)
        assert [m.rank for m in members] == list(range(world))
        costs[world] = store.requests
    assert costs[32] == costs[2] <= 6, costs
