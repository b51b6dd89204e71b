"""A tuning trial for tests/test_tune.py: a known objective of its --options, reported per step.

score = 1 - (x - 0.3)^2 - (y - 4)^2 / 100 - (0.2 if kind == "b" else 0), reported at steps
0..steps-1 as score * (step + 1) / steps (rising, as accuracy does while training).
``--mode``:
- ``ok``: as above;
- ``crash``: exit 3 when x > --crash_above;
- ``silent``: report nothing; ``wrong_tag``: report "loss" only;
- ``prune``: trials 0..2 score 0.9, later ones 0.1 and, after their first report, wait (up to
  60 s, then exit 4) for the tuner's median rule to stop them;
- ``hold``: trial 0 ends at once, later ones wait (up to 60 s) for a file ``release`` in
  --sync_dir before they report.
Every task writes what it was handed to ``$STRATAGEM_JOB_DIR/seen-<type>-<index>``.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import stratagem as sg

WAIT_S = 60

parser = argparse.ArgumentParser()
parser.add_argument("--x", type=float, required=True)
parser.add_argument("--y", type=int, default=4)
parser.add_argument("--kind", default="a")
parser.add_argument("--mode", default="ok")
parser.add_argument("--steps", type=int, default=1)
parser.add_argument("--crash_above", type=float, default=0.5)
parser.add_argument("--sync_dir", default=".")
args = parser.parse_args()

task = json.loads(os.environ["TF_CONFIG"])["task"]
trial = int(os.environ["STRATAGEM_TRIAL_ID"])
seen = {
    "task": task,
    "pid": os.getpid(),
    "omp": os.environ.get("OMP_NUM_THREADS"),
    "model_dir": os.environ.get("AIP_MODEL_DIR"),
    "x": args.x,
    "y": args.y,
    "kind": args.kind,
    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "cuda_device_order": os.environ.get("CUDA_DEVICE_ORDER"),
}
seen_file = Path(os.environ["STRATAGEM_JOB_DIR"]) / f"seen-{task['type']}-{task['index']}"
seen_file.write_text(json.dumps(seen))


def wait_for(condition):
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            print("gave up waiting", flush=True)
            sys.exit(4)
        time.sleep(0.02)


if args.mode == "crash" and args.x > args.crash_above:
    print(f"crashing on purpose: x={args.x}", flush=True)
    sys.exit(3)
if args.mode == "silent":
    sys.exit(0)
score = 1 - (args.x - 0.3) ** 2 - (args.y - 4) ** 2 / 100 - (0.2 if args.kind == "b" else 0)
if args.mode == "wrong_tag":
    sg.tune.report_hyperparameter_tuning_metric("loss", 1 - score, 1)
    sys.exit(0)
if args.mode == "prune":
    score = 0.9 if trial <= 2 else 0.1  # trials 0, 1, 2 (Optuna's numbers)
if args.mode == "hold" and trial > 0:
    wait_for(lambda: (Path(args.sync_dir) / "release").exists())
for step in range(args.steps):
    value = score * (step + 1) / args.steps
    sg.tune.report_hyperparameter_tuning_metric(
        hyperparameter_metric_tag="accuracy", metric_value=value, global_step=step
    )
    if args.mode == "prune" and trial > 2:
        wait_for(lambda: False)  # only the tuner's median rule ends this trial in time
