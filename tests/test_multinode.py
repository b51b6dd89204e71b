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
from stratagem.cluster.nodes import meet_nodes

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


def make_node_tasks(nodes, workers: int, **options):
    """This node's tasks from one meeting of the nodes (``meet_nodes``), its links closed: what
    a launcher without restarts keeps of the meeting."""
    met = meet_nodes(nodes, workers, **options)
    if met is None:
        return None
    met.close()
    return met.tasks


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
    assert (
        "[stratagem] all 2 nodes arrived: node 0 (127.0.0.1: 1 worker), node 1 (127.0.0.2" in out0
    )
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
            [*NODE0, "--chief-node", "1"],
            "--chief-node places a task the job does not have: it needs --chief",
        ),
        ([*NODE0, "--chief", "--chief-node", "2"], "--chief-node 2 is out of range for --nnodes 2"),
        ([*NODE0, "--ps", "2", "--ps-nodes", "0,x"], "--ps-nodes expects node ranks separated by"),
        ([*NODE0, "--ps", "2", "--ps-nodes", "1,3"], "--ps-nodes 1,3 names node 3, out of range"),
        ([*NODE0, "--ps", "2", "--ps-nodes", "1,1"], "--ps-nodes 1,1 names a node twice"),
        (
            [*NODE0, "--chief", "--ps", "1", "--restart-workers", "1"],
            "--nnodes cannot restart a worker alone yet (got --restart-workers 1)",
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
    assert errors[1].startswith("node 0's launcher at 127.0.0.1:"), errors[1]
    assert "fails the job secret's check" in errors[1]


def _meet(options: dict[int, dict], workers: dict[int, int] | None = None) -> dict[int, object]:
    """Two nodes' launchers meeting in threads, each with its own role options (keyword
    arguments of make_node_tasks); what each got: its tasks or its error."""
    (port,) = free_ports(1)
    got: dict[int, object] = {}

    def node(rank: int) -> None:
        extra = dict(options[rank])
        placement = {
            k: extra.pop(k) for k in ("ps_nodes", "chief_node", "evaluator_node") if k in extra
        }
        nodes = Nodes(2, rank, "127.0.0.1", port, timeout_s=60, **placement)
        try:
            got[rank] = make_node_tasks(
                nodes, (workers or {}).get(rank, 1), host="127.0.0.1", restart=0, base_env=SECRET,
                omp_threads=1, log=lambda _: None, **extra,
            )  # fmt: skip
        except LaunchError as e:
            got[rank] = str(e)

    threads = [threading.Thread(target=node, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    return got


@pytest.mark.parametrize(
    "node0, node1, expected",
    [
        (
            {"ps": 2},
            {"ps": 1},
            "node 1 was started with --ps 1 but node 0 of 2 with --ps 2; "
            "every node needs the same --ps",
        ),
        ({"chief": True}, {}, "node 1 was started without --chief but node 0 of 2 with --chief"),
        (
            {"chief": True, "evaluator": True},
            {"chief": True, "evaluator": True, "evaluator_node": 1},
            "node 1 was started with --evaluator-node 1 but node 0 of 2 with --evaluator-node 0",
        ),
        (
            {"ps": 2, "ps_nodes": (1,)},
            {"ps": 2},
            "node 1 was started without --ps-nodes but node 0 of 2 with --ps-nodes 1",
        ),
        (
            {"max_restarts": 1},
            {},
            "node 1 was started with --max-restarts 0 but node 0 of 2 with --max-restarts 1",
        ),
    ],
)
def test_nodes_started_with_different_role_options_are_refused_naming_option_and_nodes(
    node0, node1, expected
):
    got = _meet({0: node0, 1: node1})
    assert isinstance(got[0], str) and expected in got[0], got[0]
    assert isinstance(got[1], str) and got[1].startswith(f"node 0 refused node 1 of 2: {expected}")


def test_every_node_builds_the_same_cluster_from_the_documented_placement():
    """--chief --ps 3 --evaluator --evaluator-node 1 over two nodes, node 1 with -n 2: the
    chief on node 0, ps j on node j mod 2, the evaluator on node 1, workers in node order; every
    task of both nodes holds the same cluster."""
    options = {"ps": 3, "chief": True, "evaluator": True, "evaluator_node": 1}
    got = _meet({0: options, 1: options}, workers={0: 1, 1: 2})
    tasks = {rank: got[rank] for rank in (0, 1)}
    assert all(isinstance(t, list) for t in tasks.values()), got
    names = {rank: [t.name for t in tasks[rank]] for rank in (0, 1)}
    assert names[0] == ["chief", "worker 0", "ps 0", "ps 2"]
    assert names[1] == ["worker 1", "worker 2", "ps 1", "evaluator"]
    configs = [json.loads(t.env["TF_CONFIG"]) for rank in (0, 1) for t in tasks[rank]]
    assert all(c["cluster"] == configs[0]["cluster"] for c in configs)
    address = {t.name: t.address for rank in (0, 1) for t in tasks[rank]}
    assert configs[0]["cluster"] == {
        "chief": [address["chief"]],
        "worker": [address["worker 0"], address["worker 1"], address["worker 2"]],
        "ps": [address["ps 0"], address["ps 1"], address["ps 2"]],
        "evaluator": [address["evaluator"]],
    }
    # Each task's own entry, as TF_CONFIG names it.
    assert [c["task"] for c in configs[4:]] == [
        {"type": "worker", "index": 1},
        {"type": "worker", "index": 2},
        {"type": "ps", "index": 1},
        {"type": "evaluator", "index": 0},
    ]


def test_a_node_with_ps_tasks_only_and_a_job_without_workers():
    """-n 0 makes a node for ps tasks (--ps-nodes 1); a node given no task at all is refused
    before the meeting, and a job whose nodes all have -n 0 and no chief once they met."""
    only = {"ps": 1, "ps_nodes": (1,)}
    got = _meet({0: only, 1: only}, {0: 1, 1: 0})
    assert [t.name for t in got[1]] == ["ps 0"], got
    nodes = Nodes(2, 0, "127.0.0.1", free_ports(1)[0], timeout_s=60, ps_nodes=(1,))
    with pytest.raises(LaunchError, match="node 0 of 2 would run no task: -n 0 and none of"):
        make_node_tasks(nodes, 0, host="127.0.0.1", restart=0, base_env=SECRET, omp_threads=1,
                        log=print, ps=1)  # fmt: skip
    got = _meet({0: {"ps": 2}, 1: {"ps": 2}}, {0: 0, 1: 0})
    for rank in (0, 1):
        assert "the job has no worker and no chief: every node was started with -n 0" in got[rank]


def test_a_node_with_ps_tasks_only_waits_for_them_to_end_on_their_own(tmp_path):
    """On a node without chief or workers, nothing local says the job is done: the ps (which
    serves until every worker said goodbye) is waited for, not stopped after the grace period."""
    import io

    from stratagem.cluster.attempt import Console, Job
    from stratagem.cluster.launcher import Task

    served = tmp_path / "served"
    code = f"import time; time.sleep(0.5); open({str(served)!r}, 'w').close()"
    task = Task("ps", 0, "127.0.0.1:1", child_env())
    out, err = io.StringIO(), io.StringIO()
    with Job([task], ["-c", code], grace_period=0, console=Console(out, err)) as job:
        job.start()
        outcome = job.wait()
    assert outcome is not None and outcome.exit_code == 0, err.getvalue()
    assert outcome.reason == "1 ps exited 0" and served.exists(), err.getvalue()
    assert "ps 0 exited 0" in err.getvalue()


def test_with_the_chief_on_another_node_worker_0_is_a_worker_that_may_be_lost():
    """--tolerate-worker-loss on a node whose worker 0 is not the chief (the job's chief runs on
    another node, as its TF_CONFIG says): its loss is tolerated, not the job's end."""
    import io

    from stratagem.cluster.attempt import Console, Job
    from stratagem.cluster.launcher import Task, build_tf_configs

    cluster = {"chief": ["10.0.0.2:1"], "worker": ["10.0.0.1:2"], "ps": ["10.0.0.1:3"]}
    config = build_tf_configs(cluster)["worker", 0]
    task = Task("worker", 0, "10.0.0.1:2", child_env({"TF_CONFIG": config}))
    out, err = io.StringIO(), io.StringIO()
    job = Job([task], ["-c", "raise SystemExit(3)"], grace_period=0, console=Console(out, err),
              tolerate_worker_loss=True)  # fmt: skip
    with job:
        job.start()
        outcome = job.wait()
    assert outcome is not None, err.getvalue()
    assert (outcome.exit_code, outcome.reason) == (0, "no task left (1 worker lost)")
    assert "worker 0 was lost: exit code 3; the job goes on without it" in err.getvalue()


AGREED = """\
import json, os, sys, time
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
attempt = int(os.environ["STRATAGEM_RESTART_COUNT"])
print("attempt", attempt, flush=True)
if sys.argv[1] == "die" and index == 2 and attempt == 0:
    os.kill(os.getppid(), 9)  # node 2's launcher dies (its machine, as far as the job sees)
    sys.exit(0)
if sys.argv[1] in ("hold", "die"):
    print("ready", flush=True)
    time.sleep(600)  # until its launcher stops it
if index == 1 and attempt < int(sys.argv[1]):
    sys.exit(3)
"""


def _two_nodes(tmp_path, *options: str, nnodes: int = 2) -> list[Process]:
    """Node 0 (127.0.0.1), node 1 (127.0.0.2), ..., one worker each, running agreed.py with
    the last of ``options`` as its argument."""
    (tmp_path / "agreed.py").write_text(AGREED)
    (port,) = free_ports(1)
    common = [
        "--nnodes",
        str(nnodes),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "-n",
        "1",
    ]
    argv = [sys.executable, "-m", "stratagem.cli", "run"]
    nodes = []
    for rank, host in ((r, f"127.0.0.{r + 1}") for r in range(nnodes)):
        mine = ["--node-rank", str(rank), "--host", host, *common, *options[:-1], "agreed.py"]
        nodes.append(
            Process(
                [*argv, *mine, options[-1]],
                child_env(SECRET),
                tmp_path,
                f"node{rank}",
                merge_output=True,
            )
        )
    return nodes


@pytest.mark.multiprocess
@pytest.mark.skipif(not _second_loopback_usable(), reason="127.0.0.2 is not usable here")
@pytest.mark.parametrize("failures, code", [(1, 0), (2, 3)])
def test_a_task_failing_on_one_node_restarts_the_job_on_every_node(tmp_path, failures, code):
    """--max-restarts 1: worker 1 (node 1) fails in the first attempt (or in both); worker 0
    (node 0) ended well, yet its node runs attempt 2 too, as node 0 decided for the job; once
    restarts ran out, every node ends with the failed task's code."""
    node0, node1 = _two_nodes(tmp_path, "--max-restarts", "1", str(failures))
    try:
        results = [node0.wait(60), node1.wait(60)]
    finally:
        for p in (node0, node1):
            p.kill_group()
    restart = (
        "restarting the job on every node (restart 1 of 1): node 1: worker 1 failed: exit code 3"
    )
    for rank, r in enumerate(results):
        assert r.returncode == code, f"node {rank} exited {r.returncode}:\n{r.stdout}"
        assert restart in r.stdout and "all 2 nodes arrived for attempt 2: " in r.stdout, r.stdout
        last = r.stdout.strip().splitlines()[-1]
        if code == 0:
            assert last.startswith("[stratagem] job finished: 1 worker exited 0; every node's"), (
                last
            )
        else:
            expected = "job failed: node 1: worker 1 failed: exit code 3 (after 1 restart)"
            assert last == f"[stratagem] {expected}", last
    assert (
        "[worker 0] attempt 0\n" in results[0].stdout
        and "[worker 0] attempt 1\n" in results[0].stdout
    )


@pytest.mark.multiprocess
@pytest.mark.skipif(not _second_loopback_usable(), reason="127.0.0.2 is not usable here")
def test_a_node_stopped_by_a_signal_ends_the_job_on_every_node_without_a_restart(tmp_path):
    node0, node1 = _two_nodes(tmp_path, "--max-restarts", "1", "--grace-period", "0.5", "hold")
    try:
        deadline = time.monotonic() + 60
        while not all("] ready" in p.output_so_far() for p in (node0, node1)):
            assert node0.proc.poll() is None and node1.proc.poll() is None, node0.output_so_far()
            assert time.monotonic() < deadline, "the workers did not start in 60 s"
            time.sleep(0.05)
        node1.proc.send_signal(signal.SIGTERM)
        results = [node0.wait(60), node1.wait(60)]
    finally:
        for p in (node0, node1):
            p.kill_group()
    assert results[1].returncode == 143, results[1].stdout
    assert results[0].returncode == 143, results[0].stdout
    last = results[0].stdout.strip().splitlines()[-1]
    assert last == "[stratagem] job failed: node 1: launcher stopped: received SIGTERM", last
    assert "restarting" not in results[0].stdout + results[1].stdout


@pytest.mark.multiprocess
@pytest.mark.skipif(not _second_loopback_usable(), reason="127.0.0.2 is not usable here")
def test_a_node_that_never_comes_back_ends_the_job_on_every_other_node_with_124(tmp_path):
    """Node 2's launcher dies mid-attempt (its worker kills it): node 0 restarts the job, node 1
    comes to the meeting for attempt 2, node 2 never does; past --join-timeout both end with
    exit code 124, node 1 told by node 0 (or by its own deadline, whichever is first)."""
    nodes = _two_nodes(
        tmp_path, "--max-restarts", "1", "--grace-period", "0.5", "--join-timeout", "2", "die",
        nnodes=3,
    )  # fmt: skip
    try:
        results = [p.wait(60) for p in nodes]
    finally:
        for p in nodes:
            p.kill_group()
    out0, out1 = results[0].stdout, results[1].stdout
    assert results[2].returncode == -signal.SIGKILL, results[2].stdout
    assert results[0].returncode == 124, out0
    assert "node 2's launcher was lost (" in out0, out0
    assert "for the other nodes for attempt 2; missing: node 2." in out0, out0
    assert results[1].returncode == 124, out1
    assert "(--join-timeout)" in out1.strip().splitlines()[-1], out1
