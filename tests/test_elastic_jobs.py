"""Elastic jobs (``stratagem run -n MIN:MAX``) on torch's elastic agent, with real processes.

A 3-worker ``fit`` under MultiWorkerMirrored with ``BackupAndRestore(save_freq=1)`` loses
workers to SIGKILL at seeded random steps: with restarts left the lost worker is started again
(the job goes on with 3); without, the job goes on with the 2 left. Either way it ends with the
weights of one uninterrupted process on the same global batches, and the ledger of the ids
every worker trained on holds each global batch exactly once, in order (``workers/elastic_fit.py``).
"""

from __future__ import annotations

import json
import random
import re
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

import stratagem as sg
from cluster_utils import WORKERS, Process, child_env, free_ports
from stratagem import cli
from test_multihost_netns import IP, Hosts, _namespaces, _why_no_namespaces
from workers.resume_data import (
    EPOCHS,
    EXAMPLES,
    GLOBAL_BATCH,
    Ledgered,
    examples,
    uninterrupted,
    uninterrupted_fit,
)

pytestmark = pytest.mark.multiprocess

SCRIPT = WORKERS / "elastic_fit.py"
STEPS = 20  # dataset(): 120 examples x 2 epochs in global batches of 12
KILL = "killed by signal 9 (SIGKILL)"


def _launch(tmp_path, options: list[str], kills: list[tuple[int, int, int, str]], *more: str):
    argv = [sys.executable, "-m", "stratagem.cli", "run", *options, str(SCRIPT), json.dumps(kills)]
    argv += more
    process = Process(argv, child_env(), tmp_path, "launcher", merge_output=True)
    return process.wait(timeout=240)


