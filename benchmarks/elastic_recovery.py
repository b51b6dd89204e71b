"""Recovery time of an elastic job: from a worker's SIGKILL to the job's next completed step.

The same job under each launcher: ``fit`` under MultiWorkerMirrored on 3 workers (an MLP on
synthetic data, ``BackupAndRestore(save_freq=1)``, so every launcher resumes from the step
before the kill); worker 2 kills itself with SIGKILL at the start of step ``--kill-at``, after
writing the time. The chief writes the time of every completed step. Recovery = the first
completed step after the kill minus the kill. Variants, in rounds whose order rotates:

- ``ours -n 2:3``: ``stratagem run -n 2:3`` (the job goes on with the 2 left, in their own
  processes: the group rebuilt in place, the step redone);
- ``ours --max-restarts 1``: ``stratagem run -n 3:3 --max-restarts 1`` (the worker started
  again, every worker a new process, the job goes on with 3: the same work as torchrun's);
- ``torchrun``: ``torchrun --standalone --nproc-per-node 3 --max-restarts 1``.

Reported: each variant's median recovery, and ours against torchrun's in the same round (the
median of the per-round ratios; the target is at most 0.5).

    python benchmarks/elastic_recovery.py            # 3 rounds, about 4 min on 2 cores
    python benchmarks/elastic_recovery.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import rotated_rounds

WORKER = """
import json, os, signal, sys, time
import torch
import stratagem as sg

kill_at, steps = int(sys.argv[1]), int(sys.argv[2])
strategy = sg.distribute.MultiWorkerMirroredStrategy()
rank = strategy.cluster_resolver.task_id or 0
first = os.environ.get("STRATAGEM_ELASTIC_ROUND", os.environ.get("TORCHELASTIC_RESTART_COUNT"))
first = first == "0"

class Times(sg.keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if first and rank == 2 and batch == kill_at:
            with open("kill.json", "w") as f:
                json.dump({"t": time.time()}, f)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, batch, logs=None):
        if rank == 0:
            with open("steps.jsonl", "a") as f:
                f.write(json.dumps({"t": time.time(), "step": batch}) + "\\n")

g = torch.Generator().manual_seed(0)
x, y = torch.randn(steps * 48, 64, generator=g), torch.randint(0, 10, (steps * 48,), generator=g)
torch.manual_seed(0)
with strategy.scope():
    model = sg.keras.Model(torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
model.compile(sg.keras.optimizers.SGD(0.1),
              sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
callbacks = [sg.keras.callbacks.BackupAndRestore("backup", save_freq=1), Times()]
model.fit(x, y, batch_size=48, epochs=1, verbose=0, callbacks=callbacks)
"""

VARIANTS = {
    "ours -n 2:3": [sys.executable, "-m", "stratagem.cli", "run", "--quiet", "-n", "2:3"],
    "ours --max-restarts 1": [
        sys.executable, "-m", "stratagem.cli", "run", "--quiet", "-n", "3:3", "--max-restarts", "1",
    ],
    "torchrun": [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
        "--max-restarts", "1", "--monitor-interval", "0.1",
    ],
}  # fmt: skip


def recovery(variant: str, kill_at: int, steps: int, directory: Path) -> float:
    """Seconds from the kill to the completion of the step killed, in one run of ``variant``."""
    directory.mkdir(parents=True)
    script = directory / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    argv = [*VARIANTS[variant], str(script), str(kill_at), str(steps)]
    proc = subprocess.Popen(
        argv, cwd=directory, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        raise RuntimeError(f"{variant}: did not finish within 300 s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} exited {proc.returncode}:\n{output.decode()[-3000:]}")
    killed = json.loads((directory / "kill.json").read_text())["t"]
    lines = (directory / "steps.jsonl").read_text().splitlines()
    # The step killed, completed after the kill (the chief may still end the step before it
    # after the kill: its callbacks run after the step's collectives).
    after = [r["t"] for r in map(json.loads, lines) if r["step"] >= kill_at and r["t"] > killed]
    if not after:
        raise RuntimeError(f"{variant}: no step completed after the kill")
    return min(after) - killed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-at", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round, 12 steps")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.kill_at = 1, 12, 4
    with tempfile.TemporaryDirectory() as tmp:
        runs = iter(range(1 << 30))

        def measure(name: str) -> float:
            where = Path(tmp) / f"run-{next(runs)}"
            return recovery(name, args.kill_at, args.steps, where)

        variants = {name: (lambda name=name: measure(name)) for name in VARIANTS}
        figures = rotated_rounds(variants, args.rounds, "s to recover")
    ratios = {
        name: statistics.median(o / t for o, t in zip(figures[name], figures["torchrun"]))
        for name in VARIANTS
        if name != "torchrun"
    }
    print("\n| launcher | recovery (median s) | against torchrun (median of rounds) |")
    print("| --- | --- | --- |")
    for name, values in figures.items():
        ratio = f"{ratios[name]:.2f}" if name in ratios else "1"
        print(f"| {name} | {statistics.median(values):.2f} | {ratio} |")
    if args.json is not None:
        args.json.write_text(json.dumps({"recovery_s": figures, "ratio": ratios}))


if __name__ == "__main__":
    main()
