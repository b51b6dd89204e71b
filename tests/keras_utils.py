"""The compiled ``sg.keras.Model`` the Keras tests train, and the one-device fit every
strategy's fit is compared with; shared by test_keras_model.py and keras_callbacks/."""

from __future__ import annotations

import torch

import stratagem as sg
from workers.common import build_model


def compiled(module: torch.nn.Module | None = None, lr: float = 0.1, metrics=("accuracy",)):
    model = sg.keras.Model(module if module is not None else build_model())
    model.compile(
        sg.keras.optimizers.SGD(lr, momentum=0.9),
        sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        list(metrics),
    )
    return model


def reference(initial: dict, x, y, epochs: int = 2):
    """Default strategy, one device: what every strategy's fit must match."""
    module = build_model()
    module.load_state_dict(initial)
    model = compiled(module)
    history = model.fit(x, y, batch_size=24, epochs=epochs, shuffle=False, verbose=0)
    return model, history
