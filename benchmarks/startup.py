"""Start-up of a 2-worker MultiWorkerMirroredStrategy job, with and without the job secret.

From process start to the end of the first training step (the first gradient all-reduce), in
each of the two workers, for jobs run alternately in one run:

- secret: the job holds a secret (``STRATAGEM_JOB_SECRET``): the rendezvous store is sealed
  and every gloo connection answers a challenge (``comm/sealed_store.py``, ``comm/peer_check.py``);
- insecure: ``STRATAGEM_INSECURE=1`` and no secret: the store and gloo as torch has them, what
  every job did before the secret.

Reported: the median over jobs of the slower worker's start-up, per mode, and their ratio
(target: secret <= 1.05 x insecure).

    python benchmarks/startup.py              # 8 jobs per mode, about 2 minutes on 2 cores
    python benchmarks/startup.py --quick      # 2 jobs per mode
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import clean_env, free_port, run_processes

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 jobs per mode: a smoke run")
    parser.add_argument("--jobs", type=int, default=8, help="jobs per mode")
    parser.add_argument("--worker", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--tf-config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        import os

        os.environ["TF_CONFIG"] = args.tf_config
        worker(args.worker)
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
