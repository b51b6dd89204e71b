"""The cost of Model.fit against hand-written PyTorch, measured side by side in one run.

1. One device: per-step time of ``Model.fit`` vs a hand-written loop (zero_grad, forward,
   cross-entropy, backward, step) with the same CNN, batches and RMSprop. Both models live in
   one process and train in alternating blocks (an epoch of ``fit``, then the same steps by
   hand), so both see the same machine state; every step is timed (start to next start).
   Overhead = median fit step / median hand step - 1, per run; the median of the runs.
2. Two workers: ``Model.fit`` under MultiWorkerMirroredStrategy vs raw DistributedDataParallel,
   global batch 128, interleaved the same way inside the same two processes (DDP uses the
   process group the strategy started). Ratio of median samples/s.

    python benchmarks/fit_overhead.py            # about 2 minutes on 2 cores
    python benchmarks/fit_overhead.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    STABLE_MALLOC,
    batches,
    clean_env,
    free_port,
    hand_written_loop,
    run_processes,
    seed_cnn,
)


def _model(sg):
    module = seed_cnn()
    model = sg.keras.Model(module)
    model.compile(
        sg.keras.optimizers.RMSprop(1e-3),
        sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def one_device(
    blocks: int, steps: int, batch: int, control: bool = False
) -> dict[str, list[float]]:
    """Seconds of every step of fit and of the hand-written loop: the intervals between the
    starts of consecutive steps (a fit step thus includes fetching its batch and its
    callbacks). Per-step medians shrug off the bursts another job on the machine causes, which
    whole-block times do not. ``control``: the "fit" side is the same hand-written loop on a
    second copy of the model, to see what two identical loops differ by here."""
    import stratagem as sg

    class StepClock(sg.keras.callbacks.Callback):
        needs_batch_logs = False  # a clock, it reads no logs

        def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
            starts.append(time.perf_counter())

    torch.manual_seed(0)
    model = _model(sg)
    # The hand-written loop trains the very same module with the very same optimizer: two
    # copies of the model differ in where their tensors landed in memory (huge pages or not,
    # cache sets), which alone moves one copy's step time against the other's (``--control``).
    pairs = batches(steps, batch, seed=0)
    x, y = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])

    def hand_loop(module: torch.nn.Module, optimizer: torch.optim.Optimizer):
        def run() -> None:  # common.hand_written_loop, with the same clock
            for xb, yb in pairs:
                starts.append(time.perf_counter())
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(module(xb), yb).backward()
                optimizer.step()

        return run

    hand = hand_loop(model.module, model.optimizer.torch_optimizer)
    clock = StepClock()

    def fit() -> None:
        model.fit(x, y, batch_size=batch, shuffle=False, verbose=0, callbacks=[clock])

    if control:
        copy = seed_cnn()
        fit = hand_loop(copy, torch.optim.RMSprop(copy.parameters(), lr=1e-3, alpha=0.9, eps=1e-7))
    per_step: dict[str, list[float]] = {"fit": [], "hand": []}
    for block in range(blocks + 1):  # block 0 warms both up
        sides = [("fit", fit), ("hand", hand)]
        for name, fn in sides if block % 2 else sides[::-1]:
            starts: list[float] = []
            fn()
            if block:
                per_step[name] += [b - a for a, b in itertools.pairwise(starts)]
    return per_step


def two_workers(rank: int, port: int, blocks: int, steps: int, batch: int) -> dict:
    """Samples/s of fit under MWMS and of raw DDP, per block, in this worker process."""
    from torch.nn.parallel import DistributedDataParallel

    import stratagem as sg

    os.environ["TF_CONFIG"] = json.dumps(
        {
            "cluster": {"worker": [f"localhost:{port}", f"localhost:{port + 1}"]},
            "task": {"type": "worker", "index": rank},
        }
    )
    strategy = sg.distribute.MultiWorkerMirroredStrategy()
    torch.manual_seed(0)
    with strategy.scope():
        model = _model(sg)
    torch.manual_seed(0)
    raw = hand_written_loop(DistributedDataParallel(seed_cnn()))
    pairs = batches(steps, batch, seed=0)  # global batches, the same on both workers
    x, y = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
    part = slice(rank * batch // 2, (rank + 1) * batch // 2)  # this worker's half of each batch
    mine = [(px[part], py[part]) for px, py in pairs]
    comm = strategy._comm
    rates: dict[str, list[float]] = {"fit": [], "ddp": []}
    for block in range(blocks + 1):
        sides = [
            ("fit", lambda: model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)),
            ("ddp", lambda: raw(mine)),
        ]
        for name, fn in sides if block % 2 else sides[::-1]:
            comm.barrier(what="block start")
            start = time.perf_counter()
            fn()
            comm.barrier(what="block end")
            if block:
                rates[name].append(steps * batch / (time.perf_counter() - start))
    return rates


def _run(argv: list[str], extra: dict[str, str], n: int = 1) -> list[str]:
    argvs = [[sys.executable, __file__, *argv, str(rank)] for rank in range(n)]
    return run_processes(argvs, clean_env(extra))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few blocks and steps (smoke run)")
    parser.add_argument("--runs", type=int, default=5, help="processes (jobs) per measurement")
    parser.add_argument("--stable-malloc", action="store_true", help="as allreduce_strategies")
    parser.add_argument(
        "--control",
        action="store_true",
        help="one device only, both sides hand-written on two copies of the model",
    )
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--one-device", nargs=5, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--two-workers", nargs=5, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_device:
        blocks, steps, batch, control, _ = args.one_device
        print(json.dumps(one_device(blocks, steps, batch, bool(control))), flush=True)
        return
    if args.two_workers:
        port, blocks, steps, batch, rank = args.two_workers
        print(json.dumps(two_workers(rank, port, blocks, steps, batch)), flush=True)
        return
    runs, blocks, steps = (1, 2, 3) if args.quick else (args.runs, 6, 20)
    extra = {"OMP_NUM_THREADS": "1", **(STABLE_MALLOC if args.stable_malloc else {})}

    overheads, fit_steps, hand_steps = [], [], []
    for r in range(runs):
        (line,) = _run(
            ["--one-device", str(blocks), str(steps), "64", str(int(args.control))], extra
        )
        got = json.loads(line)
        fit_steps += got["fit"]
        hand_steps += got["hand"]
        overheads.append(statistics.median(got["fit"]) / statistics.median(got["hand"]) - 1)
        what = "hand-written copy vs hand-written" if args.control else "fit overhead"
        print(f"one device, run {r + 1}/{runs}: {what} {overheads[-1]:+.2%}", flush=True)
    if args.control:
        print(f"control, median of {runs} runs: {statistics.median(overheads):+.2%}")
        return
    ratios, fit_rates, ddp_rates = [], [], []
    for r in range(runs):
        lines = _run(
            ["--two-workers", str(free_port()), str(blocks), str(steps), "128"], extra, n=2
        )
        got = json.loads(lines[0])
        fit_rates += got["fit"]
        ddp_rates += got["ddp"]
        ratios.append(statistics.median(got["fit"]) / statistics.median(got["ddp"]))
        print(f"two workers, run {r + 1}/{runs}: fit/DDP {ratios[-1]:.3f}", flush=True)

    results = {
        "one_device_fit_overhead_median_of_runs": statistics.median(overheads),
        "one_device_overheads": overheads,
        "one_device_ms_per_step": {
            "fit": statistics.median(fit_steps) * 1e3,
            "hand": statistics.median(hand_steps) * 1e3,
        },
        "two_workers_fit_over_ddp_median_of_runs": statistics.median(ratios),
        "two_workers_ratios": ratios,
        "two_workers_samples_per_s": {
            "fit": statistics.median(fit_rates),
            "ddp": statistics.median(ddp_rates),
        },
        "stable_malloc": args.stable_malloc,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
    }
    print("\n| measurement | median | target |\n| --- | --- | --- |")
    print(
        f"| fit overhead vs a hand-written loop, one device (ms/step "
        f"{results['one_device_ms_per_step']['fit']:.1f} vs "
        f"{results['one_device_ms_per_step']['hand']:.1f}) | "
        f"{results['one_device_fit_overhead_median_of_runs']:+.2%} | ≤ 3% |"
    )
    print(
        f"| fit under MWMS / raw DDP, 2 workers | "
        f"{results['two_workers_fit_over_ddp_median_of_runs']:.3f} | ≥ 0.95 |"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
