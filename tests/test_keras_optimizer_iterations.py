"""``optimizer.iterations`` counts every optimizer step, as Keras's: ``fit``'s and a custom
loop's (Keras's ``apply_gradients`` increments it), once per step under a strategy (Keras's
``iterations`` is a variable only the first replica updates), and a step the loss scale skips
(tf-keras ``loss_scale_optimizer.py``: ``do_not_apply_fn`` increments the inner optimizer's
iterations itself)."""

from __future__ import annotations

import pytest
import torch

import stratagem as sg
from in_turn_strategy import InTurnStrategy

LOCAL_STRATEGIES = pytest.mark.parametrize(
    "make",
    [
        lambda: sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"]),
        lambda: sg.distribute.experimental.CentralStorageStrategy(["cpu:0", "cpu:1"]),
        lambda: InTurnStrategy(2),  # replicas one after another: no merge call to meet in
    ],
    ids=["mirrored", "central_storage", "in_turn"],
)


def _compiled(optimizer=None) -> sg.keras.Model:
    torch.manual_seed(0)
    model = sg.keras.Model(torch.nn.Linear(3, 1))
    model.compile(optimizer or sg.keras.optimizers.SGD(0.1), loss="mse")
    return model


def _custom_step(model: sg.keras.Model, x: torch.Tensor) -> None:
    """A custom loop's step: Keras's tape + ``apply_gradients``."""
    loss = model(x).pow(2).mean()
    model.optimizer.zero_grad()
    loss.backward()
    model.optimizer.step()


def test_a_custom_loops_steps_count_as_fits_do():
    model = _compiled()
    before = model.module.weight.detach().clone()
    for _ in range(3):
        _custom_step(model, torch.ones(4, 3))
    assert model.optimizer.iterations == 3
    assert not torch.equal(model.module.weight, before)  # the steps were applied
    model.fit(torch.ones(8, 3), torch.zeros(8, 1), batch_size=4, epochs=1, verbose=0)
    assert model.optimizer.iterations == 5  # one count, the custom loop's and fit's together


@LOCAL_STRATEGIES
def test_one_count_per_step_not_per_replica(make):
    strategy = make()
    with strategy.scope():
        model = _compiled()
    x = torch.ones(4, 3)
    for _ in range(3):
        strategy.run(_custom_step, args=(model, x))
    assert model.optimizer.iterations == 3
    model.fit(torch.ones(8, 3), torch.zeros(8, 1), batch_size=4, epochs=1, verbose=0)
    assert model.optimizer.iterations == 5


def test_a_step_skipped_by_the_loss_scale_still_counts():
    lso = sg.keras.mixed_precision.LossScaleOptimizer(
        sg.keras.optimizers.SGD(0.1), initial_scale=8.0
    )
    model = _compiled(lso)
    _custom_step(model, torch.ones(4, 3))
    before = model.module.weight.detach().clone()
    model.optimizer.zero_grad()
    loss = model(torch.full((4, 3), float("inf"))).sum()
    model.optimizer.get_scaled_loss(loss).backward()
    model.optimizer.step()  # non-finite gradients: skipped, the scale halved
    assert torch.equal(model.module.weight, before)
    assert float(model.optimizer.loss_scale) == 4.0
    assert model.optimizer.iterations == 2


def test_accumulated_steps_in_a_custom_loop_count_and_update_every_kth_call():
    """Keras 3: with ``gradient_accumulation_steps=k`` each call accumulates, every k-th
    applies, and ``iterations`` is the calls // k, in a custom loop as in ``fit``."""
    model = _compiled(sg.keras.optimizers.SGD(0.1, gradient_accumulation_steps=2))
    before = model.module.weight.detach().clone()
    _custom_step(model, torch.ones(4, 3))
    assert model.optimizer.iterations == 0 and torch.equal(model.module.weight, before)
    _custom_step(model, torch.ones(4, 3))
    assert model.optimizer.iterations == 1 and not torch.equal(model.module.weight, before)
