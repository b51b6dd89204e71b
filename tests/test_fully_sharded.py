"""FullyShardedStrategy (FSDP2) on real jobs: one 4-process run, then one 2-process run.

The worker (workers/fsdp_checks.py) records what each process saw. The 4 processes train with
Adam, save a checkpoint and train HSDP on a (2, 2) mesh; the 2 processes compare custom loops
and Model.fit against MultiWorkerMirroredStrategy, count the bytes they hold, hit the errors,
and restore the 4 processes' checkpoint. This test process restores it once more, alone.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

import stratagem as sg
from cluster_utils import WORKERS, run_cluster
from workers.resume_data import uninterrupted

WORKER = WORKERS / "fsdp_checks.py"
TOLERANCE = 1e-6


def _run(mode: str, n: int, directory, files: list[str]) -> list[dict]:
    results = run_cluster(WORKER, n, directory, args=[mode, str(directory)], timeout=300)
    for i, result in enumerate(results):
        result.check(f"{mode} worker {i}")
    return [
        json.loads((directory / f"{name}-rank{i}.json").read_text())
        for name in files
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp")


@pytest.fixture(scope="module")
def four(directory) -> list[dict]:
    return _run("four", 4, directory, ["four"])


@pytest.fixture(scope="module")
def two_and_restore(four, directory) -> tuple[list[dict], list[dict]]:
    results = _run("two", 2, directory, ["two", "restore"])
    return results[:2], results[2:]


@pytest.fixture(scope="module")
def two(two_and_restore) -> list[dict]:
    return two_and_restore[0]


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(5, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 4),
    )


def test_on_4_processes_too_sgd_and_adam_loops_equal_multi_worker_mirrored(four):
    for r in four:
        assert r["adam_max_diff"] < TOLERANCE and r["sgd_max_diff"] < TOLERANCE, r


def test_custom_loops_with_sgd_and_adam_equal_multi_worker_mirrored(two):
    """Workers seeded differently; same data through experimental_distribute_dataset and
    compute_average_loss: ZeRO-3 (SGD, Adam, SGD compiled) and ZeRO-2 (Adam) end where MWMS
    ends."""
    for r in two:
        assert r["sgd_param_types"] == ["DTensor"] and r["adam_param_types"] == ["DTensor"]
        assert r["sgd_max_diff"] < TOLERANCE and r["sgd_loss_diff"] < TOLERANCE
        assert r["adam_max_diff"] < TOLERANCE and r["adam_loss_diff"] < TOLERANCE
        assert r["zero2_max_diff"] < TOLERANCE
        # torch.compile of the sharded model (aot_eager; FSDP's hooks run between its graphs)
        assert r["compiled_graphs"] >= 1 and r["compiled_max_diff"] < TOLERANCE
        assert "DTensor" in r["adam_state_types"]  # exp_avg, exp_avg_sq: sharded
        assert r["describe"]["mesh"] == {"shard": 2}
        assert r["describe"]["strategy"] == "FullyShardedStrategy"


def test_accumulating_two_halves_reduce_scatters_once_per_step_and_equals_mwms(two):
    # accumulate_gradients(): FSDP2's set_requires_gradient_sync(False) for the first half's
    # backward; the second reduce-scatters both halves at once, one per unit.
    for r in two:
        assert r["accumulated_max_diff"] < TOLERANCE, r
        # Without the block each half's backward reduce-scatters every unit.
        assert r["reduce_scatters_per_step_each_pass"] == 2 * r["reduce_scatters_per_step"] > 0


@pytest.mark.parametrize("world", [2, 4])
def test_each_process_holds_at_most_1_over_n_plus_5_percent(world, two, four):
    """Parameters + gradients + Adam state after a step, counted from the local shards."""
    for r in two if world == 2 else four:
        memory = r["memory"]
        assert memory["held"] <= (1 / world + 0.05) * memory["replicated"], memory
    assert four[0]["local_shapes"]["2.weight"] == [8, 32]  # 32 rows over 4 processes


def test_bf16_mixed_precision_computes_in_bf16_and_keeps_float32_shards(two):
    for r in two:
        assert r["bf16_output_dtype"] == "torch.bfloat16"
        assert r["bf16_param_types"] == ["torch.float32"]
        # bf16 keeps ~3 significant digits: near the float32 run (much nearer than where
        # both started), not equal to it.
        assert 0 < r["bf16_mean_diff"] < 0.2 * r["trained_vs_initial"], r
        assert r["bf16_loss_diff"] < 0.02


def test_each_top_level_child_with_parameters_or_what_wrap_names_is_one_unit(two):
    units = two[0]["units"]
    assert units["default"] == ["", "0", "2", "4"]  # the root, then the Linear layers
    assert units["regex"] == ["", "0", "2"]
    assert units["predicate"] == ["", "4"]
    # A sharded model inside a new one stays as it was; the new layer is a unit of its own.
    assert units["nested"] == ["", "0", "0.0", "0.2", "0.4", "1"]
    assert units["nested_types"] == ["DTensor"]


def test_zero3_reshards_after_forward_and_zero2_keeps_the_whole_weight_until_backward(two):
    for r in two:
        assert r["after_forward"]["zero3"] == {"forward": "DTensor", "backward": "DTensor"}
        assert r["after_forward"]["zero2"] == {"forward": "Parameter", "backward": "DTensor"}


def test_an_optimizer_made_before_distribute_module_steps_the_shards(two):
    for r in two:
        assert r["early_optimizer"]["types"] == ["DTensor"]
        assert r["early_optimizer"]["moved"] > 0
    assert two[0]["early_optimizer"]["checksum"] == two[1]["early_optimizer"]["checksum"]


def test_fit_evaluate_predict_equal_multi_worker_mirrored(two):
    """With ModelCheckpoint and BackupAndRestore; the last checkpoint loads (load_weights)
    into a fresh model sharded by strategy.distribute_module to the same weights; a fit
    interrupted after epoch 0 and run again resumes from the sharded backup and ends the same
    (``diffs["resumed"]``)."""
    for r in two:
        diffs = r["fit"]["diffs"]
        assert max(diffs.values()) < TOLERANCE, diffs
        assert r["fit"]["explicit_types"] == ["DTensor"]  # strategy.distribute_module(m)
        assert r["fit"]["resumed_epochs"] == [1]  # BackupAndRestore resumed after epoch 0
        loss = r["fit"]["history"]["loss"]
        assert loss[-1] < loss[0]


def test_model_save_writes_a_whole_plain_model(two, directory):
    """model.save under the strategy: whole weights of the plain class, loadable without
    stratagem (safetensors), and by load_model."""
    from safetensors.torch import load_file

    config = json.loads((directory / "saved_fsdp" / "config.json").read_text())
    assert config["module"]["class"] == "torch.nn.modules.container.Sequential"
    plain = _model()
    plain.load_state_dict(load_file(str(directory / "saved_fsdp" / "model.safetensors")))
    expected = torch.load(directory / "saved_fsdp_flat.pt", weights_only=True)["weights"]
    flat = torch.cat([p.detach().reshape(-1) for p in plain.parameters()])
    assert torch.equal(flat, expected)
    loaded = sg.keras.models.load_model(str(directory / "saved_fsdp"), module=_model())
    x = torch.randn(3, 5)
    torch.testing.assert_close(loaded.module(x), plain(x))


def test_errors_name_the_values_received(two):
    errors = two[0]["errors"]
    assert (
        "FSDP unit '(the root)' of Mixed holds trainable parameters of several dtypes"
        in (errors["mixed_dtypes"])
    )
    assert "{'torch.float32': ['a'], 'torch.float64': ['b']}" in errors["mixed_dtypes"]
    assert "wrap=['blocks\\\\.\\\\d+']) matches no module of Sequential" in errors["wrap"]
    assert "paths are ['0', '1', '2', '3', '4']" in errors["wrap"]
    assert (
        "the mesh {'shard': 1} has 1 devices but this job has 2 processes" in (errors["mesh_size"])
    )
    assert "needs the dimensions ('replicate', 'shard')" in errors["mesh_dims"]
    assert "got ('hosts', 'local')" in errors["mesh_dims"]
    assert (
        "6 parameters created in FullyShardedStrategy.scope() and 2 created outside"
        in (errors["outside"])
    )


def test_hsdp_on_a_replicate_by_shard_mesh_equals_fsdp(four):
    for r in four:
        assert r["hsdp_placements"] == "(Replicate(), Shard(dim=0))"
        assert r["hsdp_local_shapes"]["2.weight"] == [16, 32]  # sharded over 2, not 4
        assert r["hsdp_vs_fsdp"] < TOLERANCE


def test_a_checkpoint_saved_on_4_processes_restores_on_2(four, two_and_restore):
    _, restored = two_and_restore
    assert {r["saved_path"] for r in four} == {restored[0]["restored_path"]}
    for r in restored:
        assert len(r["restored_diffs"]) == 6 * 4  # 6 weights, each with 3 Adam slots
        assert max(r["restored_diffs"].values()) == 0.0, r["restored_diffs"]
        assert r["restored_epoch"] == 3
        assert r["restored_local_shapes"]["2.weight"] == [16, 32]


def test_a_loop_stopped_on_4_processes_ends_on_2_as_an_uninterrupted_one(four, two_and_restore):
    """The 4 processes stop after step 7 of 20 and checkpoint the model, the optimizer and the
    distributed iterator (resharded through DCP, the iterator's position as plain data); the 2
    processes restore and finish: the uninterrupted run's examples step by step and weights."""
    _, restored = two_and_restore
    batches, reference = uninterrupted()
    first = [r["seen"] for r in _resume_first(four)]
    second = [r["resumed_seen"] for r in restored]
    ledger = [sorted(i for seen in step for i in seen) for step in zip(*first)]
    ledger += [sorted(i for seen in step for i in seen) for step in zip(*second)]
    assert ledger == batches
    for name, value in reference.items():
        got = torch.tensor(restored[0]["resumed_final"][name])
        torch.testing.assert_close(got, value, rtol=1e-6, atol=1e-7, msg=name)


def _resume_first(four: list[dict]) -> list[dict]:
    return [r["resume_first"] for r in four]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_checkpoint_restores_into_a_plain_model_in_one_process(four, directory):
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    epoch = torch.tensor(0)
    checkpoint = sg.train.Checkpoint(model=model, optimizer=optimizer, epoch=epoch)
    checkpoint.restore(four[0]["saved_path"]).assert_consumed()
    expected = torch.load(directory / "expected.pt", weights_only=True)
    params = dict(model.named_parameters())
    for key, value in expected.items():
        name, _, slot = key.partition("/")
        got = optimizer.state[params[name]][slot] if slot else params[name]
        assert torch.equal(got.detach(), value), key
    assert int(epoch) == 3


def test_the_sharded_fit_example_reaches_90_percent_on_two_workers(tmp_path):
    import re
    import subprocess
    import sys

    from cluster_utils import REPO, child_env

    example = str(REPO / "examples" / "sharded_fit.py")
    argv = [sys.executable, "-m", "stratagem.cli", "run", "-n", "2", example, "--epochs", "6"]
    done = subprocess.run(
        argv, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    accuracies = [float(a) for a in re.findall(r"Test accuracy: ([0-9.]+)", output)]
    assert len(accuracies) == 2 and min(accuracies) >= 0.90, output
    assert (tmp_path / "sharded_fit_output" / "saved_model" / "model.safetensors").exists()


# ---------------------------------------------------------------------- in this process alone


def test_a_job_of_one_keeps_the_model_whole_and_trains_it():
    strategy = sg.distribute.experimental.FullyShardedStrategy()
    assert strategy.num_replicas_in_sync == 1 and strategy.mesh is None
    with strategy.scope():
        model = _model()
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert strategy.extended.variable_created_in_scope(model[0].weight)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"reshard_after_forward": "yes"}, TypeError, "True (ZeRO-3) or False (ZeRO-2), got 'yes'"),
        ({"cpu_offload": 1}, TypeError, "cpu_offload must be True or False, got 1"),
        ({"mixed_precision": "int8"}, ValueError, "a floating dtype or its name"),
        ({"mixed_precision": 3}, ValueError, "got 3"),
        ({"wrap": [1]}, TypeError, "wrap must be a regex, a list of regexes or a"),
        ({"wrap": "("}, ValueError, "wrap regex '(' does not compile"),
        ({"mesh": "shard"}, TypeError, "mesh must be a sg.dtensor.Mesh or a torch DeviceMesh"),
        ({"communication_options": "RING"}, TypeError, "communication_options must be"),
    ],
)
def test_bad_arguments_are_named_errors(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        sg.distribute.experimental.FullyShardedStrategy(**kwargs)


def test_a_cluster_with_a_ps_job_is_refused():
    from stratagem.cluster import SimpleClusterResolver

    cluster = sg.train.ClusterSpec(
        {"worker": ["localhost:1", "localhost:2"], "ps": ["localhost:3"]}
    )
    resolver = SimpleClusterResolver(cluster, task_type="worker", task_id=0)
    with pytest.raises(Exception, match="FullyShardedStrategy cannot use task type 'ps'"):
        sg.distribute.experimental.FullyShardedStrategy(cluster_resolver=resolver)


def test_buckets_keep_each_dtype_in_order_under_the_limit():
    from stratagem.distribute.machinery.worker_setup import buckets

    tensors = [torch.zeros(10), torch.zeros(3, dtype=torch.float64), torch.zeros(10)]
    tensors += [torch.zeros(30), torch.zeros(2)]
    shapes = [[tuple(t.shape) for t in b] for b in buckets(tensors, 100)]
    assert shapes == [[(10,), (10,)], [(3,)], [(30,)], [(2,)]]


@pytest.mark.e2e
def test_the_benchmark_smoke_run_reports_every_variant(tmp_path):
    """benchmarks/sharded.py --quick: the figures of its three variants (not asserted: timed)."""
    import sys

    from cluster_utils import REPO, Process, child_env

    out = tmp_path / "results.json"
    argv = [sys.executable, str(REPO / "benchmarks" / "sharded.py"), "--quick", "--json", str(out)]
    result = Process(argv, child_env(), tmp_path, "benchmark").wait(timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(out.read_text())
    variants = {"FullyShardedStrategy", "MultiWorkerMirroredStrategy", "raw fully_shard"}
    for process in figures["processes"]:
        assert set(process["samples_per_s"]) == variants
        assert min(process["samples_per_s"].values()) > 0
        assert set(process["peak_bytes"]) == variants
    assert set(figures["ratios"]) == {"speed: ours / raw fully_shard", "peak memory: ours / MWMS"}
