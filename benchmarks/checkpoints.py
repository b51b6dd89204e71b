"""A checkpoint every 10 steps against none: synchronous, asynchronous, and torch's own.

One process trains an MLP (about 4M parameters, Adam: 48 MB of state) on an ``sg.data``
pipeline (shuffle, batch, prefetch) whose iterator the checkpoint tracks; every 10 steps it
saves model, optimizer and iterator. Measured side by side in one process, in rounds whose order
rotates:

- ``none``: no checkpoint;
- ``sync``: ``CheckpointManager.save()``: the step waits for the write;
- ``async``: ``CheckpointManager.save(options=CheckpointOptions(enable_async=True))``: the
  values are copied, the write runs in a background thread while training goes on;
- ``dcp_async``: ``torch.distributed.checkpoint.async_save`` of the model's and optimizer's
  state dicts (torch's asynchronous save, for comparison; the iterator's position is not in it).

Reported: the median over rounds of steps/s, and each variant's throughput against ``none``
in the same round (1.0 = free; the target for a checkpoint every 10 steps is at least 0.95).

    python benchmarks/checkpoints.py            # about 2 min on 2 cores
    python benchmarks/checkpoints.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from common import median_round_ratio, rotated_rounds
from torch import nn

import stratagem as sg

ASYNC = sg.train.CheckpointOptions(enable_async=True)


def run(variant: str, steps: int, every: int, width: int, directory: Path) -> float:
    """Steps per second of ``steps`` training steps with ``variant``'s checkpoints."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, 10))  # fmt: skip
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(steps * 64, 256), torch.randint(0, 10, (steps * 64,))
    data = sg.data.Dataset.from_tensor_slices((x, y)).shuffle(1024, seed=1).batch(64).prefetch(2)
    iterator = iter(data)
    shutil.rmtree(directory, ignore_errors=True)
    manager = sg.train.CheckpointManager(
        sg.train.Checkpoint(model=model, optimizer=optimizer, iterator=iterator),
        str(directory), max_to_keep=2,
    )  # fmt: skip
    pending = None
    start = time.perf_counter()
    for step, (features, labels) in enumerate(iterator, start=1):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(features), labels).backward()
        optimizer.step()
        if step % every:
            continue
        if variant == "sync":
            manager.save()
        elif variant == "async":
            manager.save(options=ASYNC)
        elif variant == "dcp_async":
            import torch.distributed.checkpoint as dcp

            if pending is not None:
                pending.result()  # one at a time, as ours
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            pending = dcp.async_save(state, checkpoint_id=str(directory / f"dcp-{step}"))
    # The last write is part of the work: a job's end waits for it.
    if variant == "async":
        manager.sync()
    if pending is not None:
        pending.result()
    return steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.width = 1, 20, 64
    torch.set_num_threads(1)
    variants = ["none", "sync", "async", "dcp_async"]
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's notes on a process without a process group
        samples = rotated_rounds(
            {v: (lambda v=v: run(v, args.steps, args.every, args.width, Path(tmp) / v))
             for v in variants},
            args.rounds, "steps/s",
        )  # fmt: skip
    ratios = {v: median_round_ratio(samples, v, "none") for v in variants}
    print("| variant | steps/s (median) | against none (median of rounds) |")
    print("| --- | --- | --- |")
    for v in variants:
        print(f"| {v} | {statistics.median(samples[v]):.1f} | {ratios[v]:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"samples": samples, "ratios": ratios}, indent=2))


if __name__ == "__main__":
    main()
