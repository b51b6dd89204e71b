"""Jobs over several "machines" made of network namespaces: each node's ``stratagem run --nnodes``
runs in its own namespace, with its own address on a bridge (10.77.0.R+1/24), so the tasks of
different nodes reach each other only over that link, as on separate hosts; the file system is
shared (as an NFS home would be). Needs root and iproute2's ``ip``; skipped otherwise.

The bridge lives in a namespace of its own (the hub), joined to each node's namespace by a veth
pair: nothing of the host's network is touched, and the namespaces' names carry this run's pid,
so runs side by side never meet. The fixture always deletes what it made, also on failure.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from cluster_utils import WORKERS, Process, Result, child_env, free_ports

pytestmark = pytest.mark.multiprocess

IP = shutil.which("ip") or "/usr/sbin/ip"
SECRET = {"STRATAGEM_JOB_SECRET": "7" * 64}  # the one secret every node's launcher is given
SCRIPT = str(WORKERS / "multihost_job.py")
_runs = itertools.count()


def _ip(*args: str) -> None:
    subprocess.run([IP, *args], check=True, capture_output=True, text=True, timeout=30)


@dataclass
class Hosts:
    """``count`` namespaces on one bridge; ``address(r)`` is node r's, ``launch`` starts a
    node's launcher inside node r's namespace."""

    tag: str
    count: int
    workdir: Path
    processes: list[Process] = field(default_factory=list)

    @property
    def hub(self) -> str:
        return f"sg{self.tag}hub"

    def namespace(self, rank: int) -> str:
        return f"sg{self.tag}n{rank}"

    @staticmethod
    def address(rank: int) -> str:
        return f"10.77.0.{rank + 1}"

    def create(self) -> None:
        _ip("netns", "add", self.hub)
        _ip("-n", self.hub, "link", "set", "lo", "up")
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for rank in range(self.count):
            ns = self.namespace(rank)
            _ip("netns", "add", ns)
            _ip(
                "-n",
                self.hub,
                "link",
                "add",
                f"v{rank}",
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                ns,
            )
            _ip("-n", self.hub, "link", "set", f"v{rank}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(rank)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")  # the tasks of one node meet on it too

    def cut(self, rank: int) -> None:
        """Cut node ``rank``'s link, at the bridge's side (its cable pulled)."""
        _ip("-n", self.hub, "link", "set", f"v{rank}", "down")

    def mend(self, rank: int) -> None:
        """Put node ``rank``'s link back (``cut``'s cable plugged in again)."""
        _ip("-n", self.hub, "link", "set", f"v{rank}", "up")

    def kill(self, rank: int) -> None:
        """Node ``rank``'s machine dies: SIGKILL every process in its namespace (its launcher
        and its tasks, which run in their own process groups), all started by this test. A
        namespace that is not there (its making failed) has none."""
        pids = subprocess.run(
            [IP, "netns", "pids", self.namespace(rank)],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def launch(
        self, rank: int, *options: str, mode: str, env: dict[str, str] | None = None
    ) -> Process:
        argv = [
            IP,
            "netns",
            "exec",
            self.namespace(rank),
            sys.executable,
            "-m",
            "stratagem.cli",
            "run",
            "--nnodes",
            str(self.count),
            "--node-rank",
            str(rank),
            "--master-addr",
            self.address(0),
            "--join-timeout",
            "60",
            *options,
            SCRIPT,
            mode,
        ]
        process = Process(
            argv,
            child_env({**SECRET, **(env or {})}),
            self.workdir,
            f"node{rank}",
            merge_output=True,
        )
        self.processes.append(process)
        return process

    def run(
        self,
        options: dict[int, list[str]],
        mode: str,
        timeout: float = 120,
        env: dict[str, str] | None = None,
    ) -> list[Result]:
        """Every node's launcher with its options and the script's MODE; their results."""
        nodes = [self.launch(r, *options[r], mode=mode, env=env) for r in range(self.count)]
        deadline = time.monotonic() + timeout
        return [p.wait(max(1.0, deadline - time.monotonic())) for p in nodes]

    def delete(self) -> None:
        for p in self.processes:  # the launchers' groups; a killed node's tasks went with it
            p.kill_group()
        for rank in range(self.count):
            self.kill(rank)  # tasks of a launcher that died without stopping them
        for p in self.processes:
            if p.proc.poll() is None:
                p.proc.wait(timeout=30)
        # Deleting a namespace deletes its end of each veth pair, and with it the other end.
        for ns in [*(self.namespace(r) for r in range(self.count)), self.hub]:
            subprocess.run([IP, "netns", "del", ns], capture_output=True, timeout=30)


def _why_no_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not os.path.exists(IP):
        return "iproute2's `ip` is not installed"
    probe = f"sg{os.getpid()}probe"
    made = subprocess.run([IP, "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    try:
        bridge = subprocess.run(
            [IP, "-n", probe, "link", "add", "br0", "type", "bridge"],
            capture_output=True,
            text=True,
        )
        if bridge.returncode != 0:
            return f"cannot make a bridge in a namespace: {bridge.stderr.strip()}"
    finally:
        subprocess.run([IP, "netns", "del", probe], capture_output=True)
    return None


@contextlib.contextmanager
def _namespaces(workdir: Path) -> Iterator[Callable[[int], Hosts]]:
    """``make(n)``: n namespaces on one bridge, all deleted on leaving (their processes killed
    first), whatever happened; skips the test when namespaces cannot be made here."""
    why = _why_no_namespaces()
    if why is not None:
        pytest.skip(why)
    made: list[Hosts] = []

    def make(count: int) -> Hosts:
        h = Hosts(f"{os.getpid()}x{next(_runs)}", count, workdir)
        made.append(h)
        h.create()
        return h

    try:
        yield make
    finally:
        for h in made:
            h.delete()


@pytest.fixture
def hosts(tmp_path) -> Iterator[Callable[[int], Hosts]]:
    with _namespaces(tmp_path) as make:
        yield make


def _ok(results: list[Result]) -> str:
    """Every node's output, after checking each launcher exited 0."""
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"node {rank} exited {r.returncode}:\n{r.stdout}"
    return "\n".join(r.stdout for r in results)


