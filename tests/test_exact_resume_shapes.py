"""Exact resume on another shape: a job stopped after step 7 of 20 and resumed on another mesh
(MeshStrategy: (2,1) data-parallel -> (1,2) tensor-parallel, (2,2), (3,1)) or pipeline
(PipelineStrategy through ``fit`` and ``BackupAndRestore``: 2 stages x 1 replica -> 2 x 2, and
3 x 1) ends with the weights of an uninterrupted one-process run, every example seen in its
global batch (a ledger of the ids each replica consumed); what cannot fit is a named error.
One first job writes both checkpoints; each second job resumes both on its shape."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist

import stratagem as sg
from cluster_utils import WORKERS, run_cluster
from stratagem import dtensor
from workers.resume_data import GLOBAL_BATCH, STOP, uninterrupted, uninterrupted_fit

SCRIPT = WORKERS / "resume_shapes.py"
MICROBATCHES = 2  # the worker's pipelines: GPipe, 2 micro-batches


def _run(workdir, tasks: list[str], processes: int) -> dict[str, list[dict]]:
    results = run_cluster(SCRIPT, processes, workdir, args=tasks, timeout=240)
    for i, r in enumerate(results):
        r.check(f"{tasks} on {processes} processes, process {i}")
    return {
        task: [torch.load(workdir / f"{task.replace(':', '-')}-{i}.pt") for i in range(processes)]
        for task in tasks
    }


@pytest.fixture
def one_process_mesh():
    assert not dist.is_initialized()
    yield dtensor.create_mesh([("batch", 1), ("model", 1)], devices=["CPU:0"])
    dist.destroy_process_group()


def test_a_sharded_checkpoint_refuses_another_model_naming_each_tensor(one_process_mesh, tmp_path):
    """DCP reshards to any mesh and layout but not to other shapes or layers: the restore names
    what does not fit (saved and live shapes, or the tensors the checkpoint lacks)."""

    def laid_out(*layers: torch.nn.Module) -> torch.nn.Module:
        return dtensor.apply_layout_map(
            torch.nn.Sequential(*layers), dtensor.LayoutMap(one_process_mesh)
        )

    path = str(tmp_path / "ckpt")
    sg.train.Checkpoint(model=laid_out(torch.nn.Linear(4, 4))).write(path)
    sg.train.Checkpoint(model=laid_out(torch.nn.Linear(4, 4))).restore(path).assert_consumed()
    with pytest.raises(sg.errors.CheckpointError) as wider:
        sg.train.Checkpoint(model=laid_out(torch.nn.Linear(4, 8))).restore(path)
    assert "2 tensor(s) have another global shape than saved (model.0.weight: saved [4, 4], " in (
        str(wider.value)
    )
    assert "model.0.bias: saved [4], here [8])" in str(wider.value)
    with pytest.raises(sg.errors.CheckpointError) as deeper:
        sg.train.Checkpoint(model=laid_out(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))).restore(
            path
        )
    assert "2 tensor(s) are not in it (model.1.weight; model.1.bias)" in str(deeper.value)


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """The stopped job: a (2,1) mesh, then 2 stages x 1 replica, on 2 processes."""
    directory = tmp_path_factory.mktemp("first")
    outs = _run(directory, ["mesh:first:2:1", "pipe:first:2:1"], 2)
    return directory, outs


def _second(first, tmp_path_factory, tasks: list[str], processes: int) -> dict:
    directory = tmp_path_factory.mktemp("second") / "job"
    shutil.copytree(first[0], directory)  # each resumes its own copy of the backups
    return _run(directory, tasks, processes)


def _assert_equal_weights(actual: dict, expected: dict, what: str) -> None:
    assert len(actual) == len(expected), what
    # The pipeline's names are shifted by its first layer (the ledger): compare in order.
    for (name, value), got in zip(expected.items(), actual.values()):
        torch.testing.assert_close(got, value, rtol=1e-6, atol=1e-7, msg=what + name)


def _mesh_steps(outs: list[dict]) -> list[list[int]]:
    """Each step's ids over the replicas: processes at one ``batch`` coordinate (one replica)
    must have seen the same rows; the replicas' rows together are the step's."""
    replicas: dict[int, list] = {}
    for out in outs:
        seen = replicas.setdefault(out["coords"][0], out["seen"])
        assert seen == out["seen"], "the processes of one replica saw other rows"
    per_replica = list(replicas.values())
    assert len({len(s) for s in per_replica}) == 1, "replicas ran different numbers of steps"
    return [sorted(i for seen in step for i in seen) for step in zip(*per_replica)]


def _pipe_steps(outs: list[dict]) -> list[list[int]]:
    """Each step's ids over the replicas, from the ledger of each replica's first stage: one
    entry per micro-batch, after the one forward torch's schedule runs at its first step to
    infer the stages' shapes (on the first micro-batch; it changes no weight)."""
    per_replica = [o["seen"][1:] for o in outs if o["stage"] == 0]
    for o in outs:
        assert o["stage"] == 0 or o["seen"] == [], "only the first stage runs the first layer"
    assert len({len(s) for s in per_replica}) == 1, "replicas ran different numbers of steps"
    steps = []
    for i in range(0, len(per_replica[0]), MICROBATCHES):
        ids = [j for seen in per_replica for mb in seen[i : i + MICROBATCHES] for j in mb]
        steps.append(sorted(ids))
    return steps


