"""All-reduce strategies against raw PyTorch, measured side by side in one run.

1. MultiWorkerMirroredStrategy on 2 worker processes vs raw DistributedDataParallel on 2
   worker processes: the seed CNN, global batch 128, RMSprop, the same synthetic batches, one
   intra-op thread per process. Jobs alternate (DDP, ours, DDP, ours, ...); each reports
   samples/s over the timed steps; the ratio is of the medians. Ours runs the seed's loop as
   written: a distributed dataset, ``strategy.run``, ``compute_average_loss``, backward, step.
2. MirroredStrategy with 2 logical CPU replicas vs 1 replica, per-replica batch 256, one
   process each time, alternating; samples/s and the ratio of medians.

Every measurement runs in a fresh process with the same environment. ``--stable-malloc`` sets
glibc's mmap and trim thresholds high in every one of them (both sides alike): on CPU a step of
this CNN frees and reallocates 11 MB gradients, and whether glibc hands them back to the kernel
(page faults on the next step) swings a step by ±30% at random, which otherwise drowns the
difference being measured.

    python benchmarks/allreduce_strategies.py                   # full (about 3 min on 2 cores)
    python benchmarks/allreduce_strategies.py --stable-malloc   # same, allocator noise removed
    python benchmarks/allreduce_strategies.py --quick           # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))


def seed_cnn() -> torch.nn.Module:
    from mnist import build_cnn_model

    return build_cnn_model()


def batches(n: int, size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.rand(size, 28, 28, generator=g), torch.randint(0, 10, (size,), generator=g))
        for _ in range(n)
    ]


# ------------------------------------------------------------------------------ workers


def worker_ddp(rank: int, world: int, port: int, steps: int, warmup: int, batch: int) -> float:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    torch.manual_seed(0)
    model = DistributedDataParallel(seed_cnn())
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3, alpha=0.9, eps=1e-7)
    data = batches(warmup + steps, batch // world, seed=rank)
    for i, (x, y) in enumerate(data):
        if i == warmup:
            dist.barrier()
            start = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    dist.barrier()
    seconds = time.perf_counter() - start
    dist.destroy_process_group()
    return steps * batch / seconds


def worker_ours(rank: int, world: int, port: int, steps: int, warmup: int, batch: int) -> float:
    import stratagem as sg

    os.environ["TF_CONFIG"] = json.dumps(
        {
            "cluster": {"worker": [f"localhost:{port}", f"localhost:{port + 1}"][:world]},
            "task": {"type": "worker", "index": rank},
        }
    )
    strategy = sg.distribute.MultiWorkerMirroredStrategy()
    torch.manual_seed(0)
    with strategy.scope():
        model = seed_cnn()
        optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3, alpha=0.9, eps=1e-7)
    data = batches(warmup + steps, batch // world, seed=rank)
    dataset = strategy.distribute_datasets_from_function(lambda ctx: data)
    loss_fn = sg.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=sg.keras.losses.Reduction.NONE
    )

    def step_fn(inputs):
        x, y = inputs
        loss = sg.nn.compute_average_loss(loss_fn(y, model(x)), global_batch_size=batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss

    comm = strategy._comm
    for i, inputs in enumerate(dataset):
        if i == warmup:
            comm.barrier(what="benchmark start")
            start = time.perf_counter()
        strategy.run(step_fn, args=(inputs,))
    comm.barrier(what="benchmark end")
    return steps * batch / (time.perf_counter() - start)


STABLE_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
    for name in ("TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def run_job(kind: str, steps: int, warmup: int, batch: int, extra: dict[str, str]) -> float:
    """One 2-process job (one intra-op thread each); returns rank 0's samples/s."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    numbers = [str(steps), str(warmup), str(batch)]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", kind, str(rank), str(port), *numbers],
            env=_env({"OMP_NUM_THREADS": "1", **extra}),
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for rank in range(2)
    ]
    try:
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    for p, out in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"{kind} worker exited {p.returncode}: {out}")
    return float(outs[0].strip().splitlines()[-1])


