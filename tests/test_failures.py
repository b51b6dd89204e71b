"""Lost, missing, duplicated and mismatched peers: a clear error naming the peer, never a hang."""

from __future__ import annotations

import signal
import socket
import sys
import time

import pytest

from cluster_utils import WORKERS, Cluster, Process, child_env, free_ports, tf_config

pytestmark = pytest.mark.multiprocess

FAULTS = str(WORKERS / "faults.py")
QUICK = {"STRATAGEM_RENDEZVOUS_TIMEOUT": "4", "STRATAGEM_OP_TIMEOUT": "4"}


def _worker(tmp_path, workers: list[str], index: int, name: str, **env: str) -> Process:
    extra = {"TF_CONFIG": tf_config(workers, index), **env}
    return Process([sys.executable, FAULTS], child_env(extra), tmp_path, name)


def _wait_for_line(proc: Process, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while text not in proc.output_so_far():
        assert proc.proc.poll() is None, f"{proc.name} exited before printing {text!r}"
        assert time.monotonic() < deadline, f"{proc.name} never printed {text!r}"
        time.sleep(0.05)


@pytest.mark.parametrize("victim", [1, 0], ids=["kill-worker-1", "kill-the-store-host"])
def test_kill_9_of_a_worker_mid_training_names_the_lost_peer(tmp_path, victim):
    ports = free_ports(2)
    with Cluster(FAULTS, 2, tmp_path, ports=ports, env={"MODE": "train_forever"}) as cluster:
        survivor = cluster.processes[1 - victim]
        _wait_for_line(survivor, "step 20")
        cluster.processes[victim].kill_group(signal.SIGKILL)
        result = survivor.wait(timeout=60)  # bounds a hang; how fast is benchmarks/fault_matrix
    assert result.returncode != 0
    assert "PeerLostError" in result.stderr
    assert (
        f"worker {victim} (localhost:{ports[victim]}) was lost during all_reduce" in result.stderr
    )
    # No C++ stack traces from the store: the dead store is detected with a plain socket.
    assert "frame #" not in result.stderr, result.stderr


def test_a_peer_that_never_arrives_is_named(tmp_path):
    workers = [f"localhost:{p}" for p in free_ports(3)]
    lonely = _worker(tmp_path, workers, 0, "w0", **QUICK)
    result = lonely.wait(timeout=60)
    assert result.returncode != 0
    assert "RendezvousError" in result.stderr
    assert f"missing: worker 1 ({workers[1]}), worker 2 ({workers[2]})" in result.stderr


def test_a_missing_rendezvous_host_is_named(tmp_path):
    workers = [f"localhost:{p}" for p in free_ports(2)]
    result = _worker(tmp_path, workers, 1, "w1", **QUICK).wait(timeout=60)
    assert result.returncode != 0
    assert f"could not reach the rendezvous of worker 0 ({workers[0]})" in result.stderr
    assert "frame #" not in result.stderr, result.stderr


def test_port_in_use(tmp_path):
    ports = free_ports(2)
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", ports[0]))
    blocker.listen(1)
    try:
        workers = [f"localhost:{p}" for p in ports]
        result = _worker(tmp_path, workers, 0, "w0", **QUICK).wait(timeout=60)
    finally:
        blocker.close()
    assert result.returncode != 0
    assert f"port {ports[0]} is already in use" in result.stderr


def test_world_size_mismatch(tmp_path):
    ports = free_ports(3)
    two = [f"localhost:{p}" for p in ports[:2]]
    three = [f"localhost:{p}" for p in ports]
    a = _worker(tmp_path, two, 0, "w0", **QUICK)
    b = _worker(tmp_path, three, 1, "w1", **QUICK)
    results = [a.wait(timeout=60), b.wait(timeout=60)]
    for r in results:
        assert r.returncode != 0
    assert any("world-size mismatch" in r.stderr for r in results), results[0].stderr


def test_two_processes_claiming_one_task(tmp_path):
    workers = [f"localhost:{p}" for p in free_ports(3)]
    procs = [
        _worker(tmp_path, workers, 0, "w0", **QUICK),
        _worker(tmp_path, workers, 1, "w1a", **QUICK),
        _worker(tmp_path, workers, 1, "w1b", **QUICK),
    ]
    results = [p.wait(timeout=60) for p in procs]
    assert all(r.returncode != 0 for r in results)
    assert sum("two processes claim worker 1" in r.stderr for r in results) == 1


def test_workers_that_build_different_models(tmp_path):
    with Cluster(FAULTS, 2, tmp_path, env={"MODE": "model_mismatch", **QUICK}) as cluster:
        results = cluster.wait(timeout=90)
    for r in results:
        assert r.returncode != 0
        assert "every worker must build the same model" in r.stderr


def test_a_live_peer_that_never_reaches_a_collective_is_a_named_timeout(tmp_path):
    env = {"MODE": "lag", "LAG": "60", **QUICK}
    with Cluster(FAULTS, 2, tmp_path, env=env) as cluster:
        result = cluster.processes[0].wait(timeout=60)
    assert result.returncode != 0
    assert "CollectiveTimeoutError" in result.stderr
    assert "every peer is alive" in result.stderr
    assert "worker 1 (localhost:" in result.stderr


def test_a_clean_run_exits_0_without_warnings(tmp_path):
    # At WARNING, so that the start line (INFO) does not count: nothing else may be said.
    env = {"MODE": "ok", "STRATAGEM_LOG_LEVEL": "warning"}
    with Cluster(FAULTS, 2, tmp_path, env=env) as cluster:
        results = cluster.wait(timeout=90)
    for r in results:
        r.check("worker")
        assert "done" in r.stdout
        assert r.stderr == ""


def test_the_first_task_lost_is_named_and_those_that_ended_after_it_are_told_apart():
    """When worker 2 dies, workers 0 and 3 fail in the same collective and end too; worker 1,
    probing a moment later, finds three ports refused. A peer ending because it lost others
    answers 'lost' with their ranks while it exits: worker 1 then names worker 2 alone as the
    failure and the others as having ended after it (real liveness servers, probed)."""
    from stratagem.comm.liveness import LOST, LivenessServer, first_lost, probe_all

    def server(status: str = "running", position: str = "#3") -> LivenessServer:
        made = LivenessServer("127.0.0.1")
        made.status, made.position = status, position
        return made

    dead, witness, also_dead = server(), server(LOST, "2"), server()
    alive = server()
    addresses = {0: also_dead.address, 2: dead.address, 3: witness.address, 4: alive.address}
    dead.close("error")  # the first failure: its port refuses
    also_dead.close("error")  # worker 0 ended too, before worker 1 asked
    try:
        answers = probe_all(addresses)
        assert answers[2] is None and answers[0] is None
        assert first_lost(answers) == ([2], [0, 3])
        # Without a witness nothing tells the ended peers apart: every one is named.
        assert first_lost({0: None, 2: None, 4: answers[4]}) == ([0, 2], [])
        # Nobody ended: nothing to name.
        assert first_lost({4: answers[4]}) == ([], [])
    finally:
        for s in (witness, alive):
            s.close("ok")
