"""Prefetch: a step of fixed compute fed by a slow ``map``, with and without overlap.

The input is a ``map`` that takes ``--input-ms`` per batch (20 ms by default: a sleep, standing
for reading and decoding files, which leaves the CPU, plus a small augmentation in torch); the
step is a small CNN's forward, backward and SGD update on one intra-op thread. Measured side
by side in one process, in rounds whose order rotates, so that every variant meets the same
machine state:

- ``input`` alone: iterating the dataset, no step;
- ``compute`` alone: the step on batches already in memory;
- ``plain``: the dataset as written (``map`` then the step, in one thread): expected about
  ``input + compute`` per step;
- ``prefetch``: ``.prefetch(AUTOTUNE)``: expected about ``max(input, compute)``;
- ``parallel``: ``map(num_parallel_calls=AUTOTUNE)`` and ``.prefetch(AUTOTUNE)``: the input
  side splits over the pool, so the step alone bounds it when the calls can overlap.

Reported per variant: the median over rounds of steps/s, and the ratios the issue asks for:
``prefetch`` against ``1 / max(input, compute)`` (1.0 = perfect overlap) and ``plain`` against
``1 / (input + compute)``. With ``--device cuda`` (when one is present) the step runs on the GPU
and the last stage is ``prefetch_to_device``.

    python benchmarks/prefetch.py              # about 1 min on 2 cores
    python benchmarks/prefetch.py --quick      # a smoke run
    python benchmarks/prefetch.py --device cuda
    python benchmarks/prefetch.py --wait-step-ms 30   # the step as an accelerator's: a wait
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

import stratagem as sg

AUTOTUNE = sg.data.AUTOTUNE


def make_model(device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 28 * 28, 10),
    ).to(device)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def dataset(
    batches: int, batch: int, input_s: float, parallel: bool, prefetch: str, device: torch.device
) -> sg.data.Dataset:
    x = torch.randn(batches * batch, 1, 28, 28)
    y = torch.randint(0, 10, (batches * batch,))

    def decode(images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(input_s)  # reading and decoding: the CPU is free meanwhile
        return images.flip(-1) * 0.5, labels

    ds = sg.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    ds = ds.map(decode, num_parallel_calls=AUTOTUNE if parallel else None)
    if prefetch == "host":
        ds = ds.prefetch(AUTOTUNE)
    elif prefetch == "device":
        ds = ds.apply(sg.data.experimental.prefetch_to_device(device))
    return ds


def timed_steps(
    items: Iterable[tuple[torch.Tensor, torch.Tensor]],
    step: Callable[[torch.Tensor, torch.Tensor], None] | None,
    device: torch.device,
    warmup: int,
) -> float:
    """Steps per second over ``items`` after ``warmup`` of them."""
    count, start = 0, 0.0
    for i, (images, labels) in enumerate(items):
        if step is not None:
            step(images.to(device, non_blocking=True), labels.to(device, non_blocking=True))
        if i == warmup - 1:  # the clock covers fetching and stepping the items after warm-up
            _sync(device)
            start = time.perf_counter()
        count += i >= warmup
    _sync(device)
    return count / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input-ms", type=float, default=20.0)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batches", type=int, default=40, help="per measurement")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--wait-step-ms",
        type=float,
        default=None,
        help="a step that waits this long instead of computing on the CPU: an accelerator's "
        "step as the host sees it (the CPU free meanwhile); separates the overlap itself from "
        "two CPU-bound stages competing for a busy machine's cores",
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if args.quick:
        args.batches, args.rounds, args.batch = 6, 1, 16
    torch.set_num_threads(1)
    device = torch.device(args.device)
    warmup = 2
    model, optimizer = make_model(device)
    loss_fn = nn.CrossEntropyLoss()

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        if args.wait_step_ms is not None:
            time.sleep(args.wait_step_ms / 1e3)
            return
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(images), labels).backward()
        optimizer.step()

    in_memory = list(dataset(args.batches, args.batch, 0.0, False, "none", device))
    last = "device" if device.type == "cuda" else "host"
    variants: dict[str, Callable[[], float]] = {
        "input": lambda: timed_steps(
            dataset(args.batches, args.batch, args.input_ms / 1e3, False, "none", device),
            None,
            device,
            warmup,
        ),
        "compute": lambda: timed_steps(in_memory, step, device, warmup),
        "plain": lambda: timed_steps(
            dataset(args.batches, args.batch, args.input_ms / 1e3, False, "none", device),
            step,
            device,
            warmup,
        ),
        "prefetch": lambda: timed_steps(
            dataset(args.batches, args.batch, args.input_ms / 1e3, False, last, device),
            step,
            device,
            warmup,
        ),
        "parallel": lambda: timed_steps(
            dataset(args.batches, args.batch, args.input_ms / 1e3, True, last, device),
            step,
            device,
            warmup,
        ),
    }
    names = list(variants)
    usable = len(os.sched_getaffinity(0))  # the calls AUTOTUNE runs at once
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]  # rotate who goes first
        for name in order:
            samples[name].append(variants[name]())
        print(
            f"round {r + 1}/{args.rounds}: "
            + ", ".join(f"{n} {samples[n][-1]:.1f}" for n in names)
            + " steps/s",
            flush=True,
        )
    med = {name: statistics.median(v) for name, v in samples.items()}

    def per_round(fn: Callable[[dict[str, float]], float]) -> float:
        # Each ratio within one round (the same machine state), then the median over rounds.
        rounds = [{n: samples[n][r] for n in names} for r in range(args.rounds)]
        return round(statistics.median(fn(x) for x in rounds), 3)

    result = {
        "device": str(device),
        "step": "CNN" if args.wait_step_ms is None else f"wait {args.wait_step_ms} ms",
        "input_ms_per_batch": round(1e3 / med["input"], 2),
        "compute_ms_per_step": round(1e3 / med["compute"], 2),
        "steps_per_s": {name: round(v, 2) for name, v in med.items()},
        # 1.0: the step runs as fast as the slower of input and compute (perfect overlap).
        "prefetch_vs_max(input,compute)": per_round(
            lambda x: x["prefetch"] / min(x["input"], x["compute"])
        ),
        "parallel_vs_max(input/calls,compute)": per_round(
            lambda x: x["parallel"] / min(x["input"] * usable, x["compute"])
        ),
        # 1.0: the step takes input + compute (no overlap at all).
        "plain_vs_sum(input+compute)": per_round(
            lambda x: x["plain"] * (1 / x["input"] + 1 / x["compute"])
        ),
        "prefetch_speedup_over_plain": per_round(lambda x: x["prefetch"] / x["plain"]),
        "rounds": args.rounds,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