def run_mirrored(replicas: int, steps: int, warmup: int, extra: dict[str, str]) -> float:
    """One MirroredStrategy process over ``replicas`` logical CPU devices; samples/s."""
    out = subprocess.run(
        [sys.executable, __file__, "--mirrored", str(replicas), str(steps), str(warmup)],
        env=_env(extra),
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    return float(out.strip().splitlines()[-1])


# ------------------------------------------------------------------------------ mirrored


def mirrored_rate(devices: list[str], steps: int, warmup: int, per_replica: int) -> float:
    import stratagem as sg

    strategy = sg.distribute.MirroredStrategy(devices)
    torch.manual_seed(0)
    with strategy.scope():
        model = seed_cnn()
        optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3, alpha=0.9, eps=1e-7)
    global_batch = per_replica * len(devices)
    dataset = strategy.experimental_distribute_dataset(
        batches(warmup + steps, global_batch, seed=0)
    )

    def step_fn(inputs):
        x, y = inputs
        per_example = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = sg.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for i, inputs in enumerate(dataset):
        if i == warmup:
            start = time.perf_counter()
        strategy.run(step_fn, args=(inputs,))
    return steps * global_batch / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps and rounds (a smoke run)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument(
        "--stable-malloc", action="store_true", help="pin glibc's mmap/trim thresholds (see above)"
    )
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    parser.add_argument("--mirrored", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, rank, port, steps, warmup, batch = args.worker
        fn = worker_ddp if kind == "ddp" else worker_ours
        print(fn(int(rank), 2, int(port), int(steps), int(warmup), int(batch)), flush=True)
        return
    if args.mirrored:
        replicas, steps, warmup = args.mirrored
        devices = [f"cpu:{i}" for i in range(replicas)]
        print(mirrored_rate(devices, steps, warmup, 256), flush=True)
        return
    rounds, steps, warmup = (1, 4, 2) if args.quick else (args.rounds, args.steps, 10)
    extra = STABLE_MALLOC if args.stable_malloc else {}

    ddp, ours = [], []
    for r in range(rounds):
        ddp.append(run_job("ddp", steps, warmup, 128, extra))
        ours.append(run_job("ours", steps, warmup, 128, extra))
        print(
            f"round {r + 1}/{rounds}: DDP {ddp[-1]:8.1f}  MWMS {ours[-1]:8.1f} samples/s",
            flush=True,
        )
    one, two = [], []
    m_steps = max(2, steps // 3)
    for r in range(rounds):
        one.append(run_mirrored(1, m_steps, warmup // 2, extra))
        two.append(run_mirrored(2, m_steps, warmup // 2, extra))
        rates = f"1 replica {one[-1]:8.1f}  2 replicas {two[-1]:8.1f}"
        print(f"round {r + 1}/{rounds}: Mirrored {rates} samples/s", flush=True)

    results = {
        "mwms_vs_ddp": {
            "ddp_samples_per_s": ddp,
            "mwms_samples_per_s": ours,
            "ratio_of_medians": statistics.median(ours) / statistics.median(ddp),
        },
        "mirrored_2_vs_1": {
            "one_replica_samples_per_s": one,
            "two_replicas_samples_per_s": two,
            "ratio_of_medians": statistics.median(two) / statistics.median(one),
        },
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "stable_malloc": args.stable_malloc,
    }
    rows = [
        ("DDP, 2 workers, global batch 128", ddp, 1.0),
        (
            "MultiWorkerMirroredStrategy, 2 workers",
            ours,
            results["mwms_vs_ddp"]["ratio_of_medians"],
        ),
        ("MirroredStrategy, 1 CPU replica, batch 256", one, 1.0),
        (
            "MirroredStrategy, 2 CPU replicas, 256 each",
            two,
            results["mirrored_2_vs_1"]["ratio_of_medians"],
        ),
    ]
    print("\n| measurement | median samples/s | ratio |\n| --- | --- | --- |")
    for name, rates, ratio in rows:
        print(f"| {name} | {statistics.median(rates):.0f} | {ratio:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