def _ledger(tmp_path) -> dict[int, list[dict]]:
    """The ledger's lines, step by step."""
    steps: dict[int, list[dict]] = defaultdict(list)
    for line in (tmp_path / "ledger.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps[record["step"]].append(record)
    return steps


def _in_order() -> list[list[int]]:
    """The global batches of a fit on the examples as arrays, in order, 2 epochs."""
    ids = list(range(EXAMPLES))
    one_pass = [ids[i : i + GLOBAL_BATCH] for i in range(0, EXAMPLES, GLOBAL_BATCH)]
    return one_pass * EPOCHS


def _arrays_fit(order: list[int] | None = None) -> dict[str, torch.Tensor]:
    """One process, no strategy, never stopped: fit on the examples as arrays, in order for 2
    epochs, or once through the examples of ``order`` (ids, in global batches of 12)."""
    features, labels = (torch.stack(t) for t in zip(*examples()))
    epochs = EPOCHS if order is None else 1
    if order is not None:
        features, labels = features[order], labels[order]
    torch.manual_seed(0)
    keras_model = sg.keras.Model(Ledgered())
    keras_model.compile(
        sg.keras.optimizers.SGD(0.1, momentum=0.9),
        sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    keras_model.fit(
        features, labels, batch_size=GLOBAL_BATCH, shuffle=False, epochs=epochs, verbose=0
    )
    return {k: v.detach().clone() for k, v in keras_model.module.net.state_dict().items()}


def _steps(tmp_path, output: str) -> list[tuple[int, list[dict]]]:
    """The ledger's steps in order, each its world size and its records (by rank): every step
    of the job, each trained by one round (none redone), every rank of that round once."""
    steps = _ledger(tmp_path)
    assert sorted(steps) == list(range(STEPS)), output
    walked = []
    for step, records in sorted(steps.items()):
        (world,) = {r["world"] for r in records}
        assert len({r["round"] for r in records}) == 1, (step, records)
        assert sorted(r["rank"] for r in records) == list(range(world)), (step, records)
        walked.append((world, sorted(records, key=lambda r: r["rank"])))
    return walked


def _assert_final(tmp_path, reference: dict[str, torch.Tensor]) -> None:
    """The chief's final weights are ``reference``'s, per tensor."""
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    for name, value in reference.items():
        torch.testing.assert_close(final[name], value, rtol=1e-6, atol=1e-7, msg=name)


def _check_replayed(tmp_path, output: str) -> list[int]:
    """For a job whose shuffle the job seeds (another order each job): each pass of the
    ledger holds every example once, and the weights are one process's fit on the global
    batches in the ledger's order; returns the world size of each step."""
    walked = _steps(tmp_path, output)
    order = [i for _, records in walked for r in records for i in r["ids"]]
    one_pass = len(order) // EPOCHS
    for i in range(EPOCHS):
        assert sorted(order[i * one_pass : (i + 1) * one_pass]) == list(range(EXAMPLES)), order
    _assert_final(tmp_path, _arrays_fit(order))
    return [world for world, _ in walked]


def _check_exact(tmp_path, output: str, arrays: bool = False, loop: bool = False) -> list[int]:
    """The job's steps are the uninterrupted run's global batches, each once, and its weights
    the uninterrupted run's (``fit``'s, on arrays with ``arrays``, the custom loop's with
    ``loop``); returns the world size of each step."""
    batches = _in_order() if arrays else uninterrupted()[0]
    assert Counter(i for b in batches for i in b) == {i: EPOCHS for i in range(EXAMPLES)}
    walked = _steps(tmp_path, output)
    for step, (_, records) in enumerate(walked):
        ids = sorted(i for r in records for i in r["ids"])
        assert ids == batches[step], f"step {step} trained on other examples"
    _assert_final(
        tmp_path, _arrays_fit() if arrays else uninterrupted()[1] if loop else uninterrupted_fit()
    )
    return [world for world, _ in walked]


def _kills(seed: int, count: int) -> list[tuple[int, int, int, str]]:
    """``count`` kills, one per round: a random rank of 3 at a random step (not decreasing:
    each round resumes where the last backup was)."""
    rng = random.Random(seed)
    steps = sorted(rng.randrange(1, STEPS - 1) for _ in range(count))
    return [(round_, rng.randrange(3), step, "kill") for round_, step in enumerate(steps)]


def test_lost_workers_are_started_again_then_the_job_goes_on_with_those_left(tmp_path):
    """``-n 2:3 --max-restarts 4``, five workers killed at random steps (seed 3): the first four
    are started again (each admitted: the job trains on with 3, every worker a new process
    resuming from the newest backup), the fifth is not (no restart left: the two left go on in
    place): the job finishes with 2, exact, and says what happened where it resumed."""
    kills = _kills(3, 5)
    result = _launch(tmp_path, ["-n", "2:3", "--max-restarts", "4"], kills)
    assert result.returncode == 0, result.stdout
    worlds = _check_exact(tmp_path, result.stdout)
    last = kills[-1][2]
    assert worlds == [3] * last + [2] * (STEPS - last), (kills, worlds)
    out = result.stdout
    # The new rounds' chiefs say where each resumed: after the last backup.
    for i, (_, rank, step, _) in enumerate(kills[:-1]):
        said = f"worker {rank} lost: {KILL}; started again with 3 workers (restart {i + 1} of 4)"
        assert f"[worker 0] {said}: resumed at epoch 1, step {step}\n" in out, out
    # No restart left: the two left go on in their own processes, from the step they were in.
    lost = f"continued with 2 of 3 workers; worker {kills[-1][1]} lost: {KILL} (in place)"
    assert f"[stratagem] {lost}\n" in out, out
    chief = min({0, 1, 2} - {kills[-1][1]})  # the survivors' new rank 0
    assert f"[worker {chief}] {lost}: went on in place at step {last}\n" in out, out
    assert "[stratagem] job finished: 2 workers exited 0" in out, out


@pytest.mark.parametrize("data", ["arrays", "unseeded"])
def test_survivors_go_on_in_their_own_processes_down_to_one(tmp_path, data):
    """``-n 1:3``, ``fit`` on arrays (2 epochs of 10 steps) or on the checks' ``sg.data``
    pipeline with its shuffle seeded by the job (shuffle, map, batch, repeat, prefetch: one
    pass of 20 steps): worker 2 killed at a random step, then (in the next round) worker 1 at a
    later one (seed 11). Each time the workers left go on in their own processes (the group
    rebuilt in place, the step they were in redone on the global batch cut for them, the
    dataset's iterator back at that step's start: counting batches again would not do, the
    group's new shuffle seed would reorder the rest), no process started; the job ends exact:
    the uninterrupted run's weights (arrays), or each pass's examples once and one process's
    weights on the ledger's order (the pipeline)."""
    rng = random.Random(11)
    first, second = sorted(rng.sample(range(1, STEPS - 1), 2))
    kills = [(0, 2, first, "kill"), (1, 1, second, "kill")]
    result = _launch(tmp_path, ["-n", "1:3"], kills, data)
    out = result.stdout
    assert result.returncode == 0, out
    if data == "arrays":
        worlds = _check_exact(tmp_path, out, arrays=True)
    else:
        worlds = _check_replayed(tmp_path, out)
    assert worlds == [3] * first + [2] * (second - first) + [1] * (STEPS - second), worlds
    lines = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    pids = {world: {r["pid"] for r in lines if r["world"] == world} for world in (3, 2, 1)}
    assert pids[1] < pids[2] < pids[3], pids  # the same processes, fewer of them
    assert len(re.findall(r"worker \d pid \d+ at", out)) == 3, out  # none started again
    for lost, left, before, step in ((2, 2, 3, first), (1, 1, 2, second)):
        said = f"continued with {left} of {before} workers; worker {lost} lost: {KILL} (in place)"
        assert f"[stratagem] {said}\n" in out, out
        in_epoch = step % 10 if data == "arrays" else step
        assert f"[worker 0] {said}: went on in place at step {in_epoch}\n" in out, out


def test_a_custom_loop_resumes_from_its_newest_checkpoint_with_the_workers_left(tmp_path):
    """``-n 2:3``, a custom loop (``PreemptionCheckpointHandler`` over a ``CheckpointManager``
    saving model, optimizer, distributed iterator and step after every step): a worker killed
    at a random step (seed 5); the two left are started again, restore the newest checkpoint and
    train on the global batches cut for two. Ends exact: every global batch once, the weights
    of one process on the global batches; the new chief says where it resumed."""
    rng = random.Random(5)
    rank, step = rng.randrange(3), rng.randrange(1, STEPS - 1)
    result = _launch(tmp_path, ["-n", "2:3"], [(0, rank, step, "kill")], "loop")
    out = result.stdout
    assert result.returncode == 0, out
    assert _check_exact(tmp_path, out, loop=True) == [3] * step + [2] * (STEPS - step)
    lost = f"continued with 2 of 3 workers; worker {rank} lost: {KILL}"
    assert f"[worker 0] {lost}: resumed at step {step} from ckpt-{step}\n" in out, out


def test_a_job_below_its_minimum_fails_naming_the_lost_worker(tmp_path):
    result = _launch(tmp_path, ["-n", "2:2"], [(0, 1, 3, "kill")])
    assert result.returncode == 137, result.stdout
    assert (
        f"job failed: worker 1 lost: {KILL}; 1 worker left, fewer than the 2 the job needs "
        "(-n 2:2), and no restart left"
    ) in result.stdout


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (["-n", "3:2"], "a range of workers needs 1 <= MIN <= MAX, got '3:2'"),
        (["-n", "0:2"], "a range of workers needs 1 <= MIN <= MAX, got '0:2'"),
        (["-n", "a:2"], "expected a number of workers N or a range MIN:MAX"),
        (["-n", "two"], "expected a number of workers N or a range MIN:MAX, got 'two'"),
        (
            ["--nnodes", "1:2", "--node-rank", "0", "--master-addr", "localhost", "--ps", "1"],
            "cannot be combined with --ps",
        ),
        (["--nnodes", "1:2"], "--nnodes 1:2 needs --node-rank and --master-addr"),
        (["--nnodes", "1:2", "-n", "1:2"], "takes a number of workers per node, not a range"),
        (["-n", "1:2", "--chief"], "cannot be combined with --chief"),
    ],
)
def test_bad_worker_ranges_are_refused_before_anything_starts(options, said, capsys):
    with pytest.raises(SystemExit) as exit_info:
        code = cli.main(["run", *options, str(SCRIPT), "[]"])
        raise SystemExit(code)
    assert exit_info.value.code == 2
    assert said in capsys.readouterr().err


