"""A worker whose misbehaviour is chosen by MODE; the tests check how its peers fail."""

import os
import sys
import time

import torch

import stratagem as sg
from workers.common import build_model

mode = os.environ.get("MODE", "ok")
strategy = sg.distribute.MultiWorkerMirroredStrategy()
task = strategy.cluster_resolver.task_id
print(f"worker {task} joined", flush=True)

with strategy.scope():
    model = build_model() if not (mode == "model_mismatch" and task == 1) else torch.nn.Linear(5, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

if mode == "lag" and task == 1:
    time.sleep(float(os.environ.get("LAG", "30")))


def step():
    optimizer.zero_grad()
    model(torch.randn(8, 5)).sum().backward()
    optimizer.step()


steps = int(os.environ.get("STEPS", "3"))
i = 0
while mode == "train_forever" or i < steps:
    strategy.run(step)
    i += 1
    if i % 10 == 0 or mode != "train_forever":
        print(f"step {i}", flush=True)
print("done", flush=True)
sys.exit(0)
