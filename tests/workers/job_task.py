"""A training-job task for tests/test_jobs.py: records what the job handed it, then exits.

Every task writes its view (task, directory variables, threads, argv) to
``$STRATAGEM_JOB_DIR/seen-<type>-<index>.json``; the chief "saves the model" to
``$AIP_MODEL_DIR``, as the seed's script does. ``--fail TYPE`` makes that task type exit 3.
"""

import argparse
import json
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--fail", default=None)
parser.add_argument("--word", default="")
args = parser.parse_args()

task = json.loads(os.environ["TF_CONFIG"])["task"]
names = [
    "STRATAGEM_JOB_DIR",
    "STRATAGEM_MODEL_DIR",
    "STRATAGEM_CHECKPOINT_DIR",
    "STRATAGEM_TENSORBOARD_LOG_DIR",
    "AIP_MODEL_DIR",
    "AIP_CHECKPOINT_DIR",
    "AIP_TENSORBOARD_LOG_DIR",
    "OMP_NUM_THREADS",
    "JOB_TEST_VAR",
]
seen = {"task": task, "env": {n: os.environ.get(n) for n in names}, "word": args.word}
job_dir = os.environ["STRATAGEM_JOB_DIR"]
with open(os.path.join(job_dir, f"seen-{task['type']}-{task['index']}.json"), "w") as f:
    json.dump(seen, f)
print(f"task {task['type']} {task['index']} says {args.word}")
if task["type"] == "chief":
    with open(os.path.join(os.environ["AIP_MODEL_DIR"], "model.txt"), "w") as f:
        f.write("weights")
if args.fail == task["type"]:
    print("failing on purpose", file=sys.stderr)
    sys.exit(3)