def _launcher_of(pid: int) -> int:
    """The parent of a worker: its node's launcher (``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _wait_for(path, processes: list, what: str, timeout: float = 180.0) -> int:
    """The pid a worker wrote at ``path`` when it got there; fails as soon as a launcher ends
    first (it would never come), or after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        for p in processes:
            if p.proc.poll() is not None:
                raise AssertionError(f"{p.name} ended before {what}:\n{p.output_so_far()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s")
        time.sleep(0.1)
    return int(path.read_text())


@dataclass
class Machines:
    """Two "machines": network namespaces on a bridge where this test may make them (root:
    ``test_multihost_netns``'s ``Hosts``), else two launchers on this machine's loopback."""

    hosts: Hosts | None

    def address(self, rank: int) -> str:
        return "localhost" if self.hosts is None else self.hosts.address(rank)

    def prefix(self, rank: int) -> list[str]:
        """What runs a command on machine ``rank``."""
        return [] if self.hosts is None else [IP, "netns", "exec", self.hosts.namespace(rank)]

    def kill(self, rank: int, launcher: Process) -> None:
        """Machine ``rank`` dies: every process on it, SIGKILL."""
        if self.hosts is None:
            launcher.end_all()
        else:
            self.hosts.kill(rank)


@pytest.fixture
def machines(tmp_path) -> Iterator[Machines]:
    if _why_no_namespaces() is not None:
        yield Machines(None)
        return
    with _namespaces(tmp_path) as make:
        yield Machines(make(2))


