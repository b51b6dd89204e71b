"""The cost of Model.fit against hand-written PyTorch, measured side by side in one run.

1. One device: per-step time of ``Model.fit`` vs a hand-written step (zero_grad, forward,
   cross-entropy, backward, step) on the very same CNN, optimizer and batches. The two
   alternate step by step: a callback runs one hand-written step beside each step of ``fit``, so
   both sides meet the same machine state at the same moment (this machine's load moves step
   times by tens of percent within seconds). A fit step is the interval between the starts of
   consecutive fit steps less the hand-written step inside it: it includes fetching its batch,
   ``strategy.run`` and the callbacks. Overhead = the median over steps of (fit step / the
   hand-written step beside it) - 1, per run; the median of the runs. ``--control`` makes the
   fit side the same hand-written step: what two identical sides differ by here.
2. Two workers: ``Model.fit`` under MultiWorkerMirroredStrategy vs raw DistributedDataParallel
   (on the process group the strategy started), global batch 128, interleaved the same way
   inside the same two processes. Ratio = the median over steps of (DDP step / the fit step
   beside it), i.e. fit's samples/s over DDP's.

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
    hand_written_step,
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


def _interleaved(sg, hand_step, pairs):
    """A callback that runs one hand-written step beside each step of ``fit``, and the clocks:
    ``starts`` of fit's steps, ``hand`` seconds of each hand-written step. A fit step is then
    the interval between the starts of consecutive steps less the hand-written step inside it.
    Step by step, both sides share whatever else the machine is doing at that moment."""

    class Interleave(sg.keras.callbacks.Callback):
        needs_batch_logs = False  # a clock, it reads no logs

        def __init__(self) -> None:
            super().__init__()
            self.starts: list[float] = []
            self.hand: list[float] = []

        # The hand-written step runs after fit's odd steps and before its even ones, so each
        # side follows itself as often as the other: the step that follows another one runs
        # measurably slower here (about 2% in the control), whichever it is.
        def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
            self.starts.append(time.perf_counter())
            if len(self.starts) % 2 == 0:
                self._hand_step()

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            if len(self.starts) % 2 == 1:
                self._hand_step()

        def _hand_step(self) -> None:
            start = time.perf_counter()
            hand_step(*pairs[len(self.hand) % len(pairs)])
            self.hand.append(time.perf_counter() - start)

        def step_times(self) -> dict[str, list[float]]:
            spans = [b - a for a, b in itertools.pairwise(self.starts)]
            return {"fit": [s - h for s, h in zip(spans, self.hand)], "hand": self.hand[:-1]}

    return Interleave()


def one_device(passes: int, steps: int, batch: int, control: bool = False) -> dict:
    """Seconds of every step of fit and of the hand-written loop, interleaved step by step on
    the very same module and optimizer (two copies of a model differ in where their tensors
    landed in memory, which alone moves one copy's step time against the other's). ``control``:
    the fit side is the same hand-written step, to see what two identical sides differ by."""
    import stratagem as sg

    torch.manual_seed(0)
    model = _model(sg)
    pairs = batches(steps, batch, seed=0)
    x, y = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
    hand_step = hand_written_step(model.module, model.optimizer.torch_optimizer)
    clock = _interleaved(sg, hand_step, pairs)
    if control:
        for _ in range(passes + 1):
            for i, pair in enumerate(pairs):
                clock.on_train_batch_begin(i)
                hand_step(*pair)
                clock.on_train_batch_end(i)
    else:
        model.fit(x, y, batch_size=batch, epochs=passes + 1, shuffle=False, verbose=0,
                  callbacks=[clock])  # fmt: skip
    times = clock.step_times()
    return {name: values[steps:] for name, values in times.items()}  # the first pass warms up


def two_workers(rank: int, port: int, passes: int, steps: int, batch: int) -> dict:
    """Seconds per step of fit under MWMS and of raw DDP, interleaved step by step in this
    worker process (DDP uses the process group the strategy started)."""
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
    raw = DistributedDataParallel(seed_cnn())
    pairs = batches(steps, batch, seed=0)  # global batches, the same on both workers
    x, y = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
    part = slice(rank * batch // 2, (rank + 1) * batch // 2)  # this worker's half of each batch
    mine = [(px[part], py[part]) for px, py in pairs]
    clock = _interleaved(sg, hand_written_step(raw), mine)
    model.fit(x, y, batch_size=batch, epochs=passes + 1, shuffle=False, verbose=0,
              callbacks=[clock])  # fmt: skip
    times = clock.step_times()
    return {"fit": times["fit"][steps:], "ddp": times["hand"][steps:]}


def paired_ratio(a: list[float], b: list[float]) -> float:
    """The median of the step-by-step ratios a[i] / b[i]: each pair ran back to back, so a
    burst of load that slows both cancels out, where a ratio of two medians keeps it."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def _run(argv: list[str], extra: dict[str, str], n: int = 1) -> list[str]:
    argvs = [[sys.executable, __file__, *argv, str(rank)] for rank in range(n)]
    return run_processes(argvs, clean_env(extra))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few passes and steps (smoke run)")
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
        passes, steps, batch, control, _ = args.one_device
        print(json.dumps(one_device(passes, steps, batch, bool(control))), flush=True)
        return
    if args.two_workers:
        port, passes, steps, batch, rank = args.two_workers
        print(json.dumps(two_workers(rank, port, passes, steps, batch)), flush=True)
        return
    runs, passes, steps = (1, 1, 4) if args.quick else (args.runs, 6, 20)
    extra = {"OMP_NUM_THREADS": "1", **(STABLE_MALLOC if args.stable_malloc else {})}

    overheads, fit_steps, hand_steps = [], [], []
    for r in range(runs):
        (line,) = _run(
            ["--one-device", str(passes), str(steps), "64", str(int(args.control))], extra
        )
        got = json.loads(line)
        fit_steps += got["fit"]
        hand_steps += got["hand"]
        overheads.append(paired_ratio(got["fit"], got["hand"]) - 1)
        what = "hand-written copy vs hand-written" if args.control else "fit overhead"
        print(f"one device, run {r + 1}/{runs}: {what} {overheads[-1]:+.2%}", flush=True)
    if args.control:
        print(f"control, median of {runs} runs: {statistics.median(overheads):+.2%}")
        return
    ratios, fit_times, ddp_times = [], [], []
    for r in range(runs):
        lines = _run(
            ["--two-workers", str(free_port()), str(passes), str(steps), "128"], extra, n=2
        )
        got = json.loads(lines[0])
        fit_times += got["fit"]
        ddp_times += got["ddp"]
        ratios.append(paired_ratio(got["ddp"], got["fit"]))
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
            "fit": 128 / statistics.median(fit_times),
            "ddp": 128 / statistics.median(ddp_times),
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
