"""A task of a 3-worker MultiWorkerMirroredStrategy job whose steps take WORK seconds of their
own (a sleep standing for compute, so the slowness is the test's input and takes no CPU from
the others); worker SLOW's own work is 3x that during steps SLOW_FROM..SLOW_TO (1-based; none
when SLOW is -1). Writes what its straggler watch named to <OUT>/rank<r>.json."""

import json
import os
import sys
import time

import torch
import torch.nn.functional as F

import stratagem as sg

out, steps, work = sys.argv[1], int(os.environ["STEPS"]), float(os.environ["WORK"])
slow, slow_from, slow_to = (int(os.environ[k]) for k in ("SLOW", "SLOW_FROM", "SLOW_TO"))
torch.manual_seed(0)
strategy = sg.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
rank = torch.distributed.get_rank()

for step in range(1, steps + 1):

    def replica(step: int = step) -> None:
        time.sleep(3 * work if rank == slow and slow_from <= step <= slow_to else work)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    strategy.run(replica)

watch = strategy.extended.straggler_watch
named = [
    {
        "rank": s.rank,
        "step": s.step,
        "own": s.own_work_s,
        "others": s.others_s,
        "line": s.describe(),
    }
    for s in watch.named
]
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(named, f)