def _node(
    machines: Machines,
    tmp_path,
    port: int,
    events: list,
    rank: int,
    *options: str,
    env: dict[str, str] | None = None,
):
    """Node ``rank``'s launcher of an elastic job over the machines (``--nnodes ... *options``)."""
    where = ["--node-rank", str(rank), "--master-addr", machines.address(0)]
    where += ["--master-port", str(port), *options]
    argv = [*machines.prefix(rank), sys.executable, "-m", "stratagem.cli", "run", *where]
    env = child_env({"TEST_NODE": f"node{rank}", "STRATAGEM_JOB_SECRET": "5" * 64, **(env or {})})
    argv += [str(SCRIPT), json.dumps(events)]
    name = f"node{rank}" if not (tmp_path / f"node{rank}.out").exists() else f"node{rank}-again"
    return Process(argv, env, tmp_path, name, merge_output=True)


def test_a_lost_node_leaves_the_job_and_a_node_that_comes_back_is_admitted(tmp_path, machines):
    """``--nnodes 1:2 -n 1`` on two machines (network namespaces, with root): node 1's machine
    dies at step 6 (its launcher and worker, SIGKILL); node 0 goes on alone from its backup; node
    1 started again at step 13 is admitted (a new round of 2 nodes); both exit 0, exact."""
    (port,) = free_ports(1)
    events = [(0, "node1", 6, "wait"), (1, "node0", 13, "wait")]

    def node(rank: int) -> Process:
        return _node(machines, tmp_path, port, events, rank, "--nnodes", "1:2", "-n", "1")

    node0, node1 = node(0), node(1)
    again = None
    try:
        worker = _wait_for(tmp_path / "at-0-node1", [node0, node1], "node 1's worker at step 6")
        assert _launcher_of(worker) == node1.pid
        machines.kill(1, node1)
        node1.proc.wait(timeout=30)
        _wait_for(tmp_path / "at-1-node0", [node0], "node 0 alone at step 13")
        again = node(1)
        results = [node0.wait(timeout=240), again.wait(timeout=240)]
    finally:
        for p in (node0, node1, again):
            if p is not None and p.proc.returncode is None:
                p.end_all()
    out0, out1 = results[0].stdout, results[1].stdout
    assert results[0].returncode == 0, out0
    assert results[1].returncode == 0, out1
    worlds = _check_exact(tmp_path, out0 + out1)
    assert worlds == [2] * 6 + [1] * 7 + [2] * 7, worlds
    assert "continued with 1 of 2 nodes; node 1 lost" in out0, out0
    assert "node 1 admitted: 2 of 2 nodes" in out0, out0


