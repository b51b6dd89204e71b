"""``stratagem run --nnodes N --node-rank R --master-addr HOST``: one command per machine.

Two "machines" on this one: two launchers whose tasks listen on distinct loopback addresses
(127.0.0.1 and 127.0.0.2), meeting at node 0's launcher; no network beyond loopback.
"""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
import time

import pytest

from cluster_utils import Process, child_env, free_ports
from stratagem.cli import main
from stratagem.cluster.launcher import LaunchError, Nodes
from stratagem.cluster.nodes import make_node_tasks

TRAIN = """\
import json, os
import torch
import stratagem as sg

config = json.loads(os.environ["TF_CONFIG"])
strategy = sg.distribute.MultiWorkerMirroredStrategy()
mine = torch.tensor([float(config["task"]["index"] + 1)])
total = strategy.reduce(sg.distribute.ReduceOp.SUM, strategy.run(lambda: mine), axis=None)
print("cluster", json.dumps(config["cluster"]), "sum", total.item(), flush=True)
"""


def _second_loopback_usable() -> bool:
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.2", 0))
        return True
    except OSError:
        return False


SECRET = {"STRATAGEM_JOB_SECRET": "9" * 64}  # what the user gives every node's launcher


def _launcher(tmp_path, name: str, *options: str, env: dict | None = None) -> Process:
    argv = [sys.executable, "-m", "stratagem.cli", "run", *options, "train.py"]
    extra = SECRET if env is None else env
    return Process(argv, child_env(extra), tmp_path, name, merge_output=True)


@pytest.mark.multiprocess
@pytest.mark.skipif(not _second_loopback_usable(), reason="127.0.0.2 is not usable here")
def test_two_nodes_on_two_loopback_addresses_train_as_one_job(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    (port,) = free_ports(1)
    common = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), "-n", "1"]
    # Node 1 first: it waits for node 0's launcher, which is the order users cannot control.
    node1 = _launcher(tmp_path, "node1", "--node-rank", "1", "--host", "127.0.0.2", *common)
    node0 = _launcher(tmp_path, "node0", "--node-rank", "0", *common)
    try:
        results = [node0.wait(120), node1.wait(120)]
    finally:
        for p in (node0, node1):
            p.kill_group()
    for name, r in zip(("node 0", "node 1"), results):
        assert r.returncode == 0, f"{name} exited {r.returncode}:\n{r.stdout}"
    out0, out1 = results[0].stdout, results[1].stdout
    # Every task got the TF_CONFIG of the whole job: worker 0 on node 0, worker 1 on 127.0.0.2.
    clusters = [
        json.loads(line.split("cluster ", 1)[1].split(" sum ")[0])
        for line in (out0 + out1).splitlines()
        if "] cluster " in line
    ]
    assert len(clusters) == 2 and clusters[0] == clusters[1]
    (w0, w1) = clusters[0]["worker"]
    assert w0.startswith("127.0.0.1:") and w1.startswith("127.0.0.2:")
    assert "[worker 0] cluster" in out0 and "sum 3.0" in out0
    assert "[worker 1] cluster" in out1 and "sum 3.0" in out1
    assert "[stratagem] all 2 nodes arrived: node 0 (127.0.0.1, 1 task), node 1 (127.0.0.2" in out0
    # Each launcher says how long it waits for the others when it starts waiting.
    assert "[stratagem] node 0 waiting up to 300 s (--join-timeout) at 127.0.0.1:" in out0
    assert "[stratagem] node 1 of 2 waiting up to 300 s (--join-timeout) for node 0's" in out1
    assert "[stratagem] started 1 worker (node 1 of 2): " in out1
    assert "[stratagem] worker 1 pid " in out1 and f" at {w1}" in out1
    assert (
        "[worker 1] [stratagem] worker 1 of 2 workers (TF_CONFIG): MultiWorkerMirroredStrategy "
        "started in " in out1
    )


NODE0 = ["--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1"]


