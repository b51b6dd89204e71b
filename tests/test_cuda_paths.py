"""stratagem's CUDA paths, each against a CPU reference computed in the same test.

Marked ``cuda`` and skipped without a GPU (CI has none): run them with ``pytest -m cuda`` on a
machine with one or more. CI runs one test here: the job's worker dry-run on the CPU. Tests
that need two GPUs say so when skipped. Every check trains a small MLP for 3 steps (or runs
one reduction) on CUDA and compares the result with the same computation on the CPU, in
float32 with TF32 off, within a float tolerance.

- the three cross-device ops (``NcclAllReduce``, ``HierarchicalCopyAllReduce``,
  ``ReductionToOneDevice``) on every GPU of the machine (two at least);
- ``MirroredStrategy`` on CUDA devices, with each op; on one GPU;
- ``CentralStorageStrategy`` with CUDA compute devices and the parameters on the CPU;
- ``OneDeviceStrategy("cuda:0")``: ``Model.fit``, ``evaluate``, ``predict``;
- ``PipelineStrategy`` in a world of one, the stage on CUDA;
- a job of processes, one GPU each (``workers/cuda_checks.py``): MWMS over NCCL (custom loop
  and ``fit``), the NCCL communicator and the bucketed gradient all-reduce, and
  ``MeshStrategy`` on a CUDA mesh, ``FullyShardedStrategy``; one process on one GPU (a world of
  one over NCCL), two on two; in a group stratagem starts, and in one started before it.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F

import stratagem as sg
from cluster_utils import WORKERS, run_cluster
from stratagem.comm.cross_device_ops import (
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
)

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
one_gpu = pytest.mark.skipif(GPUS == 0, reason="needs a CUDA device")
two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs two CUDA devices, this machine has {GPUS}")
OPS = [NcclAllReduce, HierarchicalCopyAllReduce, ReductionToOneDevice]
TOL = 1e-5


@pytest.fixture(autouse=True)
def _exact_float32():
    """TF32 off, so that a CUDA matmul rounds as the CPU's does (to float tolerance)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _mlp() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


# The MLP's initial weights as the CPU makes them, taken here, outside every scope: a model
# built in a scope that places on a GPU is initialised there, by the CUDA generator, and that
# includes a second MLP built in the scope only to copy from.
_INITIAL = [p.detach().clone() for p in _mlp().parameters()]