def test_two_hosts_train_with_multiworker_mirrored(hosts):
    """Node 0 runs workers 0 and 1, node 1 (-n 1) worker 2; the all-reduce gives the job's sum
    on every worker, over the link between the namespaces."""
    h = hosts(2)
    results = h.run({0: ["-n", "2"], 1: ["-n", "1"]}, "mwms")
    _ok(results)
    out0, out1 = results[0].stdout, results[1].stdout
    for worker, out in (("worker 0", out0), ("worker 1", out0), ("worker 2", out1)):
        assert f"[{worker}] cluster " in out and "sum 6.0" in out, out
    clusters = {
        line.split("cluster ", 1)[1].split(" sum ")[0]
        for line in (out0 + out1).splitlines()
        if "] cluster " in line
    }
    assert len(clusters) == 1, clusters
    workers = json.loads(clusters.pop())["worker"]
    assert [w.rsplit(":", 1)[0] for w in workers] == ["10.77.0.1", "10.77.0.1", "10.77.0.2"]
    assert (
        "all 2 nodes arrived: node 0 (10.77.0.1: 2 workers), node 1 (10.77.0.2: 1 worker)" in out0
    )


@pytest.fixture(scope="module")
def ps_job(tmp_path_factory) -> list[Result]:
    """One parameter-server job over three hosts, for the tests below: ``--chief --chief-node 1
    --ps 2 --evaluator --evaluator-node 2``, node 2 with -n 0. Placement: worker 0 and ps 0 on
    node 0; the chief, worker 1 and ps 1 on node 1; the evaluator alone on node 2."""
    with _namespaces(tmp_path_factory.mktemp("ps_job")) as make:
        h = make(3)
        roles = [
            "--chief",
            "--chief-node",
            "1",
            "--ps",
            "2",
            "--evaluator",
            "--evaluator-node",
            "2",
        ]
        options = {0: ["-n", "1", *roles], 1: ["-n", "1", *roles], 2: ["-n", "0", *roles]}
        results = h.run(options, "ps")
    _ok(results)
    return results


