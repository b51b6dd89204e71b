"""One process of a job on GPUs, one each (``test_cuda_paths.py``): checks of the NCCL paths.

Run as a TF_CONFIG cluster of 1 or 2 workers; writes ``<out>/rank<r>.json`` with one entry per
check (``ok`` and what it measured, or the error), so that one run reports every failure:

- ``mwms_loop``: a custom loop under MultiWorkerMirroredStrategy on this worker's GPU, over a
  distributed dataset, against the same SGD steps on the CPU; ``strategy.reduce`` of the loss;
- ``mwms_fit``: ``Model.fit`` under the same strategy against ``fit`` on the CPU, then
  ``model.save`` (with its ``torch.export`` program) and ``load_model``;
- ``nccl_communicator``: all-reduce (sum, mean), broadcast and all-gather of CUDA tensors over
  the job's NCCL group (a world of one starts one, as MWMS does not: alone it needs none);
- ``gradient_reducer``: the bucketed gradient all-reduce during backward, on CUDA, over two
  backward passes (accumulation), against the gradients computed on the CPU;
- ``mesh_fit``: the same under MeshStrategy on a CUDA mesh;
- ``fsdp_loop``: the custom loop of ``mwms_loop`` under FullyShardedStrategy (FSDP2).

``cuda_checks.py OUT [cuda|cpu] [ours|adopted]``: ``adopted`` starts the process group first,
as Ray Train does (pure NCCL on GPUs, so CPU tensors must go through the GPU), and stratagem
joins it; ``cpu`` runs the same checks on the CPU over gloo: CI's dry run of this script, so
that it still runs when a GPU comes (the CUDA run is the one that matters).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import stratagem as sg
from stratagem.cluster import resolve_cluster
from stratagem.comm import ReduceOp
from stratagem.comm.bucketing import GradientReducer
from stratagem.comm.process_group import connect

TOL = 1e-5
DEVICE_TYPE = "cuda"  # "cpu" for a dry run


def mlp() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


# The CPU-built MLP's initial weights, taken here, outside every scope: a model built in a
# scope that places on a GPU is initialised there (by the CUDA generator), a second MLP built
# in the scope only to copy from included.
INITIAL = [p.detach().clone() for p in mlp().parameters()]


def start(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` (built in a scope) with the CPU-built MLP's initial weights."""
    with torch.no_grad():
        for p, initial in zip(module.parameters(), INITIAL, strict=True):
            p.copy_(initial)
    return module


