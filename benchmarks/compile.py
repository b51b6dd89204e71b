"""torch.compile under MultiWorkerMirroredStrategy against compiled raw DDP, in one run.

2 worker processes on the CPU (gloo, one intra-op thread each), the seed CNN, global batch 128,
RMSprop, the same synthetic batches. In each process four sides take turns step by step, so
all four meet the same machine state (the order rotates every step):

- ``MWMS compiled``: the seed's loop under MultiWorkerMirroredStrategy, the model built in its
  scope and ``torch.compile``d (inductor, the default backend);
- ``MWMS eager``: the same model object, called uncompiled (same parameters and optimizer, so
  the strategy's reducer holds one model, as in a real job);
- ``DDP compiled``: ``torch.compile(DistributedDataParallel(model))`` over the same process
  group, built outside the scope (stratagem leaves it alone);
- ``DDP eager``: the same DDP model called uncompiled, with DDP's optimizer.

Each model thus gets two updates per step from the same batch (compiled, then eager, or the
other way round), so the two models train alike: their weights drift apart only by what RMSprop
makes of rounding (each job reports how far). They must: this CNN's step time depends on its
weights' values (with the eager side stepping only the MWMS
model, its forward ran about 1 ms (4 %) longer than DDP's in the same process, a difference
that went away with a learning rate of 0).

Reported per pair: the median over steps of the paired ratio (the other's step time over
this one's: this one's samples/s over the other's), then the median over jobs.
After timing, each worker checks that compiled training matched eager (the weights of the
compiled and eager models after the same steps from the same start, float tolerance) and
counts the gradient bytes whose all-reduce started while the compiled backward still ran
(``OverlapProbe``); the run fails if compiled training diverges.

    python benchmarks/compile.py            # 3 jobs (a cold inductor compile: minutes)
    python benchmarks/compile.py --quick    # 1 job, few steps
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import STABLE_MALLOC, batches, clean_env, free_port, run_processes, seed_cnn

GLOBAL_BATCH = 128


class SeedCNN(torch.nn.Module):
    """The seed CNN in a module of the script's own. dynamo skips the frames of torch's own
    modules unless they are what ``torch.compile`` was given: ``torch.compile(DDP(nn.Sequential))``
    would run the Sequential eagerly behind DDP's graph break, and compare compiled MWMS with
    an eager DDP. A user's model class is what a job compiles."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = seed_cnn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _rmsprop(params) -> torch.optim.Optimizer:
    return torch.optim.RMSprop(params, lr=1e-3, alpha=0.9, eps=1e-7)


def check_compiled_matches_eager(strategy, data) -> dict:
    """Train two copies of one start, compiled and eager, 3 steps; their largest difference,
    and the overlapped bytes of the compiled one's last step."""
    import stratagem as sg
    from stratagem.comm.overlap import OverlapProbe

    torch.manual_seed(1)
    with strategy.scope():
        eager = SeedCNN()
        twin = SeedCNN()
    twin.load_state_dict(eager.state_dict())
    compiled = torch.compile(twin)
    probe = OverlapProbe(strategy.extended.gradient_reducer)
    for module, forward in ((eager, eager), (twin, compiled)):
        optimizer = _rmsprop(module.parameters())
        for x, y in data[:3]:

            def step(x=x, y=y, forward=forward, optimizer=optimizer) -> None:
                per_example = torch.nn.functional.cross_entropy(forward(x), y, reduction="none")
                loss = sg.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
                optimizer.zero_grad()
                if forward is compiled:
                    probe.watch(loss)
                loss.backward()
                optimizer.step()

            strategy.run(step)
    probe.close()
    difference = max(
        (a - b).abs().max().item()
        for a, b in zip(eager.state_dict().values(), twin.state_dict().values())
    )
    return {
        "max_weight_difference": difference,
        "overlapped_bytes_per_step": probe.overlapped_bytes // 3,
        "all_reduced_bytes_per_step": probe.total_bytes // 3,
    }


