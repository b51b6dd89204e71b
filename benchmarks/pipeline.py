"""Pipeline parallelism on 2 stage processes: bubble fraction, activation memory, PipeDream.

    python benchmarks/pipeline.py [--quick] [--json results.json]

Starts 2 stage processes (gloo, one intra-op thread each) that measure, on an MLP of equal
stages whose compute dominates its transfers (6 x Linear(4096, 4096) + ReLU, 3 per stage, MSE loss;
micro-batches of a fixed 32 rows, so the work per micro-batch does not depend on M; a
transfer is 512 KiB against about 9.7 GFLOP of compute per micro-batch and stage). The theory
assumes that what a micro-batch costs besides its compute (torch's posting of each transfer,
about 1 ms; the transfer; the schedule's Python) is negligible: with Linear(2048, 2048) it was
not (profiled: 0.05-0.1 of each step above the theory at M = 8), hence the width.

1. Bubble fraction for M = 1, 2, 4, 8 micro-batches, GPipe and 1F1B: on each stage,
   1 - (seconds inside forward/backward computations) / (wall seconds of the step), averaged
   over the 2 stages and the median over steps, against the theory (K - 1) / (M + K - 1).
2. Peak activation memory per stage, GPipe vs 1F1B: the largest number of bytes held at once by
   autograd's saved tensors other than the weights (``saved_tensors_hooks``; a tensor saved
   twice counts once), during a step; for PipeDream also the stashed weight versions.
3. Throughput, PipeDream (asynchronous 1F1B, weight stashing) vs 1F1B, M = 4 and 8: samples/s
   of the whole pipeline, median over steps; PipeDream draining at the end of every step (as
   the synchronous schedules do; the bubble theory is theirs) and without draining
   (``drain_each_step=False``: the warm-up micro-batches stay in flight into the next step, so
   only the first step fills the pipeline). Its theory is not zero: the stages still meet once
   per step (the loss's all-reduce), and on 2 equal stages whose backward is 2 forwards (as
   here) that costs each stage one forward per step: 1 / (3M + 1), a discrete-event count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

K = 2


def build(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


class SavedTensorMeter:
    """Bytes held at once by autograd's saved tensors, and their peaks, in two kinds.

    ``activations``: everything but weights. ``stashed``: weight-shaped tensors that are not
    the live parameters, i.e. PipeDream's stashed weight versions. The live parameters are not
    counted. A storage saved twice counts once.
    """

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.live_weights = {p.untyped_storage().data_ptr() for p in params}
        self.weight_shapes = {tuple(p.shape) for p in params}
        self.refs: dict[int, int] = {}
        self.live = {"activations": 0, "stashed": 0}
        self.peak = {"activations": 0, "stashed": 0}

    def pack(self, t: torch.Tensor) -> object:
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.live_weights:
            return t
        # Autograd may save a weight as a view (linear saves weight.t()): tell by shape; no
        # activation here is weight-shaped (they are [micro-batch, width]).
        shape = tuple(t.shape)
        stashed = shape in self.weight_shapes or shape[::-1] in self.weight_shapes
        kind = "stashed" if stashed else "activations"
        if self.refs.get(ptr, 0) == 0:
            self.live[kind] += t.untyped_storage().nbytes()
            self.peak[kind] = max(self.peak[kind], self.live[kind])
        self.refs[ptr] = self.refs.get(ptr, 0) + 1
        return _Held(t, ptr, kind, self)

    @staticmethod
    def unpack(held: object) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held  # type: ignore[return-value]


class _Held:
    def __init__(self, tensor: torch.Tensor, ptr: int, kind: str, meter: SavedTensorMeter) -> None:
        self.tensor, self.ptr, self.kind, self.meter = tensor, ptr, kind, meter
        self.nbytes = tensor.untyped_storage().nbytes()

    def __del__(self) -> None:
        m = self.meter
        m.refs[self.ptr] -= 1
        if m.refs[self.ptr] == 0:
            del m.refs[self.ptr]
            m.live[self.kind] -= self.nbytes


def measure(strategy_cls, schedule: str, m: int, args, drain: bool = True) -> dict:
    strategy = strategy_cls(
        schedule=schedule,
        num_microbatches=m,
        split_points=[args.layers],
        drain_each_step=drain,
    )
    pipe = strategy.pipeline(build(args.width, args.layers), loss_fn)
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(m)
    batch = args.microbatch * m
    # The input needs a gradient, as a middle stage's would: else stage 0 skips one of its 9
    # matrix products per micro-batch and the stages are unequal (the theory assumes equal).
    x = torch.randn(batch, args.width, generator=g).requires_grad_()
    y = torch.randn(batch, args.width, generator=g)
    meter = SavedTensorMeter(list(pipe.parameters()))
    bubbles, rates = [], []
    for step in range(args.warmup + args.steps):
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            start = time.perf_counter()
            pipe.train_step(x, y, opt)
            seconds = time.perf_counter() - start
        if step >= args.warmup:
            bubbles.append(pipe.stats.bubble_fraction)
            rates.append(batch / seconds)
    pipe.flush()  # nothing may stay in flight into the next configuration's transfers
    return {
        "schedule": schedule if drain else f"{schedule} (no drain)",
        "drains": drain,
        "m": m,
        "bubble": statistics.median(bubbles),
        "samples_per_s": statistics.median(rates),
        "peak_activation_bytes": meter.peak["activations"],
        "peak_stashed_bytes": meter.peak["stashed"],
    }


def worker(args) -> None:
    import stratagem as sg

    sg.config.threading.set_intra_op_parallelism_threads(1)
    strategy_cls = sg.distribute.experimental.PipelineStrategy
    results = []
    for m in (1, 2, 4, 8):
        for schedule in ("GPipe", "1F1B") if m >= K else ("GPipe",):  # 1F1B needs M >= K
            results.append(measure(strategy_cls, schedule, m, args))
    for m in (4, 8):
        results.append(measure(strategy_cls, "PipeDream", m, args))
        results.append(measure(strategy_cls, "PipeDream", m, args, drain=False))
    print(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--microbatch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    if args.quick:
        args.width, args.layers, args.steps, args.warmup = 64, 4, 2, 1
    if args.worker:
        worker(args)
        return

    from common import clean_env, free_port

    ports = [free_port(), free_port()]
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    argv = [sys.executable, __file__, "--worker", *sys.argv[1:]]
    procs = []
    for rank in range(K):
        env = clean_env({"OMP_NUM_THREADS": "1"})
        env["TF_CONFIG"] = json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": rank}}
        )
        procs.append(
            subprocess.Popen(
                argv, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
            )
        )
    lines = []
    try:
        for p in procs:
            out = p.communicate(timeout=900)[0]
            if p.returncode != 0:
                raise SystemExit(f"a stage process exited {p.returncode}:\n{out}")
            lines.append(out.strip().splitlines()[-1])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    per_stage = [json.loads(line) for line in lines]
    rows = []
    for i, first in enumerate(per_stage[0]):
        stages = [s[i] for s in per_stage]
        m = first["m"]
        rows.append(
            {
                "schedule": first["schedule"],
                "m": m,
                "bubble_measured": sum(s["bubble"] for s in stages) / K,
                # A pipeline that does not drain fills once (the warm-up step), then idles one
                # forward per stage per step where the stages meet (K = 2, backward = 2F).
                "bubble_theory": (K - 1) / (m + K - 1) if first["drains"] else 1 / (3 * m + 1),
                "peak_activation_mib": [s["peak_activation_bytes"] / 2**20 for s in stages],
                "peak_stashed_weights_mib": [s["peak_stashed_bytes"] / 2**20 for s in stages],
                # Every stage sees each sample once: the pipeline's rate is the slowest stage's.
                "samples_per_s": min(s["samples_per_s"] for s in stages),
            }
        )
    print(f"2 stages, micro-batch {args.microbatch}, width {args.width}, {args.steps} steps")
    print(
        "| schedule | M | bubble measured | theory | difference "
        "| peak activations per stage (MiB) | stashed weights (MiB) | samples/s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        mib = " / ".join(f"{v:.1f}" for v in r["peak_activation_mib"])
        stash = " / ".join(f"{v:.1f}" for v in r["peak_stashed_weights_mib"])
        measured, theory = r["bubble_measured"], r["bubble_theory"]
        print(
            f"| {r['schedule']} | {r['m']} | {measured:.3f} | {theory:.3f} | "
            f"{measured - theory:+.3f} | {mib} | {stash} | {r['samples_per_s']:.0f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
