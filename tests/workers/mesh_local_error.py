"""A 2-process mesh job whose step fails with the same shape error on both processes, one
after the other (tests/test_mesh_local_errors.py): worker 1 at once, worker 0 only once the
test says worker 1 has exited (``<dir>/go`` exists). Worker 0 must report its own error, not
a lost peer: worker 1's exit is not why its step failed."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

import stratagem as sg

go = Path(sys.argv[1]) / "go"
mesh = sg.dtensor.create_mesh([("batch", 2)])
strategy = sg.distribute.experimental.MeshStrategy(mesh)
with strategy.scope():
    model = torch.nn.Linear(3, 4)
rank = torch.distributed.get_rank()


def wait_for_go(timeout: float = 120.0) -> None:
    """Until the test writes ``go`` (worker 1 has exited); a bounded wait, not a delay."""
    deadline = time.monotonic() + timeout
    while not go.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"worker 0: {go} never appeared within {timeout:g}s")
        time.sleep(0.05)


def step(x: torch.Tensor) -> torch.Tensor:
    hidden = model(x)  # (4, 4), split along `batch`
    if rank == 0:
        wait_for_go()
    weight = sg.dtensor.copy_to_mesh(torch.ones(5, 2), sg.dtensor.Layout.replicated(mesh, 2))
    return hidden @ weight  # the bug: (4, 4) @ (5, 2)


print(f"worker {rank} steps", flush=True)
strategy.run(step, args=(torch.ones(2, 3),))
