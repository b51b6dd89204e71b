"""A bare parameter (TF's ``tf.Variable``) created in a strategy's scope, trained in ``run``.

Usage: bare_variable.py KIND STEPS, KIND ``mirrored`` or ``central`` (two logical CPU devices).
Each step every replica adds ``d(2 w)/dw = 2`` to the gradient; summed over the two replicas
and applied by SGD with lr 0.5, ``w`` moves by exactly -2.0 a step, as an ``nn.Linear``'s weight
does in the same loop. Prints one JSON line: whether ``w`` is a variable of the strategy
(``extended.variable_created_in_scope``), every step's move, the value each replica reads right
after its ``optimizer.step()`` (the same update on every copy), and the final value.

Run as a child process by ``tests/test_mirrored_variables.py``: replicas racing on one shared
tensor can crash the interpreter, which must fail the test rather than end the test run.
"""

from __future__ import annotations

import json
import sys

import torch

import stratagem as sg

DEVICES = ["cpu:0", "cpu:1"]


def make_strategy(kind: str) -> sg.distribute.Strategy:
    if kind == "mirrored":
        return sg.distribute.MirroredStrategy(DEVICES)
    if kind == "central":
        return sg.distribute.experimental.CentralStorageStrategy(DEVICES, "cpu")
    raise ValueError(f"KIND must be 'mirrored' or 'central', got {kind!r}")


def train(kind: str, steps: int) -> dict[str, object]:
    strategy = make_strategy(kind)
    with strategy.scope():
        w = torch.nn.Parameter(torch.zeros(()))
        optimizer = torch.optim.SGD([w], lr=0.5)

    def step() -> torch.Tensor:
        optimizer.zero_grad()
        (w * 2).backward()
        optimizer.step()
        return w.detach().clone()

    moves, replica_values = [], []
    for _ in range(steps):
        before = w.item()
        seen = strategy.experimental_local_results(strategy.run(step))
        moves.append(w.item() - before)
        replica_values.append([v.item() for v in seen])
    return {
        "created_in_scope": strategy.extended.variable_created_in_scope(w),
        "moves": moves,
        "replica_values": replica_values,
        "final": w.item(),
    }


if __name__ == "__main__":
    kind, steps = sys.argv[1], int(sys.argv[2])
    print(json.dumps(train(kind, steps)))
