"""The strategy API across 2 real worker processes: every value checked against hand math."""

from __future__ import annotations

import json

import pytest
import torch

from cluster_utils import WORKERS, run_cluster
from workers.common import build_model

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def outs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("api")
    results = run_cluster(WORKERS / "api_checks.py", 2, workdir, timeout=180)
    for i, r in enumerate(results):
        r.check(f"worker {i}")
        assert "Traceback" not in r.stderr
    return workdir, [torch.load(workdir / f"result-{i}.pt") for i in range(2)]


def test_roles(outs):
    _, (a, b) = outs
    assert (a["n"], b["n"]) == (2, 2)
    assert (a["is_chief"], b["is_chief"]) == (True, False)


def test_reduce_and_gather(outs):
    _, results = outs
    for out in results:
        torch.testing.assert_close(out["reduce"]["SUM"], torch.tensor([[3.0, 30.0]]))
        torch.testing.assert_close(out["reduce"]["MEAN"], torch.tensor([[1.5, 15.0]]))
        torch.testing.assert_close(out["reduce"]["MAX"], torch.tensor([[2.0, 20.0]]))
        torch.testing.assert_close(out["reduce"]["MIN"], torch.tensor([[1.0, 10.0]]))
        # MEAN along an axis weighs each worker by how many values it holds (1 and 2).
        assert out["reduce_axis0_mean"].item() == pytest.approx(201 / 3)
        assert out["reduce_axis0_sum"].item() == 201
        assert out["gather"].tolist() == [0.0, 100.0, 101.0]
        assert out["replica_all_reduce"].item() == 3.0


def test_global_batches_are_split_exactly_once_per_epoch(outs):
    _, (a, b) = outs
    for epoch in range(2):
        mine = [x for e, batch in a["distributed_ids"] if e == epoch for x in batch]
        theirs = [x for e, batch in b["distributed_ids"] if e == epoch for x in batch]
        assert not set(mine) & set(theirs)
        assert sorted(mine + theirs) == list(range(50))
    # 50 = 6 batches of 8 (4 per worker) + a last one of 2, not dropped: as TF's legacy
    # rebatch under the data shard (input_lib_test.testMWMSWithDataSharding), it is cut by its
    # own size, one example per worker.
    assert [len(batch) for e, batch in a["distributed_ids"] if e == 0] == [4] * 6 + [1]
    assert [len(batch) for e, batch in b["distributed_ids"] if e == 0] == [4] * 6 + [1]


def test_unseeded_shuffle_then_shard_gives_disjoint_shards(outs):
    _, (a, b) = outs
    mine = [x for batch in a["from_function_ids"] for x in batch]
    theirs = [x for batch in b["from_function_ids"] for x in batch]
    assert not set(mine) & set(theirs)
    assert sorted(mine + theirs) == list(range(40))


def test_uneven_pipelines_go_on_while_any_worker_has_data(outs):
    # TF's input_lib (get_next_as_optional across workers): the iteration ends when no worker
    # has data; a worker that ran out feeds its replicas empty batches meanwhile.
    _, (a, b) = outs
    assert a["uneven_shapes"] == [(2, 5)] * 3
    assert b["uneven_shapes"] == [(2, 5)] * 2 + [(0, 5)]
    assert a["empty_steps"] == b["empty_steps"] == 0


def test_metric_result_is_global(outs):
    _, (a, b) = outs
    assert a["accuracy"].item() == pytest.approx(0.5)
    assert b["accuracy"].item() == pytest.approx(0.5)


def _grads(initial: dict, xs: list[torch.Tensor], loss) -> dict:
    model = build_model()
    model.load_state_dict(initial)
    for x in xs:
        loss(model, x).backward()
    return {k: p.grad for k, p in model.named_parameters()}


def test_gradient_accumulation_counts_each_pass_once(outs):
    _, (a, b) = outs
    xs = [torch.full((2, 5), 1.0)] * 2 + [torch.full((2, 5), 2.0)] * 2
    expected = _grads(a["initial"], xs, lambda m, x: m(x).sum())
    for out in (a, b):
        for k, g in expected.items():
            torch.testing.assert_close(out["accumulated_grads"][k], g)


def test_unused_parameters_keep_no_gradient_and_one_sided_ones_get_the_sum(outs):
    _, (a, b) = outs
    assert a["unused_grad_is_none"] and b["unused_grad_is_none"]
    for out in (a, b):
        assert out["one_sided_grad"] is not None
        torch.testing.assert_close(out["one_sided_grad"], torch.ones(1, 2))


def test_mean_gradient_aggregation_option(outs):
    _, (a, b) = outs
    xs = [torch.full((3, 5), 1.0), torch.full((3, 5), 2.0)]
    summed = _grads(a["mean_initial"], xs, lambda m, x: m(x).mean())
    for out in (a, b):
        for k, g in summed.items():
            torch.testing.assert_close(out["mean_aggregated"][k], g / 2)


def test_only_the_chief_writes_the_shared_checkpoint(outs):
    workdir, (a, b) = outs
    assert a["saved_path"] == b["saved_path"]
    entries = sorted(p.name for p in (workdir / "shared_ckpt").iterdir())
    assert entries == ["checkpoint", "ckpt-1"]
    meta = json.loads((workdir / "shared_ckpt" / "ckpt-1" / "meta.json").read_text())
    assert meta["distribution"]["strategy"] == "MultiWorkerMirroredStrategy"
    assert meta["distribution"]["world_size"] == 2


def test_a_save_is_complete_on_every_worker_when_it_returns(outs):
    """TF: under MultiWorkerMirroredStrategy a save is collective (every worker calls it), and
    when the workers return from it the checkpoint is complete. Worker 1 restores what the
    chief wrote right after each save (``CheckpointManager.save`` then its
    ``latest_checkpoint``; ``Checkpoint.save`` then ``latest_checkpoint(dir)``, which reads the
    index; ``write`` over an earlier write): it reads the saved weights, not the earlier
    save's (1, 3, 5) nor an error for a checkpoint not there yet."""
    _, (_, b) = outs
    assert b["manager_restored"] == 2.0
    assert b["save_restored"] == 4.0
    assert b["write_restored"] == 6.0


def test_optimizer_iterations_count_a_custom_loops_steps(outs):
    """Keras: ``optimizer.iterations`` counts every step (``apply_gradients``), a custom
    loop's as ``fit``'s; under a strategy one per step, not one per replica."""
    _, (a, b) = outs
    assert a["custom_loop_iterations"] == b["custom_loop_iterations"] == 3
