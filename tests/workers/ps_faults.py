"""Faults in a parameter-server job (launched by the test through ``stratagem run``).

argv: mode fault. ``lost-worker``: async with bounded staleness (so the survivors would wait
for the lost worker if the ps did not notice it is gone); the last worker SIGKILLs itself after
3 steps, the others train 30 steps and the chief prints what the ps applied.
"""

import os
import signal
import sys

import torch

import stratagem as sg
from workers.common import build_model

fault = sys.argv[1]
strategy = sg.distribute.ParameterServerStrategy(mode="async", max_staleness=1)
resolver = strategy.cluster_resolver
last = resolver.cluster_spec().num_tasks("worker") - 1
with strategy.scope():
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(resolver.task_id)
for step in range(30):
    if fault == "lost-worker" and resolver.task_id == last and step == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    x, y = torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g)
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
if strategy.extended.should_checkpoint:
    print(f"chief trained 30 steps; ps stats {strategy.ps_stats()}", flush=True)
