"""sg.dtensor on real jobs: one 4-process run on a (2,2) mesh, checked against one process.

The worker (workers/dtensor_checks.py) records what each process saw; every check of a world
size shares one run, because starting 4 torch processes on 2 cores is the expensive part.
"""

from __future__ import annotations

import json

import pytest

from cluster_utils import WORKERS, run_cluster

WORKER = WORKERS / "dtensor_checks.py"
TOLERANCE = 1e-5


def _run(mode: str, n: int, directory) -> list[dict]:
    results = run_cluster(WORKER, n, directory, args=[mode, str(directory)], timeout=240)
    for i, result in enumerate(results):
        result.check(f"{mode} worker {i}")
    return [json.loads((directory / f"{mode}-rank{i}.json").read_text()) for i in range(n)]


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> list[dict]:
    return _run("four", 4, tmp_path_factory.mktemp("dtensor4"))


def test_four_processes_form_a_2x2_mesh_started_from_tf_config(four):
    assert {r["mesh"] for r in four} == {"Mesh(|batch=2|model=2|, device_type='cpu')"}
    # Row-major: rank = 2 * batch + model.
    assert [r["coords"] for r in four] == [[0, 0], [0, 1], [1, 0], [1, 1]]


def test_copy_to_mesh_and_pack_give_each_process_its_shard(four):
    full = [[6.0 * i + j for j in range(6)] for i in range(8)]
    for r in four:
        b, m = r["coords"]
        assert r["copy_local"] == [row[3 * m : 3 * m + 3] for row in full[4 * b : 4 * b + 4]]
        assert r["batch_sharded_local"] == full[4 * b : 4 * b + 4]  # replicated along `model`
        assert r["inner_sharded_local_shape"] == [8, 3]
        assert r["copy_full_ok"] and r["pack_full_ok"] and r["unpack_ok"] and r["fetch_layout_ok"]


def test_errors_name_the_values_received(four):
    errors = four[0]["errors"]
    assert errors["mesh_size"].startswith("MeshError: create_mesh([('batch', 3)]): the mesh has 3")
    assert "this job has 4 processes" in errors["mesh_size"]
    assert "has no dimension 'replica'; expected one of ['batch', 'model']" in errors["dim_name"]
    assert "has rank 2 but copy_to_mesh's tensor of shape [8] has rank 1" in errors["rank"]
    assert "dimension 1 has size 5, which 2 shards along mesh dimension 'model'" in errors["divide"]


@pytest.mark.parametrize("run", ["tp", "dp"])
def test_training_on_the_mesh_equals_one_unsharded_process(four, run):
    """tp: (2,2) mesh, column- then row-wise Linear weights; dp: (4,) mesh, replicated."""
    for r in four:
        diffs = r[run]
        assert set(diffs) == {"forward", "grad", "loss", "weights"}
        assert max(diffs.values()) < TOLERANCE, diffs


def test_tensor_parallel_weights_and_optimizer_state_are_sharded_on_model(four):
    r = four[0]
    assert r["tp_local_shapes"] == {
        "fc1.weight": [4, 6],  # (out=8, in=6): outputs split over model=2
        "fc1.bias": [4],
        "fc2.weight": [4, 4],  # (out=4, in=8): inputs split
        "fc2.bias": [4],
    }
    assert r["tp_layouts"]["fc1.weight"].startswith(
        "Layout.from_string(sharding_specs:model,unsharded"
    )
    assert r["tp_adam_state"] == ["DTensor", "(Replicate(), Shard(dim=0))"]
    assert r["tp_grad_placements"] == "(Replicate(), Shard(dim=0))"  # reduced over `batch`
    assert r["dp_local_shapes"]["fc1.weight"] == [8, 6]
