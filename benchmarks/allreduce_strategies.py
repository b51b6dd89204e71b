"""All-reduce strategies against raw PyTorch, measured side by side in one run.

1. MultiWorkerMirroredStrategy on 2 worker processes vs raw DistributedDataParallel on 2
   worker processes: the seed CNN, global batch 128, RMSprop, the same synthetic batches, one
   intra-op thread per process. Ours runs the seed's loop as written: a distributed dataset,
   ``strategy.run``, ``compute_average_loss``, backward, step. Measured two ways:
   - separate jobs, alternating (DDP, ours, DDP, ours, ...), each in fresh processes: what a
     user sees, but a job's speed on a shared 2-core machine swings by ±15%;
   - interleaved: in each of the same two processes, an MWMS model and a DDP model (over the
     same gloo process group) take turns step by step (which goes first alternates), so both
     sides meet the same machine state; per job, the median over pairs of steps of DDP's step
     time over ours (our samples/s over DDP's); reported, the median of the jobs.
2. MirroredStrategy with 2 logical CPU replicas vs 1 replica, per-replica batch 256, one
   process each time, alternating; samples/s and the ratio of medians. Beside it, the ceiling
   of the design on this machine: raw PyTorch in 2 threads (1 intra-op thread each, each its
   own model, no synchronisation at all) vs 1 thread with every intra-op thread.

Every measurement runs in a fresh process with the same environment. ``--stable-malloc`` sets
glibc's mmap and trim thresholds high in every one of them (both sides alike): on CPU a step of
this CNN frees and reallocates 11 MB gradients, and whether glibc hands them back to the kernel
(page faults on the next step) swings a step by ±30% at random, which otherwise drowns the
difference being measured.

    python benchmarks/allreduce_strategies.py                   # full (about 5 min on 2 cores)
    python benchmarks/allreduce_strategies.py --stable-malloc   # same, allocator noise removed
    python benchmarks/allreduce_strategies.py --quick           # a smoke run
    python benchmarks/allreduce_strategies.py --straggler-watch # the straggler watch's cost
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
from common import (
    STABLE_MALLOC,
    batches,
    clean_env,
    free_port,
    hand_written_step,
    run_processes,
    seed_cnn,
)

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


def seed_loop_under_mwms(rank: int, world: int, port: int, batch: int) -> tuple[Any, Any]:
    """The strategy, and the seed's step function over the seed CNN built in its scope."""
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

    return strategy, step_fn


