"""Start-up of MultiWorkerMirroredStrategy jobs: against torchrun at N processes, and with and
without the job secret.

Against torchrun (``--scaling``, the default part): a job of N processes (N = 2, 4, 8, 16, 32)
that starts and does one all-reduce, launched as a user does, in alternating rounds:

- ours: ``stratagem run -n N job.py``, each task making ``MultiWorkerMirroredStrategy()`` and
  reducing one tensor across the workers (``strategy.reduce`` of a ``strategy.run``);
- torchrun: ``torchrun --nproc-per-node N job.py``, each process calling
  ``init_process_group("gloo")`` and ``all_reduce``.

Reported per N: the median job wall time of each (launcher start to launcher exit), their
ratio (target <= 1.1), and the median in-process seconds of the strategy's start (the
``MultiWorkerMirroredStrategy()`` call, import of stratagem included; target <= 0.3 s at N = 2)
beside torch's ``init_process_group``.

With and without the secret (``--secret``): from process start to the end of the first
training step (the first gradient all-reduce), in each of the two workers, for jobs run
alternately in one run:

- secret: the job holds a secret (``STRATAGEM_JOB_SECRET``): the rendezvous store is sealed
  and every gloo connection answers a challenge (``comm/sealed_store.py``, ``comm/peer_check.py``);
- insecure: ``STRATAGEM_INSECURE=1`` and no secret: the store and gloo as torch has them, what
  every job did before the secret.

Reported: the median over jobs of the slower worker's start-up, per mode, and their ratio
(target: secret <= 1.05 x insecure).

    python benchmarks/startup.py                    # N = 2..32, 5 rounds: ~20 min on 2 cores
    python benchmarks/startup.py --sizes 2 4 --rounds 3
    python benchmarks/startup.py --secret           # 8 jobs per mode, about 2 minutes
    python benchmarks/startup.py --quick [--secret] # the smallest run: a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import clean_env, free_port, rotated_rounds, run_in_own_group, run_processes

MODES = {
    "secret": {"STRATAGEM_JOB_SECRET": "b" * 64},
    "insecure": {"STRATAGEM_INSECURE": "1"},
}


def worker(started: float) -> None:
    """One task: import, start the strategy, one step; print its seconds since ``started``."""
    import torch

    import stratagem as sg

    strategy = sg.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = torch.nn.Linear(32, 10)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        optimizer.zero_grad()
        model(torch.randn(8, 32)).sum().backward()
        optimizer.step()

    strategy.run(step)
    print(json.dumps({"seconds": time.time() - started}), flush=True)


def job(mode: str) -> float:
    """One 2-worker job; the slower worker's start-up, in seconds."""
    workers = [f"localhost:{free_port()}", f"localhost:{free_port()}"]
    started = time.time()
    argvs, env = [], clean_env({"OMP_NUM_THREADS": "1"})
    for name in ("STRATAGEM_JOB_SECRET", "STRATAGEM_JOB_SECRET_FILE", "STRATAGEM_INSECURE"):
        env.pop(name, None)
    env.update(MODES[mode])
    for index in range(2):
        config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        argvs.append(
            [
                sys.executable,
                __file__,
                "--worker",
                str(started),
                "--tf-config",
                json.dumps(config),
            ]
        )
    lines = run_processes(argvs, env, timeout=300)
    return max(json.loads(line)["seconds"] for line in lines)


# ---------------------------------------------------------------- against torchrun, N processes


def scaling_task(kind: str) -> None:
    """One process of a scaling job: start, one all-reduce; rank 0 prints the in-process start
    seconds (``RESULT {...}``)."""
    started = time.perf_counter()
    import torch

    imported = time.perf_counter()
    if kind == "ours":
        import stratagem as sg

        strategy = sg.distribute.MultiWorkerMirroredStrategy()
        up = time.perf_counter()
        total = strategy.reduce("SUM", strategy.run(lambda: torch.ones(1)), axis=None)
        world, rank = strategy.num_replicas_in_sync, strategy.cluster_resolver.task_id
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        up = time.perf_counter()
        total = torch.ones(1)
        dist.all_reduce(total)
        world, rank = dist.get_world_size(), dist.get_rank()
        dist.destroy_process_group()
    if int(total.item()) != world:
        raise RuntimeError(f"{kind}: the all-reduce gave {total.item()}, expected {world}")
    if rank == 0:
        print("RESULT " + json.dumps({"start_s": up - imported, "torch_s": imported - started}))


