"""A parameter-server job attacked while it runs (tests/test_attacks_network.py).

argv: directory. A worker builds its model in scope (the shards are created on the ps), writes
``ready`` and waits for ``go``: meanwhile the test attacks the ps. Then it trains 5 steps and
prints what the ps applied; the ps serves until it is done and exits 0.
"""

import os
import sys
import time

import torch

import stratagem as sg
from workers.common import build_model

directory = sys.argv[1]
strategy = sg.distribute.ParameterServerStrategy(mode="sync")
with strategy.scope():
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
open(os.path.join(directory, "ready"), "w").close()
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(directory, "go")):
    if time.monotonic() > deadline:
        raise TimeoutError("the test never said go")
    time.sleep(0.05)
g = torch.Generator().manual_seed(0)
for _ in range(5):
    x, y = torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g)
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
print(f"trained; ps stats {strategy.ps_stats()}", flush=True)