def worker_ours(rank: int, world: int, port: int, steps: int, warmup: int, batch: int) -> float:
    strategy, step_fn = seed_loop_under_mwms(rank, world, port, batch)
    data = batches(warmup + steps, batch // world, seed=rank)
    dataset = strategy.distribute_datasets_from_function(lambda ctx: data)
    comm = strategy.extended.communicator
    for i, inputs in enumerate(dataset):
        if i == warmup:
            comm.barrier(what="benchmark start")
            start = time.perf_counter()
        strategy.run(step_fn, args=(inputs,))
    comm.barrier(what="benchmark end")
    return steps * batch / (time.perf_counter() - start)


def worker_interleaved(rank: int, world: int, port: int, passes: int, k: int, batch: int) -> str:
    """Alternate single steps of MWMS and of DDP in this process (each side before the other
    on every other step); JSON of the seconds of each step, paired by position."""
    from torch.nn.parallel import DistributedDataParallel

    strategy, step_fn = seed_loop_under_mwms(rank, world, port, batch)
    # Outside the scope: stratagem leaves this model alone; DDP uses the default process group.
    torch.manual_seed(0)
    raw_step = hand_written_step(DistributedDataParallel(seed_cnn()))
    data = batches(k, batch // world, seed=rank)
    dataset = strategy.distribute_datasets_from_function(lambda ctx: data)

    def ddp_step(x: torch.Tensor, y: torch.Tensor) -> float:
        start = time.perf_counter()
        raw_step(x, y)
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"ddp": [], "ours": []}
    step = 0
    for p in range(passes + 1):  # pass 0 warms both up
        batches_in = iter(dataset)
        while True:
            ddp_first = step % 2 == 1
            ddp_s = ddp_step(*data[step % k]) if ddp_first else None
            start = time.perf_counter()  # ours: fetching the batch, run, the step
            inputs = next(batches_in, None)
            if inputs is None:
                break
            strategy.run(step_fn, args=(inputs,))
            ours_s = time.perf_counter() - start
            if not ddp_first:
                ddp_s = ddp_step(*data[step % k])
            if p:
                times["ours"].append(ours_s)
                times["ddp"].append(ddp_s)
            step += 1
    return json.dumps(times)


def raw_threads_rate(threads: int, steps: int, warmup: int, per_thread: int) -> float:
    """Raw PyTorch, ``threads`` Python threads each training its own model copy: no sync."""
    import threading

    intra = max(1, torch.get_num_threads() // threads)
    models = []
    for _ in range(threads):
        torch.manual_seed(0)
        model = seed_cnn()
        models.append((model, torch.optim.RMSprop(model.parameters(), lr=1e-3)))
    data = batches(warmup + steps, per_thread, seed=0)
    start_line = threading.Barrier(threads + 1)
    finish_line = threading.Barrier(threads + 1)

    def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        torch.set_num_threads(intra)
        for i, (x, y) in enumerate(data):
            if i == warmup:
                start_line.wait()
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        finish_line.wait()

    workers = [threading.Thread(target=train, args=pair) for pair in models]
    for w in workers:
        w.start()
    start_line.wait()
    start = time.perf_counter()
    finish_line.wait()
    seconds = time.perf_counter() - start
    for w in workers:
        w.join()
    return steps * per_thread * threads / seconds


def run_job(kind: str, steps: int, warmup: int, batch: int, extra: dict[str, str]) -> str:
    """One 2-process job (one intra-op thread each); returns rank 0's last output line."""
    port, numbers = free_port(), [str(steps), str(warmup), str(batch)]
    argvs = [
        [sys.executable, __file__, "--worker", kind, str(rank), str(port), *numbers]
        for rank in range(2)
    ]
    return run_processes(argvs, clean_env({"OMP_NUM_THREADS": "1", **extra}))[0]


def run_mirrored(
    replicas: int, steps: int, warmup: int, extra: dict[str, str], mode: str = "--mirrored"
) -> float:
    """One process over ``replicas`` logical CPU devices (or raw threads); samples/s."""
    argv = [sys.executable, __file__, mode, str(replicas), str(steps), str(warmup)]
    return float(run_processes([argv], clean_env(extra))[0])


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


def interleaved_ratio(passes: int, pass_steps: int, extra: dict[str, str]) -> float:
    """One interleaved job: the median over pairs of steps of DDP's step time over ours."""
    times = json.loads(run_job("interleaved", passes, pass_steps, 128, extra))
    return statistics.median(d / o for d, o in zip(times["ddp"], times["ours"]))


def watch_overhead(jobs: int, passes: int, pass_steps: int, extra: dict[str, str]) -> None:
    """MWMS/DDP with the straggler watch off and on, job after job alternating (which goes first
    alternates too): the watch's cost is how much the ratio drops."""
    ratios: dict[str, list[float]] = {"off": [], "on": []}
    for j in range(jobs):
        for state in ("off", "on") if j % 2 == 0 else ("on", "off"):
            env = {**extra, "STRATAGEM_STRAGGLERS": "0" if state == "off" else "1"}
            ratios[state].append(interleaved_ratio(passes, pass_steps, env))
        print(
            f"job pair {j + 1}/{jobs}: MWMS/DDP watch off {ratios['off'][-1]:.3f}, "
            f"on {ratios['on'][-1]:.3f}",
            flush=True,
        )
    off, on = statistics.median(ratios["off"]), statistics.median(ratios["on"])
    print(f"MWMS/DDP (median of jobs): watch off {off:.3f}, on {on:.3f}; cost {1 - on / off:+.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps and rounds (a smoke run)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--jobs", type=int, default=3, help="interleaved jobs (6 passes each)")
    parser.add_argument(
        "--stable-malloc", action="store_true", help="pin glibc's mmap/trim thresholds (see above)"
    )
    parser.add_argument(
        "--straggler-watch",
        action="store_true",
        help="only the interleaved MWMS/DDP jobs, each run with the straggler watch off "
        "(STRATAGEM_STRAGGLERS=0) and on, alternating: the watch's cost",
    )
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    parser.add_argument("--mirrored", nargs=3, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--raw-threads", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, rank, port, *numbers = args.worker
        fn = {"ddp": worker_ddp, "ours": worker_ours, "interleaved": worker_interleaved}[kind]
        print(fn(int(rank), 2, int(port), *map(int, numbers)), flush=True)
        return
    if args.mirrored or args.raw_threads:
        replicas, steps, warmup = args.mirrored or args.raw_threads
        if args.mirrored:
            rate = mirrored_rate([f"cpu:{i}" for i in range(replicas)], steps, warmup, 256)
        else:
            rate = raw_threads_rate(replicas, steps, warmup, 256)
        print(rate, flush=True)
        return
    rounds, steps, warmup = (1, 4, 2) if args.quick else (args.rounds, args.steps, 10)
    jobs, passes, pass_steps = (1, 1, 4) if args.quick else (args.jobs, 6, 20)
    extra = STABLE_MALLOC if args.stable_malloc else {}

    def alternate(label: str, a: str, b: str, measure_a, measure_b) -> tuple[list, list]:
        first, second = [], []
        for r in range(rounds):
            first.append(measure_a())
            second.append(measure_b())
            print(
                f"{label} round {r + 1}/{rounds}: {a} {first[-1]:8.1f}  {b} {second[-1]:8.1f}"
                " samples/s",
                flush=True,
            )
        return first, second

    if args.straggler_watch:
        watch_overhead(jobs, passes, pass_steps, extra)
        return
    ddp, ours = alternate(
        "separate jobs",
        "DDP",
        "MWMS",
        lambda: float(run_job("ddp", steps, warmup, 128, extra)),
        lambda: float(run_job("ours", steps, warmup, 128, extra)),
    )
    ddp_steps: list[float] = []
    ours_steps: list[float] = []
    job_ratios: list[float] = []
    for j in range(jobs):
        times = json.loads(run_job("interleaved", passes, pass_steps, 128, extra))
        ddp_steps += [128 / t for t in times["ddp"]]
        ours_steps += [128 / t for t in times["ours"]]
        # The median over pairs of steps run back to back: a burst that slows both cancels.
        job_ratios.append(statistics.median(d / o for d, o in zip(times["ddp"], times["ours"])))
        print(f"interleaved job {j + 1}/{jobs}: MWMS/DDP {job_ratios[-1]:.3f}", flush=True)
    m_steps = max(2, steps // 3)
    one, two = alternate(
        "Mirrored",
        "1 replica",
        "2 replicas",
        lambda: run_mirrored(1, m_steps, warmup // 2, extra),
        lambda: run_mirrored(2, m_steps, warmup // 2, extra),
    )
    raw_one, raw_two = alternate(
        "raw threads",
        "1 thread",
        "2 threads",
        lambda: run_mirrored(1, m_steps, warmup // 2, extra, "--raw-threads"),
        lambda: run_mirrored(2, m_steps, warmup // 2, extra, "--raw-threads"),
    )

    def ratio(a: list[float], b: list[float]) -> float:
        return statistics.median(b) / statistics.median(a)

    rows = [
        ("DDP, 2 workers, global batch 128, separate jobs", ddp, 1.0),
        ("MultiWorkerMirroredStrategy, same, separate jobs", ours, ratio(ddp, ours)),
        ("DDP, interleaved step by step", ddp_steps, 1.0),
        (
            "MultiWorkerMirroredStrategy, interleaved step by step (median of jobs' paired ratios)",
            ours_steps,
            statistics.median(job_ratios),
        ),
        ("MirroredStrategy, 1 CPU replica, batch 256", one, 1.0),
        ("MirroredStrategy, 2 CPU replicas, 256 each", two, ratio(one, two)),
        ("ceiling: raw PyTorch, 1 thread, batch 256", raw_one, 1.0),
        ("ceiling: raw PyTorch, 2 threads, 256 each, no sync", raw_two, ratio(raw_one, raw_two)),
    ]
    results = {
        "rows": [
            {"measurement": name, "samples_per_s": rates, "ratio_of_medians": r}
            for name, rates, r in rows
        ],
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "stable_malloc": args.stable_malloc,
    }
    print("\n| measurement | median samples/s | ratio |\n| --- | --- | --- |")
    for name, rates, r in rows:
        print(f"| {name} | {statistics.median(rates):.0f} | {r:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