def _start(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` (built in a scope) with the CPU-built MLP's initial weights."""
    with torch.no_grad():
        for p, initial in zip(module.parameters(), _INITIAL, strict=True):
            p.copy_(initial)
    return module


def _batches(steps: int = 3, batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [
        (torch.randn(batch, 6, generator=g), torch.randint(0, 4, (batch,), generator=g))
        for _ in range(steps)
    ]


def _cpu_reference(steps: int = 3, batch: int = 8) -> dict[str, torch.Tensor]:
    """The MLP's weights after ``steps`` SGD steps on the global batches, on the CPU."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches(steps, batch):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_weights_match(module: torch.nn.Module, reference: dict[str, torch.Tensor]) -> None:
    got = {n: p.detach().cpu() for n, p in module.named_parameters()}
    assert got.keys() == reference.keys()
    for name, ref in reference.items():
        assert torch.allclose(got[name], ref, atol=TOL, rtol=TOL), (
            f"{name}: max difference {float((got[name] - ref).abs().max()):.3g} from the CPU run"
        )


def _train_with(strategy: sg.distribute.Strategy) -> torch.nn.Module:
    """3 SGD steps of the MLP in ``strategy`` (a custom loop over a distributed dataset)."""
    with strategy.scope():
        model = _start(_mlp())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.cat([b[0] for b in _batches()])
    y = torch.cat([b[1] for b in _batches()])
    dataset = strategy.experimental_distribute_dataset(
        sg.data.Dataset.from_tensor_slices((x, y)).batch(8)
    )

    def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        per_example = F.cross_entropy(model(xb), yb, reduction="none")
        loss = sg.nn.compute_average_loss(per_example, global_batch_size=8)
        opt.zero_grad()
        loss.backward()
        opt.step()

    for xb, yb in dataset:
        strategy.run(step, args=(xb, yb))
    return model


# ------------------------------------------------------------------ cross-device ops


@pytest.mark.cuda
@two_gpus
@pytest.mark.parametrize("op_class", OPS, ids=lambda c: c.__name__)
def test_cross_device_ops_reduce_on_every_gpu_like_the_cpu(op_class):
    devices = [torch.device("cuda", i) for i in range(GPUS)]
    g = torch.Generator().manual_seed(3)
    # Two float32 values and a float64 one (packed apart), given per device.
    shapes = [((5, 3), torch.float32), ((7,), torch.float32), ((2, 2), torch.float64)]
    cpu_values = [[torch.randn(s, generator=g, dtype=t) for _ in devices] for s, t in shapes]
    on_devices = [[v.to(d) for v, d in zip(values, devices)] for values in cpu_values]
    op = op_class()
    with warnings.catch_warnings():
        # NcclAllReduce must not fall back to ReductionToOneDevice on distinct GPUs.
        warnings.filterwarnings("error", message="NcclAllReduce needs")
        op.check_devices(devices)
        for reduce_op, combine in (
            ("SUM", lambda vs: torch.stack(vs).sum(0)),
            ("MEAN", lambda vs: torch.stack(vs).mean(0)),
            ("MAX", lambda vs: torch.stack(vs).amax(0)),
        ):
            destination = devices[-1]
            got = op.batch_reduce(reduce_op, on_devices, destination)
            for result, values in zip(got, cpu_values):
                assert result.device == destination, (reduce_op, result.device)
                expected = combine(values)
                assert torch.allclose(result.cpu(), expected, atol=1e-6), (reduce_op, op)
        # The inputs are left as they were (NCCL reduces into a packed copy).
        for values, placed in zip(cpu_values, on_devices):
            for v, p in zip(values, placed):
                assert torch.equal(p.cpu(), v)
        copies = op.broadcast(on_devices[0][0], devices)
        assert [c.device for c in copies] == devices
        assert all(torch.equal(c.cpu(), cpu_values[0][0]) for c in copies)


# ------------------------------------------------------------------ in-process strategies


@pytest.mark.cuda
@two_gpus
@pytest.mark.parametrize("op_class", OPS, ids=lambda c: c.__name__)
def test_mirrored_on_two_gpus_trains_like_one_cpu(op_class):
    with warnings.catch_warnings():
        # NcclAllReduce must reduce with NCCL here, not fall back to ReductionToOneDevice.
        warnings.filterwarnings("error", message="NcclAllReduce needs")
        strategy = sg.distribute.MirroredStrategy(["cuda:0", "cuda:1"], cross_device_ops=op_class())
        model = _train_with(strategy)
    assert all(p.device == torch.device("cuda", 0) for p in model.parameters())
    _assert_weights_match(model, _cpu_reference())
    # strategy.reduce of per-replica values, each on its replica's GPU, through the same op.
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.full(
            (3,),
            float(ctx.replica_id_in_sync_group + 1),
            device=f"cuda:{ctx.replica_id_in_sync_group}",
        )
    )
    total = strategy.reduce("SUM", values, axis=None)
    assert torch.equal(total.cpu(), torch.full((3,), 3.0))


@pytest.mark.cuda
@one_gpu
def test_mirrored_on_one_gpu_trains_like_the_cpu():
    strategy = sg.distribute.MirroredStrategy(["cuda:0"])
    model = _train_with(strategy)
    assert all(p.device == torch.device("cuda", 0) for p in model.parameters())
    _assert_weights_match(model, _cpu_reference())


@pytest.mark.cuda
@one_gpu
def test_central_storage_computes_on_a_gpu_with_the_parameters_on_the_cpu():
    strategy = sg.distribute.experimental.CentralStorageStrategy(
        compute_devices=["cuda:0"], parameter_device="cpu:0"
    )
    model = _train_with(strategy)
    assert all(p.device.type == "cpu" for p in model.parameters())
    _assert_weights_match(model, _cpu_reference())


@pytest.mark.cuda
@two_gpus
def test_central_storage_on_two_gpus_trains_like_one_cpu():
    # TF's default: every GPU computes, the parameters live on the CPU.
    strategy = sg.distribute.experimental.CentralStorageStrategy()
    assert strategy.extended.parameter_devices == ("cpu",)
    model = _train_with(strategy)
    assert all(p.device.type == "cpu" for p in model.parameters())
    _assert_weights_match(model, _cpu_reference())


def _fit(device: str) -> tuple[sg.keras.Model, dict, list, torch.Tensor]:
    strategy = sg.distribute.OneDeviceStrategy(device)
    with strategy.scope():
        model = sg.keras.Model(_start(_mlp()))
        model.compile(
            sg.keras.optimizers.SGD(learning_rate=0.1),
            sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    x = torch.cat([b[0] for b in _batches()])
    y = torch.cat([b[1] for b in _batches()])
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    evaluated = model.evaluate(x, y, batch_size=8, verbose=0)
    predicted = torch.as_tensor(model.predict(x, batch_size=8, verbose=0))
    return model, history.history, evaluated, predicted


@pytest.mark.cuda
@one_gpu
def test_one_device_fit_on_a_gpu_matches_fit_on_the_cpu(tmp_path):
    model, history, evaluated, predicted = _fit("cuda:0")
    assert all(p.device == torch.device("cuda", 0) for p in model.module.parameters())
    ref_model, ref_history, ref_evaluated, ref_predicted = _fit("cpu:0")
    _assert_weights_match(model.module, {n: p for n, p in ref_model.module.named_parameters()})
    assert history.keys() == ref_history.keys()
    for key in ref_history:
        assert history[key] == pytest.approx(ref_history[key], abs=1e-5), key
    assert evaluated == pytest.approx(ref_evaluated, abs=1e-5)
    assert predicted.device.type == "cpu" and predicted.shape == (24, 4)
    assert torch.allclose(predicted, ref_predicted, atol=1e-5)
    # model.save of a model on a GPU writes a program (traced on a CPU copy) that loads on
    # the CPU and predicts as the model did.
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no torch.export program")
        model.save(str(tmp_path / "saved"))
    loaded = sg.keras.models.load_model(str(tmp_path / "saved"))
    x = torch.cat([b[0] for b in _batches()])
    again = torch.as_tensor(loaded.predict(x.numpy(), batch_size=8))
    assert torch.allclose(again, predicted, atol=1e-5)


@pytest.mark.cuda
@one_gpu
def test_pipeline_world_of_one_trains_a_cuda_stage_like_the_cpu():
    # A world of one: the micro-batches run one after another in this process, on the GPU.
    strategy = sg.distribute.experimental.PipelineStrategy(
        num_stages=1, schedule="GPipe", num_microbatches=2
    )
    module = _mlp().to("cuda:0")
    pipe = strategy.pipeline(module, F.cross_entropy)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    losses = []
    for x, y in _batches():
        opt.zero_grad()
        losses.append(pipe.train_step(x.to("cuda:0"), y.to("cuda:0"), opt))
    assert all(p.device == torch.device("cuda", 0) for p in pipe.parameters())
    # Two micro-batches of a mean loss, averaged: the gradient of the whole batch's mean.
    _assert_weights_match(pipe.module, _cpu_reference())
    reference = _mlp()
    x0, y0 = _batches()[0]
    assert losses[0] == pytest.approx(float(F.cross_entropy(reference(x0), y0).detach()), abs=1e-5)


# ------------------------------------------------------------------ a job, one GPU per process


CHECKS = {"mwms_loop", "mwms_fit", "nccl_communicator", "gradient_reducer", "mesh_fit", "fsdp_loop"}


def _job(tmp_path, n: int, device: str, group: str) -> list[dict]:
    """``workers/cuda_checks.py`` as a job of ``n`` processes; each one's report, after
    checking that every check passed on every process."""
    args = [str(tmp_path), device, group]
    results = run_cluster(WORKERS / "cuda_checks.py", n, tmp_path, args=args, timeout=240)
    for i, r in enumerate(results):
        r.check(f"worker {i}")
    reports = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(n)]
    failures = [
        f"rank {rank}, {name}: {check}"
        for rank, report in enumerate(reports)
        for name, check in report["checks"].items()
        if not check.get("ok")
    ]
    assert not failures, "\n".join(failures)
    assert set(reports[0]["checks"]) == CHECKS, reports[0]["checks"].keys()
    assert all(r["world"] == n for r in reports), reports
    return reports


def _assert_on_gpus(reports: list[dict], group: str) -> None:
    for rank, report in enumerate(reports):
        assert report["device"] == f"cuda:{rank}", report
        assert report["current_device"] == rank, report  # set before NCCL started
        # Ours has gloo beside NCCL; Ray's (adopted) is NCCL alone: CPU tensors via the GPU.
        if group == "adopted":
            assert report["backend"] == "nccl", report
        else:
            assert "nccl" in report["backend"], report


# ``ours``: stratagem starts the group; ``adopted``: a pure NCCL group started first, as Ray
# Train starts it on GPUs, which stratagem joins.
@pytest.mark.cuda
@one_gpu
@pytest.mark.parametrize("group", ["ours", "adopted"])
def test_one_process_on_one_gpu_nccl_world_of_one(tmp_path, group):
    _assert_on_gpus(_job(tmp_path, 1, "cuda", group), group)


@pytest.mark.cuda
@two_gpus
@pytest.mark.parametrize("group", ["ours", "adopted"])
def test_two_processes_on_two_gpus_over_nccl(tmp_path, group):
    _assert_on_gpus(_job(tmp_path, 2, "cuda", group), group)


@pytest.mark.multiprocess
def test_the_job_checks_dry_run_on_the_cpu(tmp_path):
    # CI has no GPU: the same worker on the CPU, so that it still runs when one comes; two
    # processes in a group started before stratagem (the adopted path, a mesh over it too).
    reports = _job(tmp_path, 2, "cpu", "adopted")
    assert [r["device"] for r in reports] == ["cpu", "cpu"], reports
    assert all(r["backend"] == "gloo" for r in reports), reports
