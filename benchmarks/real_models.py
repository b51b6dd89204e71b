"""A Hugging Face GPT-2 (small config, random weights) under stratagem against raw PyTorch on
the same work, side by side in one run.

Every way is a job of 2 worker processes on the CPU (gloo, one intra-op thread each) training
the same model from the same seed on the same synthetic token batches (global batch 16 of 64
tokens, AdamW, the model's own loss), timed after a warm-up; samples/s is the global batch over
the median step time. The ways, in rounds whose order rotates (none always runs first):

- ``ddp``: raw ``DistributedDataParallel`` over a gloo group (torch's own example loop);
- ``mwms``: ``MultiWorkerMirroredStrategy``, the model built in its scope, ``strategy.run``;
- ``fully_shard``: raw FSDP2, ``fully_shard`` on each transformer block, then the root;
- ``fsdp``: ``FullyShardedStrategy(wrap=r"transformer\\.h\\.\\d+")`` (the same units);
- ``mesh_dp``: ``MeshStrategy`` on a mesh of ``("batch", 2)``: data parallel on DTensors;
- ``mesh_tp``: ``MeshStrategy`` on ``("batch", 1), ("model", 2)`` with the Megatron split of
  GPT-2's attention and MLP (tensor parallel: each process holds half of each block).

Reported: the median over rounds of each pair's ratio in the same round: ``mwms / ddp``
(target >= 1.0), ``fsdp / fully_shard`` (target >= 0.97), ``mesh_tp / mesh_dp``.

    python benchmarks/real_models.py            # 5 rounds (a few minutes on 2 cores)
    python benchmarks/real_models.py --quick    # a smoke run
    python benchmarks/real_models.py --paired 5 --steps 40   # MWMS vs DDP, step by step
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import clean_env, free_port, median_round_ratio, rotated_rounds, run_processes

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the tiny Hugging Face models of the tests

WAYS = ("ddp", "mwms", "fully_shard", "fsdp", "mesh_dp", "mesh_tp")
GLOBAL_BATCH = 16
SEQ = 64
CONFIG = {"n_embd": 128, "n_layer": 4, "n_head": 4}


def _model() -> torch.nn.Module:
    from real_models import hf_models

    return hf_models.gpt2(seed=0, n_positions=SEQ, **CONFIG).train()


def _batches(rank: int, world: int, n: int) -> list[torch.Tensor]:
    from real_models import hf_models

    local = GLOBAL_BATCH // world
    everything = hf_models.tokens(n * GLOBAL_BATCH, seed=7, seq=SEQ)
    return [
        everything[i * GLOBAL_BATCH + rank * local : i * GLOBAL_BATCH + (rank + 1) * local]
        for i in range(n)
    ]


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def _timed(step: Any, batches: list[torch.Tensor], warmup: int) -> float:
    """The global samples/s of ``step`` over ``batches`` after ``warmup`` of them."""
    times = []
    for i, ids in enumerate(batches):
        start = time.perf_counter()
        step(ids)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return GLOBAL_BATCH / statistics.median(times)


def _raw_group(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _tf_config(rank: int, world: int, port: int) -> None:
    workers = [f"localhost:{port + i}" for i in range(world)]
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}}
    )


def _plain_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """torch's own loop: the model's loss, backward, step (the wrappers reduce gradients)."""

    def step(ids: torch.Tensor) -> None:
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()

    return step


def way_ddp(rank: int, world: int, port: int, batches: list, warmup: int) -> float:
    from torch.nn.parallel import DistributedDataParallel

    _raw_group(rank, world, port)
    model = DistributedDataParallel(_model())
    return _timed(_plain_step(model, _optimizer(model)), batches, warmup)


def _mwms_step(rank: int, world: int, port: int) -> Any:
    """A step under MultiWorkerMirroredStrategy (which also makes torch's default group)."""
    import stratagem as sg

    _tf_config(rank, world, port)
    strategy = sg.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = _model()
        optimizer = _optimizer(model)

    def replica_step(ids: torch.Tensor) -> None:
        optimizer.zero_grad()
        # The model's own loss is this replica's mean: its share of the global mean.
        (model(input_ids=ids, labels=ids).loss / world).backward()
        optimizer.step()

    return lambda ids: strategy.run(replica_step, args=(ids,))


def way_mwms(rank: int, world: int, port: int, batches: list, warmup: int) -> float:
    return _timed(_mwms_step(rank, world, port), batches, warmup)


def way_fully_shard(rank: int, world: int, port: int, batches: list, warmup: int) -> float:
    from torch.distributed.fsdp import fully_shard

    _raw_group(rank, world, port)
    model = _model()
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    return _timed(_plain_step(model, _optimizer(model)), batches, warmup)


def way_fsdp(rank: int, world: int, port: int, batches: list, warmup: int) -> float:
    import stratagem as sg

    _tf_config(rank, world, port)
    strategy = sg.distribute.experimental.FullyShardedStrategy(
        wrap=r"transformer\.h\.\d+", gradient_aggregation="mean"
    )
    with strategy.scope():
        model = _model()
    optimizer = _optimizer(model)

    def replica_step(ids: torch.Tensor) -> None:
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()

    return _timed(lambda ids: strategy.run(replica_step, args=(ids,)), batches, warmup)


def _mesh_way(
    rank: int, world: int, port: int, batches: list, warmup: int, tensor_parallel: bool
) -> float:
    import stratagem as sg

    _tf_config(rank, world, port)
    shape = [("batch", 1), ("model", world)] if tensor_parallel else [("batch", world)]
    mesh = sg.dtensor.create_mesh(shape, device_type="cpu")
    model_probe = _model()
    layout_map = sg.dtensor.megatron_layout_map(mesh, model_probe) if tensor_parallel else None
    strategy = sg.distribute.experimental.MeshStrategy(mesh, layout_map=layout_map)
    with strategy.scope():
        model = _model()
    optimizer = _optimizer(model)
    # Each replica feeds its part of the global batch; with one replica (tensor parallel)
    # every process feeds all of it.
    whole = _batches(0, 1, len(batches)) if strategy.num_replicas_in_sync == 1 else batches

    def replica_step(ids: torch.Tensor) -> None:
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()

    return _timed(lambda ids: strategy.run(replica_step, args=(ids,)), whole, warmup)


def way_mesh_dp(rank: int, world: int, port: int, batches: list, warmup: int) -> float:
    return _mesh_way(rank, world, port, batches, warmup, tensor_parallel=False)


def way_mesh_tp(rank: int, world: int, port: int, batches: list, warmup: int) -> float:
    return _mesh_way(rank, world, port, batches, warmup, tensor_parallel=True)


def paired(rank: int, world: int, port: int, batches: list, warmup: int) -> float:
    """MWMS and raw DDP in the same 2 processes, step by step, the order alternating: the
    median over steps of DDP's step time over MWMS's (MWMS's samples/s over DDP's). Both meet
    the same machine at the same moment, so the ratio is far steadier than that of separate
    jobs (``--paired``)."""
    from torch.nn.parallel import DistributedDataParallel

    mwms = _mwms_step(rank, world, port)
    ddp = DistributedDataParallel(_model())  # outside the scope: stratagem leaves it alone
    sides = {"mwms": mwms, "ddp": _plain_step(ddp, _optimizer(ddp))}
    times: dict[str, list[float]] = {"mwms": [], "ddp": []}
    for i, ids in enumerate(batches):
        for name in ("mwms", "ddp") if i % 2 else ("ddp", "mwms"):
            start = time.perf_counter()
            sides[name](ids)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return statistics.median(d / m for d, m in zip(times["ddp"], times["mwms"], strict=True))


def run_way(way: str, steps: int, warmup: int) -> float:
    """One job of 2 processes for ``way``; the chief's samples/s."""
    port = free_port()
    argvs = [
        [sys.executable, __file__, "--worker", way, str(rank), "2", str(port), str(steps),
         str(warmup)]
        for rank in range(2)
    ]  # fmt: skip
    env = clean_env({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent / "tests")})
    lines = run_processes(argvs, env, timeout=600)
    return float(lines[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps and rounds (a smoke run)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--ways", default=",".join(WAYS), help="a subset, comma-separated")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--paired",
        type=int,
        metavar="JOBS",
        help="instead: MWMS and DDP step by step in the same processes, in JOBS jobs of "
        "--steps steps; the median of the per-job MWMS/DDP ratios",
    )
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        way, rank, world, port, steps, warmup = args.worker
        torch.set_num_threads(1)
        rank_, world_ = int(rank), int(world)
        batches = _batches(rank_, world_, int(steps))
        run = paired if way == "paired" else globals()[f"way_{way}"]
        rate = run(rank_, world_, int(port), batches, int(warmup))
        print(f"{rate:.4f}", flush=True)
        return
    rounds, steps = (1, 4) if args.quick else (args.rounds, args.steps)
    warmup = 1 if args.quick else 3
    ways = [w for w in args.ways.split(",") if w]
    unknown = sorted(set(ways) - set(WAYS))
    if unknown:
        parser.error(f"unknown ways {unknown}; the ways are {list(WAYS)}")
    print(f"GPT-2 {CONFIG}, global batch {GLOBAL_BATCH} x {SEQ} tokens, 2 processes", flush=True)
    if args.paired:
        ratios = []
        for job in range(args.paired):
            ratios.append(run_way("paired", steps, warmup))
            print(f"job {job + 1}/{args.paired}: mwms / ddp (paired steps) {ratios[-1]:.3f}")
        print(f"mwms / ddp, paired steps: {statistics.median(ratios):.3f} (target >= 1.0)")
        if args.json:
            Path(args.json).write_text(json.dumps({"paired_mwms/ddp": ratios}, indent=2))
        return
    samples = rotated_rounds(
        {w: (lambda w=w: run_way(w, steps, warmup)) for w in ways}, rounds, "samples/s"
    )
    result: dict[str, Any] = {
        "samples_per_s": {w: statistics.median(v) for w, v in samples.items()}
    }
    for name, base, target in (
        ("mwms", "ddp", 1.0),
        ("fsdp", "fully_shard", 0.97),
        ("mesh_tp", "mesh_dp", None),
    ):
        if name in samples and base in samples:
            ratio = median_round_ratio(samples, name, base)
            result[f"{name}/{base}"] = ratio
            goal = f" (target >= {target})" if target is not None else ""
            print(f"{name} / {base}: {ratio:.3f}{goal}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