def test_a_parameter_server_job_places_every_role_over_three_hosts(ps_job):
    out0, out1, out2 = (r.stdout for r in ps_job)
    arrived = (
        "all 3 nodes arrived: node 0 (10.77.0.1: 1 worker and 1 ps), node 1 (10.77.0.2: "
        "1 chief, 1 worker and 1 ps), node 2 (10.77.0.3: 1 evaluator)"
    )
    assert all(arrived in out for out in (out0, out1, out2)), out0
    for name, out, host in (
        ("worker 0", out0, "10.77.0.1"),
        ("ps 0", out0, "10.77.0.1"),
        ("chief", out1, "10.77.0.2"),
        ("worker 1", out1, "10.77.0.2"),
        ("ps 1", out1, "10.77.0.2"),
        ("evaluator", out2, "10.77.0.3"),
    ):
        assert re.search(rf"\[stratagem\] {name} pid \d+ at {re.escape(host)}:\d+\n", out), out
    # Every task holds the whole job (the chief's start line counts it), and every node's
    # launcher ends when its own tasks did: node 2's when its evaluator ended on its own.
    assert "[chief] [stratagem] chief of 1 chief, 2 workers, 2 ps, 1 evaluator (TF_CONFIG)" in out1
    assert "job finished: 1 worker exited 0" in out0
    assert "job finished: 1 chief and 1 worker exited 0" in out1
    assert "job finished: 1 evaluator exited 0" in out2


def _hand_trained_regression() -> tuple[list[float], dict[str, list]]:
    """The coordinated steps in one process: the chief's seeded layer, SGD on the squared error
    (the data as tests/workers/multihost_job.py's ``regression_data``)."""
    generator = torch.Generator().manual_seed(1)
    x, target = torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    losses = []
    for _ in range(4):
        optimizer.zero_grad()
        loss = (layer(x) - target).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: p.detach().tolist() for n, p in layer.named_parameters()}


def test_a_cluster_coordinator_schedules_on_workers_of_both_hosts(ps_job):
    """The chief (node 1) schedules one function that runs on each worker (nodes 0 and 1), and
    training steps on variables held by ps 0 (node 0) and ps 1 (node 1)."""
    out0, out1 = ps_job[0].stdout, ps_job[1].stdout
    (line,) = [line for line in out1.splitlines() if "[chief] RESULT " in line]
    result = json.loads(line.split("RESULT ", 1)[1])
    assert result["workers"] == [0, 1], out1
    # Where the variables live: each whole on one ps, one on each (balanced by bytes), and
    # those ps on the two hosts.
    placement = result["placement"]
    assert sorted(placement) == ["bias", "weight"], result
    assert sorted(ps for shards in placement.values() for ps in shards) == [0, 1], result
    assert re.search(r"\[stratagem\] ps 0 pid \d+ at 10\.77\.0\.1:", out0), out0
    assert re.search(r"\[stratagem\] ps 1 pid \d+ at 10\.77\.0\.2:", out1), out1
    # Each ps holds one shard and applied each of the 4 steps' gradients to it.
    assert [(s["shards"], s["applied"]) for s in result["ps_stats"]] == [(1, 4), (1, 4)], result
    # What they hold: the values of the same steps in one process (the steps ran one at a
    # time, so in order; float32 SGD, the update applied on the ps as torch.optim.SGD does).
    losses, weights = _hand_trained_regression()
    assert result["losses"] == pytest.approx(losses, rel=1e-6), result
    for name, value in weights.items():
        torch.testing.assert_close(
            torch.tensor(result["after"][name]), torch.tensor(value), rtol=1e-6, atol=1e-7
        )


def test_model_fit_on_the_chief_and_a_sidecar_evaluator_on_another_host(ps_job):
    """Model.fit under ParameterServerStrategy on the chief writes ckpt/ckpt-1 (the hosts
    share a file system); the evaluator on node 2 evaluates it and ends."""
    assert "[chief] fit done: loss " in ps_job[1].stdout, ps_job[1].stdout
    out2 = ps_job[2].stdout
    assert re.search(r"\[evaluator\] evaluated ckpt-1 step \S+ logs .*accuracy", out2), out2
    assert "[stratagem] evaluator exited 0" in out2, out2


