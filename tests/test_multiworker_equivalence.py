"""MultiWorkerMirroredStrategy on 2 and 4 real processes equals one process on the global batch."""

from __future__ import annotations

import pytest
import torch

from cluster_utils import WORKERS, run_cluster
from workers.common import global_batches, reference_training

pytestmark = pytest.mark.multiprocess


def _assert_close(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(actual[k], expected[k], rtol=1e-5, atol=1e-6, msg=f"{what}: {k}")


@pytest.mark.parametrize("workers", [2, 4])
def test_same_parameters_as_one_process_on_the_global_batch(tmp_path, workers):
    seeds = [{"SEED": str(100 + i)} for i in range(workers)]
    results = run_cluster(
        WORKERS / "train_compare.py",
        workers,
        tmp_path,
        args=["sgd", "adam"],
        per_worker_env=seeds,
        timeout=240,
    )
    for i, r in enumerate(results):
        r.check(f"worker {i}")
    outs = [torch.load(tmp_path / f"result-{i}.pt") for i in range(workers)]
    assert all(o["num_replicas"] == workers for o in outs)
    for name in ("sgd", "adam"):
        chief = outs[0][name]
        # Workers were seeded differently, yet start and stay identical (chief's values).
        for i, other in enumerate(outs[1:], start=1):
            for stage in ("initial", "after_step_1", "final"):
                for k in chief[stage]:
                    assert torch.equal(chief[stage][k], other[name][stage][k]), (
                        f"worker {i} differs from the chief in {stage} {k} ({name})"
                    )
        expected = reference_training(chief["initial"], name, global_batches())
        _assert_close(chief["final"], expected, f"{workers} workers, {name}")
    # The seeds really were different: a model built with seed 101 differs from seed 100's.
    torch.manual_seed(100)
    from workers.common import build_model

    a = build_model().state_dict()
    torch.manual_seed(101)
    b = build_model().state_dict()
    assert not torch.equal(a["0.weight"], b["0.weight"])