def data(n: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return torch.randn(n, 6, generator=g), torch.randint(0, 4, (n,), generator=g)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.full_tensor() if hasattr(a, "full_tensor") else a
    return float((a.detach().cpu() - b.detach().cpu()).abs().max())


def weights_diff(module: torch.nn.Module, reference: torch.nn.Module) -> float:
    ref = dict(reference.named_parameters())
    return max(max_diff(p, ref[n]) for n, p in module.named_parameters())


def cpu_loop() -> tuple[torch.nn.Module, list[float]]:
    """3 SGD steps on the global batches of 8, on the CPU; the losses."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data()
    losses = []
    for xb, yb in zip(x.split(8), y.split(8)):
        opt.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return model, losses


def loop_compare(strategy: sg.distribute.Strategy, device: torch.device) -> dict:
    with strategy.scope():
        model = start(mlp())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    placed = all(p.device == device for p in model.parameters())
    x, y = data()
    dataset = strategy.experimental_distribute_dataset(
        sg.data.Dataset.from_tensor_slices((x, y)).batch(8)
    )

    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        assert xb.device == device, f"the batch is on {xb.device}, not {device}"
        per_example = F.cross_entropy(model(xb), yb, reduction="none")
        loss = sg.nn.compute_average_loss(per_example, global_batch_size=8)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    losses = []
    for xb, yb in dataset:
        per_replica = strategy.run(step, args=(xb, yb))
        losses.append(float(strategy.reduce("SUM", per_replica, axis=None)))
    reference, ref_losses = cpu_loop()
    diff = weights_diff(model, reference)
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
    ok = placed and diff < TOL and loss_diff < TOL
    return {"ok": ok, "placed": placed, "weights": diff, "losses": loss_diff}


def fit_model(strategy: sg.distribute.Strategy) -> sg.keras.Model:
    with strategy.scope():
        model = sg.keras.Model(start(mlp()))
        model.compile(
            sg.keras.optimizers.SGD(learning_rate=0.1),
            sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    return model


def fit_compare(strategy: sg.distribute.Strategy, saved: Path) -> dict:
    """fit, evaluate under ``strategy`` against the CPU; then ``model.save`` to ``saved``
    (with its program) and ``load_model``, which predicts as the model."""
    x, y = data()
    runs = {}
    for name, chosen in (("gpu", strategy), ("cpu", sg.distribute.OneDeviceStrategy("cpu:0"))):
        model = fit_model(chosen)
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        runs[name] = (model, history.history, model.evaluate(x, y, batch_size=8, verbose=0))
    (model, history, evaluated), (ref, ref_history, ref_evaluated) = runs["gpu"], runs["cpu"]
    on_gpu = all(p.device.type == DEVICE_TYPE for p in model.module.parameters())
    diff = weights_diff(model.module, ref.module)
    logs = max(
        abs(a - b) for k in ref_history for a, b in zip(history[k], ref_history[k], strict=True)
    )
    evaluate = max(abs(a - b) for a, b in zip(evaluated, ref_evaluated, strict=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.save(str(saved))
    program = not any("no torch.export program" in str(w.message) for w in caught)
    predicted = torch.as_tensor(model.predict(x, batch_size=8))
    loaded = sg.keras.models.load_model(str(saved))
    reloaded = max_diff(torch.as_tensor(loaded.predict(x.numpy(), batch_size=8)), predicted)
    ok = on_gpu and diff < TOL and logs < TOL and evaluate < TOL and program and reloaded < TOL
    return {
        "ok": ok,
        "on_gpu": on_gpu,
        "weights": diff,
        "history": logs,
        "evaluate": evaluate,
        "saved_with_program": program,
        "reloaded_predict": reloaded,
    }


def nccl_communicator(comm: object, rank: int, world: int, device: torch.device) -> dict:
    got = {}
    t = torch.full((5,), float(rank + 1), device=device)
    comm.all_reduce(t, ReduceOp.SUM, what="a test sum")
    got["sum"] = torch.equal(t.cpu(), torch.full((5,), world * (world + 1) / 2))
    t = torch.full((3,), float(rank + 1), device=device)
    comm.all_reduce(t, ReduceOp.MEAN, what="a test mean")
    got["mean"] = torch.allclose(t.cpu(), torch.full((3,), (world + 1) / 2))
    t = torch.arange(4.0, device=device) + 100 * rank
    comm.broadcast(t, 0, what="a test broadcast")
    got["broadcast"] = torch.equal(t.cpu(), torch.arange(4.0))
    pieces = comm.all_gather(torch.full((2,), float(rank), device=device), what="a test gather")
    got["all_gather"] = [p.device == device for p in pieces] == [True] * world and all(
        torch.equal(p.cpu(), torch.full((2,), float(r))) for r, p in enumerate(pieces)
    )
    return {"ok": all(got.values()), **got}


def gradient_reducer(comm: object, rank: int, world: int, device: torch.device) -> dict:
    """Two backward passes per process, reduced during backward: the gradients are the sum
    over processes and passes, as the CPU computes it from every process's inputs."""

    def inputs(r: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(100 + r)
        return [torch.randn(4, 6, generator=g) for _ in range(2)]

    model = mlp().to(device)
    # Small buckets: several all-reduces, launched while backward still runs.
    reducer = GradientReducer(comm, first_bucket_bytes=256, bucket_bytes=256)
    reducer.add_parameters(list(model.parameters()))
    for x in inputs(rank):
        model(x.to(device)).square().sum().backward()
    reducer.flush()
    reference = mlp()
    for r in range(world):
        for x in inputs(r):
            reference(x).square().sum().backward()
    ref = dict(reference.named_parameters())
    diff = max(max_diff(p.grad, ref[n].grad) for n, p in model.named_parameters())
    reducer.remove()
    return {"ok": diff < 1e-4, "grads": diff}


def mesh_fit(world: int, device_type: str, saved: Path) -> dict:
    mesh = sg.dtensor.create_mesh([("batch", world)], device_type=device_type)
    result = fit_compare(sg.distribute.experimental.MeshStrategy(mesh), saved)
    return {**result, "mesh": repr(mesh)}


def fsdp_loop(device: torch.device) -> dict:
    """FullyShardedStrategy (FSDP2; nothing to shard in a world of one) against the CPU."""
    strategy = sg.distribute.experimental.FullyShardedStrategy()
    return {**loop_compare(strategy, device), "strategy": repr(strategy)}


def start_group_as_ray_does() -> None:
    """The default group, started before stratagem runs: NCCL alone on GPUs (Ray Train's
    choice), on the first worker's port."""
    config = json.loads(os.environ["TF_CONFIG"])
    workers = config["cluster"]["worker"]
    rank = config["task"]["index"]
    if DEVICE_TYPE == "cuda":
        torch.cuda.set_device(rank)
    torch.distributed.init_process_group(
        "nccl" if DEVICE_TYPE == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{workers[0].rsplit(':', 1)[1]}",
        rank=rank,
        world_size=len(workers),
    )


def run(out: dict, name: str, check: Callable[[], dict]) -> None:
    try:
        out["checks"][name] = check()
    except Exception:
        out["checks"][name] = {"ok": False, "error": traceback.format_exc(limit=6)}
    print(f"{name}: {out['checks'][name]}", flush=True)


def main() -> None:
    global DEVICE_TYPE
    directory = Path(sys.argv[1])
    DEVICE_TYPE = sys.argv[2] if len(sys.argv) > 2 else "cuda"
    backend = "cpu:gloo,cuda:nccl" if DEVICE_TYPE == "cuda" else "gloo"
    if len(sys.argv) > 3 and sys.argv[3] == "adopted":
        start_group_as_ray_does()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    strategy = sg.distribute.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_resolver.task_id
    world = strategy.num_replicas_in_sync
    device = strategy.extended.replica_devices[0]
    out: dict = {"world": world, "device": str(device), "checks": {}}
    # MWMS made this worker's GPU the current one (NCCL and device="cuda" tensors use it).
    out["current_device"] = torch.cuda.current_device() if DEVICE_TYPE == "cuda" else None
    run(out, "mwms_loop", lambda: loop_compare(strategy, device))
    run(out, "mwms_fit", lambda: fit_compare(strategy, directory / "saved-mwms"))
    # MWMS alone needs no group; a world of one over NCCL is started here as MWMS would.
    comm = strategy.extended.communicator
    if world == 1:
        comm = connect(resolve_cluster(), backend=backend)
    out["backend"] = str(torch.distributed.get_backend())
    run(out, "nccl_communicator", lambda: nccl_communicator(comm, rank, world, device))
    run(out, "gradient_reducer", lambda: gradient_reducer(comm, rank, world, device))
    run(out, "mesh_fit", lambda: mesh_fit(world, DEVICE_TYPE, directory / "saved-mesh"))
    run(out, "fsdp_loop", lambda: fsdp_loop(device))
    (directory / f"rank{rank}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