def worker(rank: int, port: int, passes: int, k: int, split_ddp: int = 1) -> str:
    """Take turns: MWMS compiled and eager, DDP compiled and eager; JSON of each step's seconds.
    ``split_ddp=0`` turns off dynamo's DDPOptimizer (``optimize_ddp``): compiled DDP is then
    one graph, as compiled MWMS is."""
    torch._dynamo.config.optimize_ddp = bool(split_ddp)
    from torch.nn.parallel import DistributedDataParallel

    import stratagem as sg

    os.environ["TF_CONFIG"] = json.dumps(
        {
            "cluster": {"worker": [f"localhost:{port}", f"localhost:{port + 1}"]},
            "task": {"type": "worker", "index": rank},
        }
    )
    strategy = sg.distribute.MultiWorkerMirroredStrategy()
    data = batches(k, GLOBAL_BATCH // 2, seed=rank)
    torch.manual_seed(0)
    with strategy.scope():
        model = SeedCNN()
    optimizer = _rmsprop(model.parameters())
    compiled_model = torch.compile(model)
    torch.manual_seed(0)
    ddp_model = DistributedDataParallel(SeedCNN())
    ddp_compiled = torch.compile(ddp_model)
    ddp_optimizer = _rmsprop(ddp_model.parameters())

    # The same order of work on both sides: gradients dropped, forward, loss, backward, step.
    def ours(forward):
        def step_fn(x: torch.Tensor, y: torch.Tensor) -> None:
            optimizer.zero_grad()
            per_example = torch.nn.functional.cross_entropy(forward(x), y, reduction="none")
            loss = sg.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
            loss.backward()
            optimizer.step()

        return lambda x, y: strategy.run(step_fn, args=(x, y))

    def ddp(forward):
        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            ddp_optimizer.zero_grad()
            torch.nn.functional.cross_entropy(forward(x), y).backward()
            ddp_optimizer.step()

        return step

    sides = {
        "mwms_compiled": ours(compiled_model),
        "mwms_eager": ours(model),
        "ddp_compiled": ddp(ddp_compiled),
        "ddp_eager": ddp(ddp_model),
    }
    names = list(sides)
    times: dict[str, list[float]] = {n: [] for n in names}
    step = 0
    for p in range(passes + 1):  # pass 0 compiles and warms every side up
        for x, y in data:
            order = names[step % len(names) :] + names[: step % len(names)]
            for name in order:
                start = time.perf_counter()
                sides[name](x, y)
                if p:
                    times[name].append(time.perf_counter() - start)
            step += 1
        print(f"worker {rank}: pass {p}/{passes} done", file=sys.stderr, flush=True)
    # The premise of the pairing: both models trained alike, rounding apart (RMSprop divides
    # by the root of the squared gradients' average, so where that is near 0 a rounding apart
    # makes a step apart: the largest difference is some steps' learning rate, the mean tiny).
    apart = torch.cat(
        [
            (a - b).abs().reshape(-1)
            for a, b in zip(model.state_dict().values(), ddp_model.module.state_dict().values())
        ]
    )
    # After the timing: the check's models join the strategy's reducer, whose every step
    # all-reduces the buckets of every model it holds.
    check = {
        "mwms_ddp_weights_apart": {"max": apart.max().item(), "mean": apart.mean().item()},
        **check_compiled_matches_eager(strategy, data),
    }
    return json.dumps({"times": times, "check": check})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 job, few steps (a smoke run)")
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--stable-malloc", action="store_true", help="see allreduce_strategies")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--one-graph-ddp",
        action="store_true",
        help="turn off dynamo's DDPOptimizer: compiled DDP in one graph (no cut at buckets)",
    )
    parser.add_argument("--worker", nargs=5, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        rank, port, passes, k, split_ddp = args.worker
        print(worker(rank, port, passes, k, split_ddp), flush=True)
        return
    jobs, passes, k = (1, 1, 4) if args.quick else (args.jobs, 4, 20)
    extra = {"OMP_NUM_THREADS": "1", **(STABLE_MALLOC if args.stable_malloc else {})}
    # (this side, the other): this side's samples/s over the other's, paired step by step.
    pairs = {
        "compiled MWMS vs compiled DDP": ("mwms_compiled", "ddp_compiled"),
        "eager MWMS vs eager DDP": ("mwms_eager", "ddp_eager"),
        "compiled MWMS vs eager MWMS": ("mwms_compiled", "mwms_eager"),
    }
    rows: dict[str, list[float]] = {name: [] for name in pairs}
    rates: dict[str, list[float]] = {}
    checks = []
    for j in range(jobs):
        port = free_port()
        split = str(int(not args.one_graph_ddp))
        argvs = [
            [sys.executable, __file__, "--worker", str(r), str(port), str(passes), str(k), split]
            for r in range(2)
        ]
        out = json.loads(run_processes(argvs, clean_env(extra), timeout=1800)[0])
        times, check = out["times"], out["check"]
        checks.append(check)
        if check["max_weight_difference"] > 1e-4:
            raise SystemExit(f"compiled training diverged from eager: {check}")
        for name, seconds in times.items():
            rates.setdefault(name, []).extend(GLOBAL_BATCH / s for s in seconds)
        for pair, (mine, other) in pairs.items():
            rows[pair].append(
                statistics.median(o / m for o, m in zip(times[other], times[mine], strict=True))
            )
        said = ", ".join(f"{pair} {rows[pair][-1]:.3f}" for pair in pairs)
        print(f"job {j + 1}/{jobs}: {said}; {check}", flush=True)
    table = [
        ("compiled DDP (inductor), 2 workers, global batch 128", rates["ddp_compiled"], None),
        ("eager DDP", rates["ddp_eager"], None),
        ("eager MWMS", rates["mwms_eager"], None),
    ] + [(pair, rates[mine], statistics.median(rows[pair])) for pair, (mine, _) in pairs.items()]
    print("\n| measurement | median samples/s | ratio (paired, median of jobs) |")
    print("| --- | --- | --- |")
    for name, r, ratio in table:
        print(
            f"| {name} | {statistics.median(r):.0f} | {'' if ratio is None else f'{ratio:.3f}'} |"
        )
    print(f"\nchecks (per job, chief): {checks}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "rows": [
                        {"measurement": n, "samples_per_s": r, "ratio": x} for n, r, x in table
                    ],
                    "checks": checks,
                    "cpus": os.cpu_count(),
                    "torch": torch.__version__,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
