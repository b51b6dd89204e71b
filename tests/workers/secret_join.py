"""A task of a 2-worker MWMS job for tests/test_attacks_secret.py.

It joins (the roll call on the sealed store, then gloo), sums its rank across the job and
prints the result. With MARKER set it is an intruder: had it joined, it would create MARKER
(the harmless stand-in for code run inside the job) before its first collective.
"""

import os

import torch

import stratagem as sg

strategy = sg.distribute.MultiWorkerMirroredStrategy()
marker = os.environ.get("MARKER")
if marker:
    with open(marker, "w") as f:
        f.write("joined the job without its secret\n")
total = strategy.reduce(
    sg.distribute.ReduceOp.SUM,
    strategy.run(lambda: torch.tensor(float(strategy.cluster_resolver.task_id))),
    axis=None,
)
print(f"joined: sum of task ids {float(total):g}", flush=True)