OP_TIMEOUT_S = 5  # STRATAGEM_OP_TIMEOUT: how long a collective waits for a silent peer


def _training(h: Hosts, op_timeout_s: int = OP_TIMEOUT_S) -> list[Process]:
    """Both nodes' launchers running the all-reduce loop, once node 1's worker has done three
    steps (so the job is past its start)."""
    env = {"STRATAGEM_OP_TIMEOUT": str(op_timeout_s)}
    nodes = [h.launch(r, "-n", "1", "--grace-period", "30", mode="loop", env=env) for r in (0, 1)]
    deadline = time.monotonic() + 90
    while "[worker 1] step 3 " not in nodes[1].output_so_far():
        for p in nodes:
            assert p.proc.poll() is None, p.output_so_far()
        assert time.monotonic() < deadline, "the job did not reach step 3 in 90 s"
        time.sleep(0.05)
    return nodes


def _named(result: Result, survivor: str, lost: str, errors: tuple[str, ...]) -> str:
    """The survivor's launcher failed, its task's last word one block naming one of ``errors``
    and the lost task; the block's text."""
    out = result.stdout
    assert result.returncode != 0, out
    lines = out.splitlines()
    first = [i for i, line in enumerate(lines) if line.startswith(f"[{survivor}] stratagem: ")]
    assert first, out
    head = lines[first[0]]
    assert any(
        head.startswith(f"[{survivor}] stratagem: {e} on {survivor} (10.77.0.") for e in errors
    ), out
    # The block: its first line and the indented ones after it.
    indented = f"[{survivor}]   "
    block = "\n".join(
        [head, *itertools.takewhile(lambda line: line.startswith(indented), lines[first[0] + 1 :])]
    )
    assert lost in block and " during all_reduce of " in block, out
    assert "Traceback" not in out, out
    assert f"[stratagem] job failed: {survivor} failed: exit code 1" in out, out
    return block


def test_a_killed_host_is_named_by_the_other_within_the_operation_timeout(hosts):
    """Node 1's machine dies (every process in its namespace killed at once): node 0's worker
    names worker 1 as lost, and its launcher ends the job, within the operation timeout: the
    closed connection tells, not the timeout. The timeout is long here (60 s) so that the
    bound is one no load comes near (the job ends in seconds), yet one that waiting for the
    timeout could not meet: node 0's launcher must have ended by then."""
    op_timeout_s = 60
    h = hosts(2)
    node0, node1 = _training(h, op_timeout_s)
    h.kill(1)
    result = node0.wait(op_timeout_s)  # raises if node 0 is still running at the timeout
    node1.wait(30)
    block = _named(result, "worker 0", "worker 1 (10.77.0.2:", ("PeerLostError",))
    assert "Connection reset by peer" in block or "Connection closed by peer" in block, block
    assert "Timed out waiting" not in block, block


def test_a_cut_link_is_named_on_both_sides_after_the_operation_timeout(hosts):
    """Node 1's link goes down mid-training (no FIN, no RST: the peer just falls silent): each
    side's worker names the other after the operation timeout (its error says it waited that
    long: no clock of the test's, which load would make unsure), and both launchers end. The
    peer's liveness port cannot be reached either: the report says it is unreachable (its
    machine or the network to it is down), not that it ended ("does not answer" is for a peer
    that is reached but stopped)."""
    h = hosts(2)
    node0, node1 = _training(h)
    h.cut(1)
    # A deadline for the test, not the claim: after the timeout, each side probes the other's
    # liveness port, which cannot answer through a cut link either.
    results = [node0.wait(OP_TIMEOUT_S + 60), node1.wait(OP_TIMEOUT_S + 60)]
    for result, survivor, lost in (
        (results[0], "worker 0", "worker 1 (10.77.0.2:"),
        (results[1], "worker 1", "worker 0 (10.77.0.1:"),
    ):
        block = _named(result, survivor, lost, ("PeerLostError", "CollectiveTimeoutError"))
        assert f"Timed out waiting {OP_TIMEOUT_S * 1000}ms" in block, block
        assert "unreachable: no answer at all" in block, block
        assert "Its own output says why it ended" not in block, block


