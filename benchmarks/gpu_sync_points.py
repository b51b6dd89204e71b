"""Where a training step makes the host wait for the GPU, and how often.

A step that reads a device value on the host (``.item()``, ``int(t)``, ``torch.equal``, a
``nonzero``) stops the host from queueing the next kernels until the GPU has caught up: the
GPU then idles while Python launches the rest of the step. On a GPT-2-sized step that is a few
percent of the step time per wait. This script runs each way of training a small GPT-style
decoder (``gpu_training.py``'s, tiny) for ``--steps`` and for ``2 × --steps`` steps under
``torch.cuda.set_sync_debug_mode("warn")`` and prints every synchronizing call with the Python
stack that made it, counted; the difference between the two runs is what each step costs
(once-per-call waits, such as ``fit``'s end-of-epoch logs, cancel out).

    python benchmarks/gpu_sync_points.py            # prints the stacks
    python benchmarks/gpu_sync_points.py --check    # exits 1 if any step waits (a test runs it)

Ways: ``fit`` (``Model.fit`` under ``OneDeviceStrategy``, ``verbose=0``), ``mwms`` (a custom
loop under ``MultiWorkerMirroredStrategy``, a world of one) and ``one_device`` (the same loop
under ``OneDeviceStrategy``).
"""

from __future__ import annotations

import argparse
import collections
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_training import GPT, TINY

Stacks = collections.Counter


def synchronizing_calls(fn: Callable[[], None]) -> Stacks:
    """Every call in ``fn`` that made the host wait for the device, by the Python stack that
    made it (this file's frames left out), counted."""
    seen: Stacks = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchronizing" not in str(message).lower():
            return
        frames = [f for f in traceback.extract_stack()[:-1] if f.filename != __file__]
        where = "".join(traceback.format_list(frames[-8:]))
        seen[f"{str(message).splitlines()[0]}\n{where}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return seen


def ways(device: torch.device) -> dict[str, Callable[[int], None]]:
    import stratagem as sg

    cfg = TINY

    def build() -> GPT:
        torch.manual_seed(0)
        return GPT(cfg, device.type)

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(cfg.vocab, (64 * cfg.batch, cfg.seq + 1), generator=g).to(device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    one = sg.distribute.OneDeviceStrategy(str(device))
    with one.scope():
        model = sg.keras.Model(build())
        model.compile(
            torch.optim.AdamW(model.module.parameters(), lr=1e-4, fused=True),
            sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )

    def fit(steps: int) -> None:
        n = steps * cfg.batch
        model.fit(x[:n], y[:n], batch_size=cfg.batch, epochs=1, shuffle=False, verbose=0)

    def custom_loop(strategy: sg.distribute.Strategy) -> Callable[[int], None]:
        with strategy.scope():
            net = build()
            opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)

        def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(xb).view(-1, cfg.vocab), yb.view(-1)).backward()
            opt.step()

        def run(steps: int) -> None:
            for i in range(steps):
                rows = slice(i * cfg.batch, (i + 1) * cfg.batch)
                strategy.run(step, args=(x[rows], y[rows]))

        return run

    return {
        "fit": fit,
        "mwms": custom_loop(sg.distribute.MultiWorkerMirroredStrategy()),
        "one_device": custom_loop(sg.distribute.OneDeviceStrategy(str(device))),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--check", action="store_true", help="exit 1 if any step waits")
    parser.add_argument("--quick", action="store_true", help="2 steps (a test's run)")
    args = parser.parse_args()
    if args.quick:
        args.steps = 2
    if not torch.cuda.is_available():
        print("gpu_sync_points: needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
    per_step_waits = 0
    for name, train in ways(device).items():
        train(args.steps)  # warm-up: first-call work (the first batch's checks) is not a step's
        once = synchronizing_calls(lambda train=train: train(args.steps))
        twice = synchronizing_calls(lambda train=train: train(2 * args.steps))
        per_step = {s: n - once[s] for s, n in twice.items() if n > once[s]}
        per_step_waits += sum(per_step.values())
        print(f"== {name}: {sum(once.values())} waits in {args.steps} steps, "
              f"{sum(twice.values())} in {2 * args.steps}; per step: "
              f"{sum(per_step.values()) / args.steps:g}")  # fmt: skip
        for stack, n in twice.most_common():
            print(f"-- {n} in {2 * args.steps} steps ({once[stack]} in {args.steps}): {stack}")
    if args.check and per_step_waits:
        print(f"gpu_sync_points: {per_step_waits} waits for the GPU grew with the step count")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
