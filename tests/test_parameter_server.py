"""ParameterServerStrategy: partitioners and placement (pure logic), the ps update rules
(in-process, no RPC), and real jobs of workers and ps tasks through the launcher."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

import stratagem as sg
from cluster_utils import WORKERS, Process, child_env, free_ports
from stratagem.cluster import SimpleClusterResolver
from stratagem.distribute.partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    place_shards,
    plan_shards,
    shard_rows,
)
from stratagem.distribute.ps.shard_store import ShardStore, UpdateRule
from workers.common import global_batches, reference_training

# --- partitioners and placement --------------------------------------------------------------


def test_partitioners_cut_along_the_first_dimension_as_tensorflow_does():
    assert FixedShardsPartitioner(3)((10, 4)) == [3, 1]
    assert FixedShardsPartitioner(8)((5,)) == [5]  # never more shards than rows
    assert FixedShardsPartitioner(2)(()) == []  # scalars are never cut
    # 1000 x 256 float32 = 1 MB: 4 shards of >= 256 KiB, capped by max_shards.
    assert MinSizePartitioner(256 << 10, max_shards=8)((1000, 256)) == [3, 1]
    assert MinSizePartitioner(1 << 20, max_shards=8)((1000, 256)) == [1, 1]
    assert MinSizePartitioner(64 << 10, max_shards=2)((1000, 256)) == [2, 1]
    assert MaxSizePartitioner(300_000)((1000, 256)) == [4, 1]  # 1 024 000 bytes / 300 000
    assert shard_rows(10, 3) == [4, 3, 3] and shard_rows(2, 2) == [1, 1]


def test_partitioner_errors_echo_what_they_were_given():
    with pytest.raises(ValueError, match=r"num_shards must be an integer >= 1; got 0"):
        FixedShardsPartitioner(0)
    with pytest.raises(ValueError, match=r"needs 4 shards of at most 300000 bytes, more than "):
        MaxSizePartitioner(300_000, max_shards=2)((1000, 256))
    with pytest.raises(ValueError, match=r"rows of 1024 bytes, more than max_shard_bytes=100"):
        MaxSizePartitioner(100)((1000, 256))


def test_shards_are_placed_largest_first_on_the_least_loaded_ps():
    assert place_shards([100, 10, 60, 50], 2) == [0, 0, 1, 1]  # 100 + 10 and 60 + 50
    plan = plan_shards([(10, 4), (3,)], [torch.float32] * 2, FixedShardsPartitioner(2), 2)
    assert [(s.start, s.rows, s.ps) for s in plan[0]] == [(0, 5, 0), (5, 5, 1)]
    assert [(s.start, s.rows) for s in plan[1]] == [(0, 2), (2, 1)]
    loads = [0, 0]
    for shards in plan:
        for s in shards:
            loads[s.ps] += s.nbytes
    assert loads == [80 + 8, 80 + 4]  # 5 rows of 16 bytes each, then the 2-row and 1-row shards


# --- the ps update rules, in process -------------------------------------------------------

SGD = ("torch.optim", "SGD")


def _store(mode: str, workers: int, **rule) -> ShardStore:
    store = ShardStore("ps:0", workers)
    needed = rule.pop("replicas_to_aggregate", workers)
    store.create(UpdateRule(mode, workers, needed, **rule), 0, {(0, 0): torch.zeros(2)})
    return store


def _push(store: ShardStore, worker: int, version: int, grad: float, lr: float = 1.0):
    groups = [({"lr": lr}, [(0, 0)])]
    return store.push(worker, SGD, groups, version, [torch.full((2,), grad)])


def test_sync_applies_the_mean_of_the_first_n_and_drops_a_late_backup_gradient():
    store = _store("sync", 3, replicas_to_aggregate=2)
    a, b = _push(store, 0, 0, 1.0), _push(store, 1, 0, 3.0)
    (values, version), _ = a.wait(), b.wait()
    assert version == 1 and values[0].tolist() == [-2.0, -2.0]  # 0 - lr * mean(1, 3)
    late = _push(store, 2, 0, 100.0)  # computed on version 0, which is already applied
    values, version = late.wait()
    assert version == 1 and values[0].tolist() == [-2.0, -2.0]  # dropped, never applied
    assert store.stats.dropped == 1 and store.stats.applied == 2 and store.stats.steps == 1


def test_sync_contributors_wait_for_the_step_and_a_leaving_worker_releases_it():
    store = _store("sync", 2)
    first = _push(store, 0, 0, 2.0)
    assert not first.done()  # waits for the second gradient of version 0
    store.leave(1)  # the other worker finished: the step no longer waits for it
    values, version = first.wait()
    assert version == 1 and values[0].tolist() == [-2.0, -2.0]


def test_sync_takes_a_lost_worker_back_at_its_first_push_and_never_mixes_versions():
    store = _store("sync", 3)
    for w in range(3):
        pushed = _push(store, w, 0, 1.0)
    pushed.wait()
    store.leave(2, lost=True)  # the ps noticed it is gone: updates of the two left
    a, b = _push(store, 0, 1, 1.0), _push(store, 1, 1, 1.0)
    assert a.wait()[1] == 2 and b.done()
    # Restarted, it pushes a gradient of values it fetched (its first push carries version 0):
    # dropped, answered with the current values, and it counts again from the next update.
    values, version = _push(store, 2, 0, 100.0).wait()
    assert version == 2 and values[0].tolist() == [-2.0, -2.0]
    c, d = _push(store, 0, 2, 1.0), _push(store, 1, 2, 1.0)
    assert not c.done()  # the update under way waits for the returned worker's gradient
    _push(store, 2, 2, 4.0).wait()
    values, version = c.wait()
    assert version == 3 and values[0].tolist() == [-4.0, -4.0]  # -2 - mean(1, 1, 4)
    assert store.stats.counts == [3, 2, 3] and store.stats.dropped == 1
    assert d.done() and store.still_training() == [0, 1, 2]


def test_async_applies_each_push_and_scales_or_drops_stale_ones():
    plain = _store("async", 2)
    _push(plain, 0, 0, 1.0).wait()
    values, version = _push(plain, 1, 0, 1.0).wait()  # stale by one update, applied as is
    assert version == 2 and values[0].tolist() == [-2.0, -2.0]

    scaled = _store("async", 2, staleness_policy="scale")
    _push(scaled, 0, 0, 1.0).wait()
    values, _ = _push(scaled, 1, 0, 1.0).wait()  # staleness 1: half the gradient
    assert values[0].tolist() == [-1.5, -1.5]

    dropping = _store("async", 2, staleness_policy="drop", max_gradient_staleness=0)
    _push(dropping, 0, 0, 1.0).wait()
    values, version = _push(dropping, 1, 0, 1.0).wait()
    assert version == 1 and values[0].tolist() == [-1.0, -1.0] and dropping.stats.dropped == 1


def test_bounded_staleness_holds_a_worker_that_is_too_far_ahead():
    store = _store("async", 2, max_staleness=1)
    assert _push(store, 0, 0, 1.0).done()  # clocks 1 and 0: within the bound
    ahead = _push(store, 0, 1, 1.0)  # clocks 2 and 0: worker 0 must wait
    assert not ahead.done() and store.stats.waits == 1
    _push(store, 1, 0, 1.0).wait()  # the slow worker catches up to clock 1
    values, version = ahead.wait()
    assert version == 3 and values[0].tolist() == [-3.0, -3.0]
    again = _push(store, 0, 3, 1.0)  # clocks 3 and 1
    assert not again.done()
    goodbye = store.leave(1, lost=True)  # a worker that is gone holds nobody back
    assert again.wait()[1] == 4
    # Goodbyes are answered once every worker is done or lost, saying whether one was lost.
    assert not goodbye.done()
    last = store.leave(0)
    assert goodbye.wait() is True and last.wait() is True


def test_async_takes_a_lost_worker_back_without_holding_the_others_to_its_old_clock():
    store = _store("async", 2, max_staleness=1)
    _push(store, 1, 0, 1.0).wait()
    store.leave(1, lost=True)
    for version in range(1, 6):  # alone, worker 0 is never held back
        assert _push(store, 0, version, 1.0).done()
    back = _push(store, 1, 0, 1.0)  # restarted: applied at once, as any async push
    assert back.done() and store.stats.applied == 7 and store.still_training() == [0, 1]
    # Its clock starts at worker 0's (5), not its own old one (1): nobody waits for 4 steps.
    assert _push(store, 0, 7, 1.0).done() and store.stats.waits == 0


# --- bad input, before any process is started ---------------------------------------------

CLUSTER = {"worker": ["localhost:1", "localhost:2", "localhost:3"], "ps": ["localhost:4"]}


def _resolver(cluster=CLUSTER):
    return SimpleClusterResolver(sg.train.ClusterSpec(cluster), task_type="worker", task_id=0)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({}, ValueError, r"needs ps tasks to hold the parameters; this cluster has 2 workers"),
        (dict(mode="sync", replicas_to_aggregate=4), ValueError, r"replicas_to_aggregate=4 is "),
        (dict(max_staleness=-1), ValueError, r"max_staleness must be >= 0; got -1"),
        (dict(mode="sync", backup_workers=3), ValueError, r"backup_workers=3 leaves no worker"),
        (dict(mode="eventual"), ValueError, r"mode must be one of \('async', 'sync'\)"),
        (dict(staleness_policy="drop"), ValueError, r"'drop' needs max_gradient_staleness"),
        (dict(backup_workers=1), ValueError, r"are for mode='sync'"),
    ],
)
def test_bad_options_are_refused_naming_the_value(kwargs, error, message):
    cluster = CLUSTER if kwargs else {"worker": CLUSTER["worker"][:2]}
    with pytest.raises(error, match=message):
        sg.distribute.ParameterServerStrategy(_resolver(cluster), **kwargs)


def test_a_ps_that_never_answers_is_named(tmp_path):
    worker, ps = (f"localhost:{p}" for p in free_ports(2))
    cluster = {"worker": [worker], "ps": [ps]}
    script = (
        "import stratagem as sg\n"
        f"resolver = sg.distribute.cluster_resolver.SimpleClusterResolver("
        f"sg.train.ClusterSpec({cluster!r}), task_type='worker', task_id=0)\n"
        "sg.distribute.ParameterServerStrategy(resolver)\n"
    )
    env = child_env({"STRATAGEM_RENDEZVOUS_TIMEOUT": "2"})
    result = Process([sys.executable, "-c", script], env, tmp_path, "worker").wait(timeout=60)
    assert result.returncode != 0
    assert f"missing: ps 0 ({ps})" in result.stderr, result.stderr


# --- real jobs ---------------------------------------------------------------------------

pytest_multiprocess = pytest.mark.multiprocess


def _job(tmp_path: Path, workers: int, ps: int, *args: str) -> list[dict]:
    argv = [sys.executable, "-m", "stratagem.cli", "run", "-n", str(workers), "--ps", str(ps)]
    argv += [str(WORKERS / "ps_train.py"), str(tmp_path), *args]
    result = Process(argv, child_env(), tmp_path, "launcher", merge_output=True).wait(timeout=240)
    assert result.returncode == 0, result.stdout
    assert "ps 0 exited 0" in result.stdout  # the ps served until the workers were done
    return [torch.load(tmp_path / f"result-{i}.pt") for i in range(workers)]


@pytest_multiprocess
@pytest.mark.parametrize(
    "workers, ps, optimizer, shards",
    [(2, 1, "sgd", 0), (3, 2, "adam", 2)],  # 3 workers: every variable in 2 shards on 2 ps
)
def test_sync_mode_equals_one_process_on_the_concatenated_batch(
    tmp_path, workers, ps, optimizer, shards
):
    results = _job(tmp_path, workers, ps, "sync", optimizer, *([str(shards)] if shards else []))
    expected = reference_training(results[0]["initial"], optimizer, global_batches())
    for i, r in enumerate(results):
        for k, v in expected.items():
            torch.testing.assert_close(r["initial"][k], results[0]["initial"][k], msg=k)
            torch.testing.assert_close(r["final"][k], v, rtol=1e-5, atol=1e-6, msg=f"{i} {k}")
    stats = results[0]["stats"]
    assert len(stats) == ps and all(s["steps"] == len(global_batches()) for s in stats), stats
    assert all(s["applied"] == workers * len(global_batches()) for s in stats), stats


@pytest_multiprocess
def test_async_mode_applies_every_push_as_it_comes(tmp_path):
    results = _job(tmp_path, 2, 1, "async", "sgd")
    ((stats),) = results[0]["stats"]
    # Each push is one update. When the chief asks, its own pushes are all in; the other
    # worker, on its own schedule, may still be pushing.
    steps = len(global_batches())
    assert stats["applied"] == stats["steps"] and steps <= stats["steps"] <= 2 * steps, stats
    assert stats["dropped"] == 0
    first, last = results[0]["initial"], results[0]["final"]
    assert max((last[k] - first[k]).abs().max() for k in first) > 0


@pytest_multiprocess
def test_async_training_goes_on_without_a_lost_worker(tmp_path):
    argv = [sys.executable, "-m", "stratagem.cli", "run", "-n", "3", "--ps", "1"]
    argv += ["--tolerate-worker-loss", str(WORKERS / "ps_faults.py"), "lost-worker"]
    result = Process(argv, child_env(), tmp_path, "launcher", merge_output=True).wait(timeout=240)
    output = result.stdout
    assert result.returncode == 0, output
    assert "worker 2 was lost: killed by signal 9 (SIGKILL); the job goes on" in output, output
    assert "[ps 0] worker 2 (" in output and "ended without saying it was done (lost)" in output
    # The survivors were not held back by the staleness bound for ever: the chief finished.
    assert "[worker 0] chief trained to step 30" in output, output
    assert "job finished: 2 workers exited 0 (1 worker lost)" in output, output


@pytest_multiprocess
def test_a_lost_ps_is_named_and_the_restarted_job_resumes_from_the_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = [sys.executable, "-m", "stratagem.cli", "run", "-n", "2", "--ps", "1"]
    argv += ["--max-restarts", "1", str(WORKERS / "ps_faults.py"), "lost-ps", str(ckpt)]
    result = Process(argv, child_env(), tmp_path, "launcher", merge_output=True).wait(timeout=300)
    output = result.stdout
    assert result.returncode == 0, output
    first, _, second = output.partition("restarting the job")
    assert "ps 0 (localhost:" in first and "did not answer a push" in first, output
    assert "PeerLostError" in first, output
    assert "[worker 0] restored ckpt-1 at step 10" in second, output
    assert "[worker 0] chief trained to step 30" in second, output
    # What the new ps was sent on restore is what it gives back: values and momentum.
    saved = torch.load(ckpt / "ckpt-1" / "state.pt")
    back = torch.load(ckpt / "roundtrip" / "state.pt")
    for k, v in saved["model"].items():
        torch.testing.assert_close(back["model"][k], v, rtol=0, atol=0, msg=k)
    momenta = [s["momentum_buffer"] for s in saved["optimizer"]["state"].values()]
    returned = [s["momentum_buffer"] for s in back["optimizer"]["state"].values()]
    assert len(momenta) == 6 and all(m.abs().sum() > 0 for m in momenta)
    for a, b in zip(returned, momenta):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest_multiprocess
def test_a_stopped_worker_in_sync_mode_is_named_by_the_push_that_waits_for_it(tmp_path):
    argv = [sys.executable, "-m", "stratagem.cli", "run", "-n", "2", "--ps", "1"]
    argv += [str(WORKERS / "ps_faults.py"), "stopped-worker"]
    env = child_env({"STRATAGEM_OP_TIMEOUT": "3"})
    result = Process(argv, env, tmp_path, "launcher", merge_output=True).wait(timeout=120)
    output = result.stdout
    assert result.returncode != 0, output
    # Not "ps 0 did not answer a push": the ps is fine, worker 1 is stopped.
    assert "stratagem: CollectiveTimeoutError on worker 0 (localhost:" in output, output
    assert "  a push to ps 0 (localhost:" in output, output
    assert "the push waits for worker 1's gradient for update 4, and worker 1 (localhost:" in output
    assert "has not answered its liveness probe for 3 s (stopped or stuck" in output, output
    assert "did not answer a push" not in output, output


@pytest_multiprocess
def test_model_fit_under_sync_parameter_servers(tmp_path):
    argv = [sys.executable, "-m", "stratagem.cli", "run", "-n", "2", "--ps", "1"]
    argv += [str(WORKERS / "ps_fit.py")]
    result = Process(argv, child_env(), tmp_path, "launcher", merge_output=True).wait(timeout=240)
    assert result.returncode == 0, result.stdout
    found = re.findall(r"\[worker (\d)\] RESULT (\{.*\})", result.stdout)
    results = {int(w): json.loads(r) for w, r in found}
    assert sorted(results) == [0, 1], result.stdout
    assert all(r["epochs"] == [0, 1, 2] for r in results.values())
    # Both workers hold the ps's parameters and evaluate all of the test data: the same figure.
    assert results[0]["accuracy"] == results[1]["accuracy"] >= 0.85, results
    # EarlyStopping(restore_best_weights) restored epoch 1's weights on the ps as well.
    assert all(r["ps_holds_restored"] for r in results.values()), results
    # Keras callbacks write on the chief only (TF's rule; every worker used to act as chief):
    # one progress report per epoch, one TensorBoard event file.
    progress = re.findall(r"\[worker (\d)\] .*loss", result.stdout)
    assert progress and set(progress) == {"0"}, result.stdout
    events = sorted(p.parent.name for p in (tmp_path / "logs").rglob("events.out.tfevents*"))
    assert events == ["train"], events


@pytest_multiprocess
def test_an_evaluator_reads_the_parameters_while_the_workers_train(tmp_path):
    argv = [sys.executable, "-m", "stratagem.cli", "run", "-n", "2", "--ps", "1", "--evaluator"]
    argv += [str(WORKERS / "ps_faults.py"), "evaluator", str(tmp_path)]
    result = Process(argv, child_env(), tmp_path, "launcher", merge_output=True).wait(timeout=240)
    assert result.returncode == 0, result.stdout
    pattern = r"\[evaluator\] evaluator: (\d+) evaluations, first ([0-9.]+) last ([0-9.]+)"
    ((count, first, last),) = re.findall(pattern, result.stdout)
    # It saw the initial values and, once the workers were done, the trained ones.
    assert int(count) >= 2 and float(first) != float(last), result.stdout
    assert "[stratagem] evaluator exited 0" in result.stdout, result.stdout


def test_bf16_transfer_sends_and_returns_half_the_bytes_and_keeps_float32_on_the_ps():
    store = _store("sync", 1, compression="bf16")
    groups = [({"lr": 1.0}, [(0, 0)])]
    grad = torch.tensor([1.0 / 3.0, 2.0 / 3.0]).to(torch.bfloat16)
    values, version = store.push(0, SGD, groups, 0, [grad]).wait()
    assert values[0].dtype == torch.bfloat16 and version == 1
    held = store._shards[(0, 0)]
    assert held.dtype == torch.float32  # the ps keeps (and updates) float32
    torch.testing.assert_close(held.detach(), -grad.float())


def test_each_creation_waits_for_its_own_shards_and_a_second_model_adds_its_own():
    # TF's parameter-server tutorial builds two models under one strategy: the ps holds the
    # variables of each creation, and a worker's fetch of the second waits for the chief's
    # creation of the second, not the first's.
    store = ShardStore("ps:0", 2)
    rule = UpdateRule("sync", 2, 2)
    store.create(rule, 0, {(0, 0): torch.zeros(2)})
    second = store.when_created(1)
    assert store.when_created(0).done() and not second.done()
    store.create(rule, 1, {(1, 0): torch.ones(3)})
    assert second.done()
    assert [t.tolist() for t in store.read([(0, 0), (1, 0)])] == [[0.0, 0.0], [1.0, 1.0, 1.0]]
    # A restarted chief creating the first model again does not overwrite its values.
    store.create(rule, 0, {(0, 0): torch.full((2,), 5.0)})
    assert store.read([(0, 0)])[0].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="a job has one ParameterServerStrategy"):
        store.create(UpdateRule("async", 2, 2), 2, {(2, 0): torch.zeros(1)})


@pytest_multiprocess
def test_sync_training_goes_on_with_the_workers_left_and_takes_a_restarted_one_back(tmp_path):
    """``-n 2:3 --ps 1 --restart-workers 1`` (a ps job keeps its own rule: workers come and go,
    the ps stays), sync, between-graph: the last worker is killed at its fourth step; the ps
    stops waiting for it, and each update is the mean of the two workers left (TF's rule, as
    with backup workers). The launcher starts it again; it fetches the ps's values and is taken
    back between two updates (its first push, for an update it never saw, is dropped). The ps
    counts the gradients of each update: 3 for 3 updates, 2 while it is away, 3 again."""
    argv = [sys.executable, "-m", "stratagem.cli", "run", "-n", "2:3", "--ps", "1"]
    argv += ["--restart-workers", "1", str(WORKERS / "ps_faults.py"), "returning-worker"]
    result = Process(argv, child_env(), tmp_path, "launcher", merge_output=True).wait(timeout=240)
    output = result.stdout
    assert result.returncode == 0, output
    assert "worker 2 failed: killed by signal 9 (SIGKILL); restarting it alone" in output, output
    assert "worker 2 restarted (incarnation 2)" in output, output
    assert "[ps 0] worker 2 (" in output and "ended without saying it was done (lost)" in output
    stats = output.split("ps stats ", 1)[1].splitlines()[0]
    counts = [int(c) for c in re.search(r"'counts': \[([\d, ]*)\]", stats).group(1).split(",")]
    assert counts == [3] * 3 + [2] * 7 + [3] * 20, counts
    assert "'dropped': 1" in stats, stats  # the returning worker's first, late, push