def scaling_job(kind: str, n: int) -> tuple[float, float]:
    """One job of ``n`` processes launched as a user would; (wall seconds, start seconds)."""
    if kind == "ours":
        argv = [sys.executable, "-m", "stratagem.cli", "run", "-n", str(n), "--quiet"]
    else:
        argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}",
                "--master-addr=127.0.0.1", f"--master-port={free_port()}"]  # fmt: skip
    argv += [__file__, "--scaling-task", kind]
    # OMP_NUM_THREADS=1 in both: the launcher sets it for its tasks, torchrun for more than one.
    env = clean_env({"OMP_NUM_THREADS": "1"})
    started = time.perf_counter()
    code, out = run_in_own_group(argv, env, timeout=600)
    wall = time.perf_counter() - started
    found = re.search(r"RESULT (\{.*\})", out)
    if code != 0 or found is None:
        raise RuntimeError(f"{kind} job of {n} exited {code}:\n{out[-4000:]}")
    return wall, json.loads(found.group(1))["start_s"]


def scaling(sizes: list[int], rounds: int) -> list[dict]:
    """Both jobs at each size, alternating; a row per size."""
    rows = []
    for n in sizes:
        starts: dict[str, list[float]] = {"ours": [], "torchrun": []}

        def measure(kind: str, n: int = n, starts: dict[str, list[float]] = starts) -> float:
            wall, start = scaling_job(kind, n)
            starts[kind].append(start)
            return wall

        print(f"N = {n}:", flush=True)
        walls = rotated_rounds({k: (lambda k=k: measure(k)) for k in starts}, rounds, "s")
        ours, theirs = statistics.median(walls["ours"]), statistics.median(walls["torchrun"])
        row = {
            "n": n,
            "ours_s": round(ours, 3),
            "torchrun_s": round(theirs, 3),
            "ratio": round(ours / theirs, 3),
            "strategy_start_s": round(statistics.median(starts["ours"]), 3),
            "init_process_group_s": round(statistics.median(starts["torchrun"]), 3),
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    head = ("N", "ours s", "torchrun s", "ratio", "MWMS start s", "torch init s")
    print(f"{head[0]:>3} {head[1]:>8} {head[2]:>10} {head[3]:>6} {head[4]:>13} {head[5]:>13}")
    for r in rows:
        print(f"{r['n']:>3} {r['ours_s']:>8.2f} {r['torchrun_s']:>10.2f} {r['ratio']:>6.2f} "
              f"{r['strategy_start_s']:>13.2f} {r['init_process_group_s']:>13.2f}")  # fmt: skip
    print("targets: ratio <= 1.1 at every N; MWMS start <= 0.3 s at N = 2")
    return rows


# ---------------------------------------------------------------- with and without the secret


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the smallest run: a smoke run")
    parser.add_argument("--secret", action="store_true", help="only: with and without the secret")
    parser.add_argument("--jobs", type=int, default=8, help="jobs per mode (--secret)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--rounds", type=int, default=5, help="rounds per size (scaling)")
    parser.add_argument("--worker", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--tf-config", help=argparse.SUPPRESS)
    parser.add_argument("--scaling-task", choices=["ours", "torchrun"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.scaling_task is not None:
        scaling_task(args.scaling_task)
        return
    if args.worker is not None:
        os.environ["TF_CONFIG"] = args.tf_config
        worker(args.worker)
        return
    if not args.secret:
        scaling([2] if args.quick else args.sizes, 1 if args.quick else args.rounds)
        return
    jobs = 2 if args.quick else args.jobs
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    for i in range(jobs):
        order = list(MODES) if i % 2 == 0 else list(MODES)[::-1]  # alternate who goes first
        for mode in order:
            seconds[mode].append(job(mode))
            print(f"job {i + 1}/{jobs} {mode}: {seconds[mode][-1]:.2f} s", flush=True)
    medians = {mode: statistics.median(s) for mode, s in seconds.items()}
    ratio = medians["secret"] / medians["insecure"]
    print(json.dumps({"median_s": {m: round(v, 3) for m, v in medians.items()},
                      "ratio": round(ratio, 3)}))  # fmt: skip
    print(f"start-up with the secret / without: {ratio:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