# --- restarts agreed by every node (--max-restarts with --nnodes) -----------------------------

RESTARTS = ["-n", "1", "--max-restarts", "1", "--grace-period", "1"]


def _same_weights(out: str, worker: str) -> None:
    """``worker`` resumed from the checkpoint of step 2 and ended with the weights of the same
    six steps run without interruption."""
    assert f"[{worker}] restored step 2\n" in out, out
    (weights,) = re.findall(rf"\[{worker}\] WEIGHTS (\w+)", out)
    (reference,) = re.findall(rf"\[{worker}\] REFERENCE (\w+)", out)
    assert weights == reference, out


def _holding(h: Hosts, *, join_timeout: str = "60") -> list[Process]:
    """Both nodes' launchers on the ``resume`` job, once node 1's worker holds at step 3 (its
    launcher's node to be killed)."""
    nodes = [
        h.launch(r, *RESTARTS, "--join-timeout", join_timeout, mode="resume", env={"FAULT": "hold"})
        for r in (0, 1)
    ]
    deadline = time.monotonic() + 90
    while "[worker 1] holding at step 3" not in nodes[1].output_so_far():
        for p in nodes:
            assert p.proc.poll() is None, p.output_so_far()
        assert time.monotonic() < deadline, "worker 1 did not reach step 3 in 90 s"
        time.sleep(0.05)
    return nodes


def test_a_task_that_fails_on_one_node_restarts_the_job_on_both(hosts):
    """Worker 1 (node 1) exits 3 after step 3: node 1's launcher tells node 0's, which decides
    a restart for the whole job; both nodes meet again for attempt 2, resume from the checkpoint
    of step 2 and end with the weights of an uninterrupted run."""
    h = hosts(2)
    results = h.run({0: RESTARTS, 1: RESTARTS}, "resume", env={"FAULT": "exit"})
    out = _ok(results)
    out0, out1 = results[0].stdout, results[1].stdout
    assert "[stratagem] worker 1 failed: exit code 3" in out1, out1
    # Node 0's decision names the first failure it saw, on the node where it happened: worker
    # 1's own, or worker 0's (its all-reduce lost worker 1), whichever ended first.
    restart = re.compile(
        r"restarting the job on every node \(restart 1 of 1\): "
        r"(node 1: worker 1 failed: exit code 3|node 0: worker 0 failed: exit code 1)\n"
    )
    for o in (out0, out1):
        assert restart.search(o), o
        assert "all 2 nodes arrived for attempt 2: " in o, o
        assert "job finished: " in o and "every node's tasks ended well (2 nodes)" in o, o
    _same_weights(out, "worker 0")
    _same_weights(out, "worker 1")


def test_a_node_that_dies_and_comes_back_rejoins_the_restarted_job(hosts):
    """Node 1's machine dies mid-training (every process in it killed) and its launcher is
    started again: node 0 sees the link close, stops its tasks, and waits at the meeting, where
    node 1 rejoins; the job finishes from the checkpoint with the uninterrupted run's weights."""
    h = hosts(2)
    node0, _ = _holding(h)
    h.kill(1)
    again = h.launch(1, *RESTARTS, mode="resume", env={"FAULT": "hold"})
    results = [node0.wait(90), again.wait(90)]
    _ok(results)
    out0, out1 = results[0].stdout, results[1].stdout
    # Node 0 restarts on what it saw first: node 1's link closing, or its worker's all-reduce
    # losing worker 1.
    assert re.search(
        r"restarting the job on every node \(restart 1 of 1\): (node 1's launcher was lost "
        r"\(|node 0: worker 0 failed: exit code 1\n)",
        out0,
    ), out0
    assert "all 2 nodes arrived for attempt 2: " in out0 and "for attempt 2: " in out1, out1
    _same_weights(out0, "worker 0")
    _same_weights(out1, "worker 1")