@pytest.mark.parametrize(
    ("nodes", "cut_s"),
    [
        pytest.param("2:2", 5, id="elastic-5s"),
        pytest.param("1:2", 12, id="elastic-past-heartbeat-12s"),
        pytest.param("2", 12, id="fixed-12s"),
    ],
)
def test_a_cut_link_both_nodes_meet_again_and_finish(tmp_path, machines, nodes, cut_s):
    """``--nnodes N`` over two network namespaces, collectives timing out
    after 3 s: at step 6 node 1's worker holds while node 0's waits in the step's all-reduce;
    node 1's link is cut for ``cut_s``, then restored. Both sides reach one decision: they meet
    again, resume from the backup, and exit 0 with the training finished, exact (each step
    trained once, by one round: a cut node training alone would train steps twice).
    ``2:2``: cut for 5 s, node 1's worker goes on after it; both nodes start their workers
    again in a new round (one restart each). ``1:2`` with ``--max-restarts 0``: cut for longer
    than the rendezvous's heartbeat expiry (5 s), node 1's worker let go during the cut (its
    all-reduce fails there): node 0, which hosts the store, goes on alone (its round-1 worker
    waits at step 8), node 1 cannot (no store to meet on) and is admitted when the link
    returns, as a newcomer: no restart spent. ``2``: our launchers'
    meeting, cut for longer than its control links' keepalive (10 s at most): node 1, having
    lost node 0's link without its word, meets node 0 again as node 0 does."""
    if machines.hosts is None:
        pytest.skip("a link to cut needs network namespaces (root)")
    (port,) = free_ports(1)
    alone = nodes == "1:2"
    events = [(0, "node1", 6, "hold")]
    if alone:  # node 0's round without node 1 (round 1) stops at step 8 until node 1 is back
        events.append((1, "node0", 8, "wait"))
    restarts = "0" if alone else "1"  # node 1 left out comes back as a newcomer: none spent
    options = ("--nnodes", nodes, "-n", "1", "--max-restarts", restarts, "--join-timeout", "60")
    env = {"STRATAGEM_OP_TIMEOUT": "3"}
    node0, node1 = (_node(machines, tmp_path, port, events, r, *options, env=env) for r in (0, 1))
    try:
        _wait_for(tmp_path / "at-0-node1", [node0, node1], "node 1's worker at step 6")
        machines.hosts.cut(1)
        if alone:
            time.sleep(cut_s / 2)
            (tmp_path / "go").write_text("")  # node 1's worker tries its all-reduce, cut
        time.sleep(cut_s / 2 if alone else cut_s)  # the scenario: the link stays cut a while
        machines.hosts.mend(1)
        (tmp_path / "go").write_text("")
        results = [node0.wait(timeout=240), node1.wait(timeout=240)]
    finally:
        for p in (node0, node1):
            if p.proc.returncode is None:
                p.end_all()
    out0, out1 = results[0].stdout, results[1].stdout
    for result in results:
        assert result.returncode == 0, result.stdout
    worlds = _check_exact(tmp_path, out0 + out1)
    if alone:
        # Node 0 trained alone for at most 2 steps (until its worker waited at step 8, or
        # until node 1 asked to join); node 1 never met without node 0.
        k = worlds.count(1)
        assert k <= 2 and worlds == [2] * 6 + [1] * k + [2] * (STEPS - 6 - k), worlds
        assert "continued with 1 of 2 nodes; node 1 lost" in out0, out0
        assert "node 1 admitted: 2 of 2 nodes" in out0, out0
        assert "continued with" not in out1, out1
        again = r"node 1 admitted again in round \d+: the job went on without it since round 0"
        assert re.search(again, out1), out1
        return
    assert worlds == [2] * STEPS
    for rank, out in enumerate((out0, out1)):
        if ":" in nodes:
            assert f"on node {rank}; its workers started again (restart 1 of 1)" in out, out
        else:
            assert "all 2 nodes arrived for attempt 2: " in out, out
    if ":" not in nodes:  # node 1 saw its link to node 0 time out, and met it again
        lost = f"node 1 of 2 lost its link to node 0's launcher at 10.77.0.1:{port} without"
        assert lost in out1, out1


class _CutStore:
    """A rendezvous handler whose store does not answer while ``cut`` (as a cut link)."""

    def __init__(self) -> None:
        self.cut = True

    def _answer(self, value: object) -> object:
        if self.cut:
            raise RuntimeError("wait timeout after 10000ms")
        return value

    def is_closed(self) -> bool:
        return self._answer(False)

    def num_nodes_waiting(self) -> int:
        return self._answer(0)


def test_an_unreachable_store_is_said_once_and_training_goes_on(capsys):
    """While the job's store does not answer, a node's launcher says so once and lets its
    workers train (their collectives decide); when it answers again, it says that too."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec

    from stratagem.cluster.attempt import Console, Interrupts
    from stratagem.cluster.tasks import WorkerRange
    from stratagem.elastic.agent import StratagemAgent

    handler = _CutStore()
    spec = WorkerSpec(role="worker", local_world_size=1, rdzv_handler=handler, entrypoint="x")
    agent = StratagemAgent(
        spec,
        workers=WorkerRange(1, 1),
        target=["x.py"],
        python=sys.executable,
        console=Console(sys.stdout, sys.stderr),
        interrupts=Interrupts(),
        base_env={},
        host="localhost",
        grace_period=1.0,
        rendezvous=handler,
        nodes=WorkerRange(1, 2),
        node_name="node 1",
    )
    answers = []
    for cut in (True, True, False):
        handler.cut = cut
        agent._checked_at = 0.0  # asked now, not a second later
        answers.append(agent._other_nodes_agree())
    assert answers == [True, True, True]
    err = capsys.readouterr().err
    assert err.count("the job's store is unreachable from node 1 (RuntimeError: wait timeout") == 1
    assert err.count("the job's store is reachable again from node 1") == 1
