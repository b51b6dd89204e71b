"""Jobs over several "machines" made of network namespaces: each node's ``stratagem run --nnodes``
runs in its own namespace, with its own address on a bridge (10.77.0.R+1/24), so the tasks of
different nodes reach each other only over that link, as on separate hosts; the file system is
shared (as an NFS home would be). Needs root and iproute2's ``ip``; skipped otherwise.

The bridge lives in a namespace of its own (the hub), joined to each node's namespace by a veth
pair: nothing of the host's network is touched, and the namespaces' names carry this run's pid,
so runs side by side never meet. The fixture always deletes what it made, also on failure.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cluster_utils import WORKERS, Process, Result, child_env

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

    def kill(self, rank: int) -> None:
        """Node ``rank``'s machine dies: SIGKILL every process in its namespace (its launcher
        and its tasks, which run in their own process groups), all started by this test."""
        pids = subprocess.run(
            [IP, "netns", "pids", self.namespace(rank)],
            check=True,
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


@pytest.fixture
def hosts(tmp_path) -> Iterator[callable]:
    """``hosts(n)``: n namespaces on one bridge, deleted at the end of the test whatever
    happened (their processes killed first)."""
    why = _why_no_namespaces()
    if why is not None:
        pytest.skip(why)
    made: list[Hosts] = []

    def make(count: int) -> Hosts:
        h = Hosts(f"{os.getpid()}x{next(_runs)}", count, tmp_path)
        made.append(h)
        h.create()
        return h

    try:
        yield make
    finally:
        for h in made:
            h.delete()


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


def test_a_parameter_server_job_with_chief_and_evaluator_over_three_hosts(hosts):
    """``--chief --ps 2 --evaluator --evaluator-node 2``: the chief, worker 0 and ps 0 on node
    0, worker 1 and ps 1 on node 1, the evaluator alone on node 2 (-n 0). The chief fits under
    ParameterServerStrategy and checkpoints; the evaluator evaluates that checkpoint; node 2's
    launcher waits for its evaluator to end on its own."""
    h = hosts(3)
    roles = ["--chief", "--ps", "2", "--evaluator", "--evaluator-node", "2"]
    results = h.run({0: ["-n", "1", *roles], 1: ["-n", "1", *roles], 2: ["-n", "0", *roles]}, "ps")
    out = _ok(results)
    out0, out1, out2 = (r.stdout for r in results)
    assert (
        "all 3 nodes arrived: node 0 (10.77.0.1: 1 chief, 1 worker and 1 ps), node 1 "
        "(10.77.0.2: 1 worker and 1 ps), node 2 (10.77.0.3: 1 evaluator)" in out0
    )
    assert "[chief] fit done: loss " in out0, out
    assert re.search(r"\[evaluator\] evaluated ckpt-1 step \S+ logs .*accuracy", out2), out2
    assert "[stratagem] evaluator exited 0" in out2 and "job finished: 1 evaluator exited 0" in out2
    for name, node_out in (("ps 0", out0), ("ps 1", out1), ("worker 1", out1)):
        assert f"[stratagem] {name} pid " in node_out, node_out
    # Every task holds the whole job: its cluster names each node's address.
    config = re.search(r"\[stratagem\] ps 1 pid \d+ at (\S+)", out1)
    assert config is not None and config.group(1).startswith("10.77.0.2:"), out1


def test_a_cluster_coordinator_job_over_two_hosts(hosts):
    """``--chief --chief-node 1 --ps 2``: the chief on node 1 schedules functions that run on
    worker 0 (node 0) and worker 1 (node 1), and training steps on variables held by ps 0 (node
    0) and ps 1 (node 1)."""
    h = hosts(2)
    roles = ["-n", "1", "--chief", "--chief-node", "1", "--ps", "2"]
    results = h.run({0: roles, 1: roles}, "coordinator")
    out = _ok(results)
    assert (
        "all 2 nodes arrived: node 0 (10.77.0.1: 1 worker and 1 ps), node 1 (10.77.0.2: "
        "1 chief, 1 worker and 1 ps)" in results[0].stdout
    )
    (line,) = [line for line in results[1].stdout.splitlines() if "[chief] RESULT " in line]
    result = json.loads(line.split("RESULT ", 1)[1])
    assert result["workers"] == [0, 1], out
    assert len(result["losses"]) == 4 and all(loss >= 0 for loss in result["losses"]), result
    assert result["after"] != result["before"], result