def test_a_node_that_never_comes_back_ends_the_job_after_the_join_timeout(hosts):
    """Node 1's machine dies and stays down: node 0 restarts the job, waits --join-timeout for
    node 1 at the meeting, and ends with JoinTimeoutError (exit code 124) naming it."""
    h = hosts(2)
    node0, _ = _holding(h, join_timeout="3")
    h.kill(1)
    result = node0.wait(60)
    assert result.returncode == 124, result.stdout
    assert (
        "node 0 waited 3 s (--join-timeout) at 10.77.0.1:29500 for the other nodes for "
        "attempt 2; missing: node 1." in result.stdout
    ), result.stdout


def test_node_0_lost_ends_the_job_on_the_other_nodes(hosts):
    """Node 0's machine dies: node 1's launcher sees its control link close, stops its tasks
    and ends with NodeLostError (exit code 1): no node is left to hold the next meeting."""
    h = hosts(2)
    _, node1 = _holding(h)
    h.kill(0)
    result = node1.wait(60)
    assert result.returncode == 1, result.stdout
    assert "the attempt ends on another node: node 0's launcher was lost (" in result.stdout
    assert re.search(
        r"stratagem run: node 0's launcher at 10\.77\.0\.1:29500 was lost \(.*\) while node 1 of "
        r"2 waited for its word on attempt 1; a job whose node 0 is gone cannot restart",
        result.stdout,
    ), result.stdout


def test_a_cut_link_ends_the_job_on_both_sides_named(hosts):
    """Node 1's link goes down for good while its worker holds (no FIN, no RST): the control
    links' keepalive sees it on both sides, and both decide alike. Node 0 restarts the job and
    waits for node 1 at the meeting until --join-timeout (124); node 1, without node 0's word,
    meets it again as node 0 does, reaches nothing until its own --join-timeout, and ends with
    the same code naming the cut link (not as if node 0 were gone: its port never refused)."""
    h = hosts(2)
    node0, node1 = _holding(h, join_timeout="3")
    h.cut(1)
    results = [node0.wait(60), node1.wait(60)]
    out0, out1 = results[0].stdout, results[1].stdout
    assert results[0].returncode == 124, out0
    assert "missing: node 1." in out0, out0
    assert results[1].returncode == 124, out1
    assert (
        "stratagem run: node 1 of 2 lost its link to node 0's launcher at 10.77.0.1:29500 on "
        "attempt 1 (node 0's launcher at 10.77.0.1:29500 did not answer: the link timed out"
    ) in out1, out1
    assert "could not reach it again within 3 s (--join-timeout)" in out1, out1
    assert "the network between them is cut, or node 0's machine is down" in out1, out1


def test_a_node_that_lost_node_0s_link_meets_it_again_or_ends_named(tmp_path):
    """In one process: a node whose link to node 0 was lost meets node 0 again; a refused
    port there is node 0's launcher gone (``NodeLostError``, at once: node 0 listens for the
    whole job), while no answer is waited out to the join timeout (``JoinTimeoutError``, the
    cut link named). ``meeting_place`` keeps node 0's port between meetings."""
    from stratagem.cluster.nodes import (
        JoinTimeoutError,
        LostLink,
        NodeLostError,
        Nodes,
        meet_nodes,
        meeting_place,
    )

    (port,) = free_ports(1)
    options = {
        "host": "127.0.0.1",
        "restart": 1,
        "base_env": SECRET,
        "omp_threads": 1,
        "log": lambda line: None,
        "max_restarts": 1,
        "lost": LostLink("node 0's launcher did not answer: the link timed out", 0),
    }
    node1 = Nodes(2, 1, "127.0.0.1", port, timeout_s=30.0)
    started = time.monotonic()
    with pytest.raises(NodeLostError, match="and its port now refuses node 1 of 2: "):
        meet_nodes(node1, 1, **options)  # nothing listens there: refused
    assert time.monotonic() - started < 5.0  # at once, not after the 30 s join timeout
    # Node 0's port open (between its meetings): the connection waits in its backlog, and
    # nothing answers it within the join timeout, as through a cut link.
    with meeting_place(Nodes(2, 0, "127.0.0.1", port)):
        cut = Nodes(2, 1, "127.0.0.1", port, timeout_s=0.5)
        with pytest.raises(JoinTimeoutError, match="did not answer within the join timeout"):
            meet_nodes(cut, 1, **options)
