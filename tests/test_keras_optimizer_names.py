"""Keras's optimizer names beyond Adam (``"adamw"``, ``"nadam"``, ``"adamax"``, ``"adafactor"``),
bound to torch's implementations with Keras's arguments and defaults; ``"lion"``, which torch
has not, refused by name."""

from __future__ import annotations

import pytest
import torch

import stratagem as sg
from stratagem.errors import UnavailableOptimizerError


def _keras_nadam(param: torch.Tensor, grads: list[torch.Tensor], lr: float = 0.001) -> torch.Tensor:
    """Keras 3's Nadam update (keras/src/optimizers/nadam.py), written out."""
    b1, b2, eps = 0.9, 0.999, 1e-7
    m, v, u_product = torch.zeros_like(param), torch.zeros_like(param), 1.0
    for t, g in enumerate(grads, start=1):
        u_t, u_next = b1 * (1 - 0.5 * 0.96**t), b1 * (1 - 0.5 * 0.96 ** (t + 1))
        u_product *= u_t
        m = m + (g - m) * (1 - b1)
        v = v + (g * g - v) * (1 - b2)
        m_hat = u_next * m / (1 - u_product * u_next) + (1 - u_t) * g / (1 - u_product)
        param = param - lr * m_hat / ((v / (1 - b2**t)).sqrt() + eps)
    return param


def test_keras_optimizer_names_resolve_with_keras_defaults():
    params = [torch.nn.Parameter(torch.zeros(3, 2))]
    get = sg.keras.optimizers.get
    adamw = get("adamw", params).torch_optimizer
    assert isinstance(adamw, torch.optim.AdamW)
    assert adamw.defaults["weight_decay"] == 0.004 and adamw.defaults["eps"] == 1e-7
    assert isinstance(get("Adamax", params).torch_optimizer, torch.optim.Adamax)
    adafactor = get("adafactor", params).torch_optimizer
    assert isinstance(adafactor, torch.optim.Adafactor)
    assert adafactor.defaults["lr"] == 0.001 and adafactor.defaults["eps"] == (1e-15, 1e-3)
    with pytest.raises(ValueError, match="relative_step=False"):
        sg.keras.optimizers.Adafactor(relative_step=False)
    with pytest.raises(UnavailableOptimizerError, match=r"no Lion in torch.optim.*'adamw'"):
        get("lion", params)
    with pytest.raises(UnavailableOptimizerError, match=r"learning_rate=0\.0001"):
        sg.keras.optimizers.Lion(learning_rate=1e-4)
    # Nadam is Keras 3's, step for step (torch's default schedule, Keras 2's, is off by a few
    # percent; torch keeps the momentum product in float32, hence the tolerance).
    param = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64))
    start = param.detach().clone()
    nadam = get("nadam", [param])
    grads = [torch.tensor(g, dtype=torch.float64) for g in ([1.0, -2, 0.5], [0.3, 1, -1])]
    for g in grads:
        param.grad = g.clone()
        nadam.step()
    torch.testing.assert_close(param.detach(), _keras_nadam(start, grads), rtol=1e-6, atol=0)