@pytest.mark.parametrize(
    "options, message",
    [
        (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h"], "--node-rank 2 is out of"),
        (["--nnodes", "2", "--node-rank", "0"], "--nnodes needs --master-addr"),
        (["--node-rank", "1", "--master-addr", "h"], "--node-rank and --master-addr need --nnodes"),
        (
            [*NODE0, "--ps", "1"],
            "--nnodes runs worker tasks only, got --ps",
        ),
        (
            [*NODE0, "--max-restarts", "1"],
            "--nnodes cannot restart the job yet (got --max-restarts 1)",
        ),
    ],
)
def test_bad_multinode_options_are_one_line_errors(tmp_path, monkeypatch, capsys, options, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ok.py").write_text("")
    assert main(["run", *options, "ok.py"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_nodes_started_with_different_nnodes_are_refused_by_name():
    (port,) = free_ports(1)
    errors: dict[int, str] = {}

    def node(rank: int, nnodes: int) -> None:
        nodes = Nodes(nnodes, rank, "127.0.0.1", port, timeout_s=60)
        try:
            make_node_tasks(
                nodes, 1, host="127.0.0.1", restart=0, base_env=SECRET, omp_threads=1, log=print
            )
        except LaunchError as e:
            errors[rank] = str(e)

    threads = [
        threading.Thread(target=node, args=(0, 2)),
        threading.Thread(target=node, args=(1, 3)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    expected = "node 1 was started with --nnodes 3 but node 0 of 2 with --nnodes 2"
    assert expected in errors[0]
    assert errors[1].startswith("node 0 refused node 1 of 3: " + expected)


@pytest.mark.parametrize("rank", [0, 1])
def test_nodes_that_do_not_meet_within_the_join_timeout_exit_124(tmp_path, rank):
    """--join-timeout is said when the wait starts, and running out of it is no usage error (2):
    the launcher exits 124, as GNU timeout, for node 0 (nobody came) and another node (node 0
    never answered)."""
    (tmp_path / "train.py").write_text("")
    (port,) = free_ports(1)
    options = ["--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1"]
    node = _launcher(tmp_path, "alone", *options, "--master-port", str(port), "--join-timeout", "1")
    try:
        result = node.wait(60)
    finally:
        node.kill_group()
    assert result.returncode == 124, result.stdout
    lines = result.stdout.splitlines()
    who = "node 0" if rank == 0 else "node 1 of 2"
    assert lines[0].startswith(f"[stratagem] {who} waiting up to 1 s (--join-timeout)"), lines
    assert lines[-1].startswith("stratagem run: "), lines
    assert "1 s (--join-timeout)" in lines[-1], lines


def test_join_timeout_needs_nnodes_and_a_positive_value(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ok.py").write_text("")
    assert main(["run", "--join-timeout", "5", "ok.py"]) == 2
    assert "--join-timeout needs --nnodes" in capsys.readouterr().err
    assert main(["run", *NODE0, "--join-timeout", "0", "ok.py"]) == 2
    assert "--join-timeout must be a number of seconds above 0, got 0" in capsys.readouterr().err


def test_a_launcher_waiting_for_the_other_nodes_stops_on_sigterm(tmp_path):
    (tmp_path / "train.py").write_text("")
    (port,) = free_ports(1)
    options = ["--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1"]
    node0 = _launcher(tmp_path, "alone", *options, "--master-port", str(port))
    try:
        deadline = time.monotonic() + 60
        while "missing: node 1" not in node0.output_so_far():
            assert node0.proc.poll() is None, node0.output_so_far()
            assert time.monotonic() < deadline, "node 0 never said it waits for node 1"
            time.sleep(0.05)
        node0.proc.send_signal(signal.SIGTERM)
        result = node0.wait(60)
    finally:
        node0.kill_group()
    assert result.returncode == 128 + signal.SIGTERM, result.stdout
    assert "[stratagem] job stopped: received SIGTERM while the nodes met" in result.stdout


def test_a_multinode_job_needs_a_secret_and_every_node_the_same(tmp_path):
    """Issue 14: a job over several machines is refused without a secret (each launcher would
    make its own), and the launchers' meeting is signed with it: a node given another secret
    is refused by node 0 and learns nothing of the job."""
    nodes = Nodes(2, 1, "127.0.0.1", free_ports(1)[0], timeout_s=60)
    with pytest.raises(LaunchError, match="needs one secret for all its nodes: set STRATAGEM"):
        make_node_tasks(nodes, 1, host="127.0.0.1", restart=0, base_env={}, omp_threads=1,
                        log=print)  # fmt: skip
    (port,) = free_ports(1)
    errors: dict[int, str] = {}

    def node(rank: int, secret: str) -> None:
        nodes = Nodes(2, rank, "127.0.0.1", port, timeout_s=60)
        env = {"STRATAGEM_JOB_SECRET": secret}
        try:
            make_node_tasks(nodes, 1, host="127.0.0.1", restart=0, base_env=env, omp_threads=1,
                            log=print)  # fmt: skip
        except LaunchError as e:
            errors[rank] = str(e)

    threads = [
        threading.Thread(target=node, args=(0, "9" * 64)),
        threading.Thread(target=node, args=(1, "8" * 64)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert "a node's launcher sent a message that fails the job secret's check" in errors[0]
    # Node 0's answer (its refusal) is signed with the job's secret: node 1 cannot trust it.
    assert errors[1].startswith("node 0's answer at 127.0.0.1:"), errors[1]
    assert "fails the job secret's check" in errors[1]
