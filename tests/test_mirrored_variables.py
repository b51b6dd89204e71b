"""Parameters created on their own in a Mirrored or CentralStorage scope (TF's ``tf.Variable``)
are mirrored variables: each replica computes on its own copy with its own ``.grad``, the
gradients are summed once, and every copy gets the same update, as for a module's weights."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import stratagem as sg
from cluster_utils import child_env
from workers.bare_variable import DEVICES, make_strategy

WORKER = Path(__file__).resolve().parent / "workers" / "bare_variable.py"
KINDS = ["mirrored", "central"]
STEPS = 300


def _exit_reason(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


@pytest.mark.parametrize("kind", KINDS)
def test_every_step_moves_a_bare_parameter_by_the_summed_gradient(kind):
    # In a child process: replicas racing on one shared tensor can crash the interpreter.
    proc = subprocess.run(
        [sys.executable, str(WORKER), kind, str(STEPS)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (
        f"the training child ended with {_exit_reason(proc.returncode)}\n"
        f"--- stdout\n{proc.stdout[-2000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["created_in_scope"], "w, created in the scope, is not the strategy's variable"
    # Two replicas each contribute a gradient of 2; SGD(lr=0.5) moves w by -(2 + 2) * 0.5.
    wrong = {i: m for i, m in enumerate(result["moves"]) if m != -2.0}
    assert len(result["moves"]) == STEPS
    assert not wrong, f"{len(wrong)} of {STEPS} steps moved w wrongly (step: move): {wrong}"
    # Every replica's copy got that one update (not its own step on a shared tensor).
    expected = [[-2.0 * (i + 1)] * len(DEVICES) for i in range(STEPS)]
    unequal = {
        i: seen
        for i, (seen, want) in enumerate(zip(result["replica_values"], expected))
        if seen != want
    }
    assert not unequal, f"replicas read other values after step (step: values): {unequal}"
    assert result["final"] == -2.0 * STEPS


def _same_as_linear(kind: str, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bare parameter beside an ``nn.Linear``, in one optimizer: (bare, linear weight)."""
    strategy = make_strategy(kind)
    with strategy.scope():
        layer = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.zeros_(layer.weight)
        w = torch.nn.Parameter(torch.zeros(1, 1))
        optimizer = torch.optim.SGD([*layer.parameters(), w], lr=0.5)
    assert strategy.extended.variable_created_in_scope(w)
    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.full((1, 1), float(ctx.replica_id_in_sync_group + 1))
    )

    def step(x: torch.Tensor) -> None:
        optimizer.zero_grad()
        (layer(x) + x @ w).sum().backward()
        optimizer.step()

    for _ in range(steps):
        strategy.run(step, args=(x,))
    return w.detach().clone(), layer.weight.detach().clone()


@pytest.mark.parametrize("kind", KINDS)
def test_a_bare_parameter_trains_as_a_linear_weight_in_one_optimizer(kind):
    bare, weight = _same_as_linear(kind, steps=5)
    # Replicas see x = 1 and x = 2: gradient 1 + 2 = 3 a step, lr 0.5, 5 steps.
    assert bare.item() == weight.item() == -7.5


@pytest.mark.parametrize("kind", KINDS)
def test_a_bare_parameter_reads_and_reduces_as_a_mirrored_variable(kind):
    strategy = make_strategy(kind)
    with strategy.scope():
        w = torch.nn.Parameter(torch.zeros(2))
        optimizer = torch.optim.SGD([w], lr=0.5)
    assert strategy.extended.variable_created_in_scope(w)

    def step() -> torch.Tensor:
        optimizer.zero_grad()
        (w * torch.tensor([1.0, 3.0])).sum().backward()
        optimizer.step()
        # This replica's own copy, after the update every copy got.
        return w.detach().clone()

    for _ in range(3):
        seen = strategy.run(step)
    expected = torch.tensor([-3.0, -9.0])  # 3 steps of -(2 replicas * [1, 3]) * 0.5
    # Outside run: the primary, as every replica saw it.
    torch.testing.assert_close(w.detach(), expected, rtol=0, atol=0)
    copies = strategy.experimental_local_results(seen)
    assert len(copies) == len(DEVICES)
    for copy in copies:
        torch.testing.assert_close(copy, expected, rtol=0, atol=0)
    torch.testing.assert_close(
        strategy.reduce(sg.distribute.ReduceOp.SUM, seen, axis=None), 2 * expected
    )
    torch.testing.assert_close(strategy.reduce(sg.distribute.ReduceOp.MEAN, w, axis=None), expected)