@pytest.fixture(scope="module")
def reference():
    batches, custom = uninterrupted()
    assert len(batches) == 20 and all(len(b) == GLOBAL_BATCH for b in batches)
    return batches, custom, uninterrupted_fit()


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("tasks", "processes"),
    [
        (["mesh:second:1:2", "mesh:wider:1:2"], 2),
        (["mesh:second:2:2", "pipe:second:2:2"], 4),
        (["mesh:second:3:1", "pipe:second:3:1"], 3),
    ],
    ids=["mesh-1x2", "mesh-2x2-pipe-2x2", "mesh-3x1-pipe-3x1"],
)
def test_a_job_resumed_on_another_shape_ends_as_an_uninterrupted_one(
    first, tmp_path_factory, reference, tasks, processes
):
    batches, custom_reference, fit_reference = reference
    stopped = first[1]
    second = _second(first, tmp_path_factory, tasks, processes)
    for task, outs in second.items():
        kind, phase, a, b = task.split(":")
        case = f"{kind} (first 2x1) resumed as {a}x{b}: "
        if phase == "wider":
            # A model of other shapes: refused by name, before DCP plans a read.
            for out in outs:
                error = out["error"]
                assert error is not None and error.startswith("CheckpointError: "), error
                assert "model.net.0.weight: saved [16, 5], here [32, 5]" in error, error
            continue
        if kind == "mesh":
            ledger = _mesh_steps(stopped["mesh:first:2:1"]) + _mesh_steps(outs)
            assert ledger == batches, f"{case}the steps saw other examples"
            assert all(o["step"] == len(batches) for o in outs), case
            for out in outs:
                _assert_equal_weights(out["final"], custom_reference, case)
            if b == "2":  # the Megatron layout: the first layer's rows split on `model`
                assert outs[0]["local_shapes"]["0.weight"] == [8, 5], outs[0]["local_shapes"]
            continue
        kept = _pipe_steps(stopped["pipe:first:2:1"])
        assert len(kept) == STOP, case
        ledger = kept + _pipe_steps(outs)
        assert ledger == batches, f"{case}the steps saw other examples"
        for out in outs:
            assert out["error"] is None, out["error"]
            _assert_equal_weights(out["final"], fit_reference, case)
        # The pipeline's own stage files: the same stages on other replicas, or a named error.
        at_stop = stopped["pipe:first:2:1"][0]["final"]
        for out in outs:
            restored = out["stage_files"]
            if a == "2":
                assert isinstance(restored, dict) and restored, restored
                for name, value in restored.items():
                    assert torch.equal(value, at_stop[name]), f"{case}stage files: {name}"
            else:
                assert isinstance(restored, str) and restored.startswith("CheckpointError"), (
                    restored
                )
                assert "saved by a pipeline cut into 2 stage(s)" in restored, restored
                assert "this one is cut into 3 stage(s)" in restored, restored
