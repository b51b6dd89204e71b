"""Parameter-server modes against a straggler: 3 workers + 1 ps, worker 2 three times slower.

Each job trains an MLP on digits (8x8) for a fixed wall time. A worker's own work in a step is
its real forward/backward plus an injected sleep standing for more compute (``--delay``);
worker 2's own work takes three times as long (it sleeps 3 x delay + 2 x its forward/backward
time: sleeping, so the straggler does not take CPU from the others on this shared machine).
Waiting on the ps (push and pull) comes on top, as it would on real machines. The chief
evaluates its copy of the parameters every 10 of its steps and notes when test accuracy first
reaches 0.90. Modes:

- sync: each update is the mean of all 3 workers' gradients (every step waits for worker 2);
- backup: sync with 1 backup worker (2 + 1): each update takes the first 2 gradients;
- async: every gradient is applied as it arrives;
- bounded: async with ``max_staleness=2``: no worker runs more than 2 steps ahead.

Reported per mode (medians over ``--runs`` jobs): steps/s (updates the ps applied: TF's
global_step rate, the iteration rate Chen et al. 2016 compare), applied examples/s (the
examples of the gradients that made it into an update: a dropped gradient counts for nothing;
a sync step counts 3 workers' batches, an async step one), time to 0.90 test accuracy, and
the final accuracy. The targets (async >= 1.8x and backup >= 1.5x the steps/s of sync, every
mode reaching 0.90) are printed as met or not.

    python benchmarks/stragglers.py                # about 3 minutes on 2 cores
    python benchmarks/stragglers.py --quick        # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import run_launcher_job

MODES = {
    "sync": ["--mode", "sync"],
    "backup": ["--mode", "sync", "--backup-workers", "1"],
    "async": ["--mode", "async"],
    "bounded": ["--mode", "async", "--max-staleness", "2"],
}
BATCH = 32
TARGET = 0.90


def worker(args: argparse.Namespace) -> None:
    """One task of a job (run by the launcher on every worker and the ps)."""
    import numpy as np
    import torch

    import stratagem as sg

    strategy = sg.distribute.ParameterServerStrategy(
        mode=args.mode, backup_workers=args.backup_workers, max_staleness=args.max_staleness
    )
    task = strategy.cluster_resolver.task_id
    torch.manual_seed(task)
    with strategy.scope():
        model = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    (x, y), (x_test, y_test) = sg.data.datasets.load_digits(image_size=8)
    x = torch.from_numpy(x / np.float32(255))
    y = torch.from_numpy(y)
    x_test, y_test = torch.from_numpy(x_test / np.float32(255)), torch.from_numpy(y_test)
    generator = torch.Generator().manual_seed(task)

    def accuracy() -> float:
        with torch.no_grad():
            return float((model(x_test).argmax(1) == y_test).float().mean())

    def step() -> None:
        begin = time.perf_counter()
        rows = torch.randint(0, len(x), (BATCH,), generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        compute = time.perf_counter() - begin
        # A worker's own work is its real compute plus the injected delay; the straggler's
        # takes 3 times as long as that.
        time.sleep(args.delay if task != 2 else 3 * args.delay + 2 * compute)
        optimizer.step()  # push and pull: waiting on the ps is not the worker's own work

    step()  # the first push also connects to the ps and builds its optimizer: not timed
    start = time.perf_counter()
    steps, reached = 0, None
    while time.perf_counter() - start < args.seconds:
        step()
        steps += 1
        chief_checks = strategy.extended.should_checkpoint and reached is None
        if chief_checks and steps % 10 == 0 and accuracy() >= TARGET:
            reached = time.perf_counter() - start
    seconds = time.perf_counter() - start
    if strategy.extended.should_checkpoint:
        strategy.pull()
        (stats,) = strategy.ps_stats()
        result = {
            "seconds": seconds,
            "updates": stats["steps"],
            "applied": stats["applied"],
            "dropped": stats["dropped"],
            "time_to_target": reached,
            "accuracy": accuracy(),
        }
        print("RESULT " + json.dumps(result), flush=True)


def run_job(mode: str, seconds: float, delay: float) -> dict:
    task = ["--task", *MODES[mode], "--seconds", str(seconds), "--delay", str(delay)]
    return run_launcher_job(["-n", "3", "--ps", "1", __file__, *task], timeout=seconds + 180)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="sync", help=argparse.SUPPRESS)
    parser.add_argument("--backup-workers", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--max-staleness", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=15.0, help="training time per job")
    parser.add_argument("--delay", type=float, default=0.03, help="injected step time, seconds")
    parser.add_argument("--runs", type=int, default=3, help="jobs per mode")
    parser.add_argument("--quick", action="store_true", help="1 short job per mode")
    parser.add_argument("--modes", default=",".join(MODES), help="which modes, comma-separated")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.task:
        worker(args)
        return
    runs, seconds = (1, 4.0) if args.quick else (args.runs, args.seconds)
    results: dict[str, dict] = {}
    for mode in args.modes.split(","):
        if mode not in MODES:
            parser.error(f"unknown mode {mode!r}; expected some of {', '.join(MODES)}")
        jobs = []
        for r in range(runs):
            job = run_job(mode, seconds, args.delay)
            job["steps_per_s"] = job["updates"] / job["seconds"]
            job["examples_per_s"] = job["applied"] * BATCH / job["seconds"]
            jobs.append(job)
            print(f"{mode} run {r + 1}/{runs}: {json.dumps(job)}", flush=True)
        reached = [j["time_to_target"] for j in jobs if j["time_to_target"] is not None]
        results[mode] = {
            "steps_per_s": statistics.median(j["steps_per_s"] for j in jobs),
            "examples_per_s": statistics.median(j["examples_per_s"] for j in jobs),
            "time_to_target_s": statistics.median(reached) if len(reached) == runs else None,
            "accuracy": statistics.median(j["accuracy"] for j in jobs),
            "dropped": statistics.median(j["dropped"] for j in jobs),
            "jobs": jobs,
        }
    base = results.get("sync")
    print("\n| mode | steps/s | vs sync | applied examples/s | vs sync | time to 0.90 | accuracy |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for mode, r in results.items():
        t = f"{r['time_to_target_s']:.1f} s" if r["time_to_target_s"] is not None else "not reached"
        steps_x = f"{r['steps_per_s'] / base['steps_per_s']:.2f}x" if base else "-"
        examples_x = f"{r['examples_per_s'] / base['examples_per_s']:.2f}x" if base else "-"
        print(
            f"| {mode} | {r['steps_per_s']:.1f} | {steps_x} | {r['examples_per_s']:.0f} | "
            f"{examples_x} | {t} | {r['accuracy']:.3f} |"
        )
    steps = results["sync"]["steps_per_s"] if "sync" in results else float("nan")
    targets = {
        f"{mode} steps/s >= {bound}x sync": results[mode]["steps_per_s"] / steps >= bound
        for mode, bound in (("async", 1.8), ("backup", 1.5))
        if mode in results
    }
    targets["every mode reaches 0.90"] = all(
        r["time_to_target_s"] is not None for r in results.values()
    )
    for what, met in targets.items():
        print(f"{what}: {'met' if met else 'NOT met'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "targets": targets}, indent=1))


if __name__ == "__main__":
    main()
