"""FullyShardedStrategy vs MultiWorkerMirroredStrategy vs raw ``fully_shard``: speed and memory.

Two processes (CPU, gloo) train the same MLP, whose Adam state dominates its memory, with Adam:

- memory: each variant alone, a thread samples the process's resident memory (``/proc``) every
  millisecond over a few steps; the figure is the peak above the resident memory before the
  model was built (large tensors are mmapped, so freed ones leave the resident set);
- speed: the three models side by side, timed in interleaved blocks of steps (so that a busy
  machine slows them alike); samples/s is the median over the blocks.

Reported per process (the larger over the two), as ratios: ours / raw ``fully_shard`` (speed;
the target is >= 0.97) and ours / MWMS (peak memory; the target is <= 0.6).

    python benchmarks/sharded.py                 # starts its 2 processes itself
    python benchmarks/sharded.py --width 512 --blocks 3 --json out.json   # smaller, quicker
    python benchmarks/sharded.py --quick         # a smoke run: the figures mean nothing
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch


def build_model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def mmap_threshold(size: int) -> None:
    """glibc's mmap threshold, fixed (no longer adaptive): tensors of at least ``size`` bytes
    are mapped on their own and unmapped when freed. The memory phase sets it low, so that
    freed memory leaves the resident set and the sampled peaks do not depend on the order; the
    speed phase sets it high, for glibc's fast heap."""
    import ctypes
    import ctypes.util

    m_mmap_threshold = -3
    ctypes.CDLL(ctypes.util.find_library("c")).mallopt(m_mmap_threshold, size)


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakSampler:
    """The peak resident memory above the level at entry, sampled on a thread."""

    def __init__(self) -> None:
        self.base = resident_bytes()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, resident_bytes())

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, resident_bytes())

    @property
    def above_base(self) -> int:
        return self.peak - self.base


def batch(args: argparse.Namespace, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    per_replica = args.batch // 2
    return torch.randn(per_replica, args.width, generator=g), torch.randint(
        0, 10, (per_replica,), generator=g
    )


def make_variant(name: str, args: argparse.Namespace) -> Callable[[int], None]:
    """A step function (its argument: the step number) of a freshly built model."""
    import torch.nn.functional as F

    import stratagem as sg

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if name == "raw fully_shard":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = build_model(args.width, args.depth)
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for child in model:
            if any(True for _ in child.parameters()):
                fully_shard(child, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

        def raw_step(step: int) -> None:
            x, y = batch(args, rank, step)
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()

        return raw_step
    if name == "FullyShardedStrategy":
        strategy = sg.distribute.experimental.FullyShardedStrategy()
    else:
        strategy = sg.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = build_model(args.width, args.depth)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

    def replica_step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        loss = sg.nn.compute_average_loss(
            F.cross_entropy(model(x), y, reduction="none"), global_batch_size=args.batch
        )
        loss.backward()
        optimizer.step()

    def strategy_step(step: int) -> None:
        strategy.run(replica_step, args=batch(args, rank, step))

    return strategy_step


VARIANTS = ("FullyShardedStrategy", "MultiWorkerMirroredStrategy", "raw fully_shard")


def worker(args: argparse.Namespace) -> None:
    import stratagem as sg

    # Joins the job (the others share it); its communicator's collectives hold their Works.
    comm = sg.distribute.MultiWorkerMirroredStrategy().extended.communicator
    rank = comm.rank
    result: dict = {"rank": rank, "peak_bytes": {}, "samples_per_s": {}}
    for name in VARIANTS:  # one-time costs (first use of each code path) out of the figures
        make_variant(name, args)(0)
    mmap_threshold(64 << 10)
    for name in VARIANTS:  # memory: one variant alive at a time
        comm.barrier(what="the memory of " + name)
        with PeakSampler() as sampler:
            step = make_variant(name, args)
            built = resident_bytes() - sampler.base
            for s in range(3):
                step(s)
            del step
        result["peak_bytes"][name] = sampler.above_base
        result.setdefault("built_bytes", {})[name] = built
        print(
            f"[rank {rank}] {name}: {built / 2**20:.1f} MiB once built, peak "
            f"{sampler.above_base / 2**20:.1f} MiB",
            flush=True,
        )
    mmap_threshold(32 << 20)  # glibc's largest adaptive threshold
    steps = {name: make_variant(name, args) for name in VARIANTS}
    for step in steps.values():
        step(0)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for block in range(args.blocks):  # interleaved: a busy moment slows every variant alike
        for name, step in steps.items():
            comm.barrier(what="the speed of " + name)
            start = time.perf_counter()
            for s in range(args.steps):
                step(1 + block * args.steps + s)
            times[name].append(time.perf_counter() - start)
    for name, seconds in times.items():
        rates = [args.batch * args.steps / t for t in seconds]
        result["samples_per_s"][name] = statistics.median(rates)
    everyone = comm.all_gather_object(result, what="the figures")
    if rank == 0:
        report(everyone, args)


def report(everyone: list[dict], args: argparse.Namespace) -> None:
    peak = {n: max(r["peak_bytes"][n] for r in everyone) for n in VARIANTS}
    speed = {n: min(r["samples_per_s"][n] for r in everyone) for n in VARIANTS}
    params = sum(p.numel() for p in build_model(args.width, args.depth).parameters())
    print(f"\nMLP of {params / 1e6:.1f} M parameters, Adam, global batch {args.batch}, 2 processes")
    print("| variant | samples/s (median) | peak memory per process (MiB) |")
    print("| --- | --- | --- |")
    for n in VARIANTS:
        print(f"| {n} | {speed[n]:.1f} | {peak[n] / 2**20:.1f} |")
    ratios = {
        "speed: ours / raw fully_shard": speed[VARIANTS[0]] / speed[VARIANTS[2]],
        "peak memory: ours / MWMS": peak[VARIANTS[0]] / peak[VARIANTS[1]],
    }
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"processes": everyone, "ratios": ratios, "parameters": params}, indent=1)
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32, help="global batch")
    parser.add_argument("--steps", type=int, default=3, help="steps per timed block")
    parser.add_argument("--blocks", type=int, default=7, help="timed blocks per variant")
    parser.add_argument("--json", default="", help="write the figures here as JSON")
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run (the tests')")
    args = parser.parse_args()
    if args.quick:
        args.width, args.depth, args.steps, args.blocks = 64, 2, 1, 1
    if os.environ.get("TF_CONFIG") or os.environ.get("WORLD_SIZE"):
        worker(args)
        return
    # Started plainly: run this file as a 2-process job through stratagem's launcher.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import clean_env

    argv = [sys.executable, "-m", "stratagem.cli", "run", "-n", "2", __file__, *sys.argv[1:]]
    raise SystemExit(subprocess.run(argv, env=clean_env({}), timeout=900).returncode)


if __name__ == "__main__":
    main()
