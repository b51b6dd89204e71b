"""OneDeviceStrategy: everything created in scope lives on one device, one replica computes.

Useful to write code once for a strategy and test it on a single device; the input pipeline
moves each batch to the device. The core ``StrategyExtended`` with one device is nearly all of it.
"""

from __future__ import annotations

import torch
from typing_extensions import override

from stratagem.comm import LocalCommunicator
from stratagem.distribute.extended import StrategyExtended
from stratagem.distribute.machinery.replica_devices import parse_device
from stratagem.distribute.strategy import Strategy


class OneDeviceStrategy(Strategy):
    """``sg.distribute.OneDeviceStrategy(device)``: place variables and compute on ``device``."""

    def __init__(self, device: str | torch.device) -> None:
        super().__init__(OneDeviceExtended(self, [parse_device(device)], comm=LocalCommunicator()))


class OneDeviceExtended(StrategyExtended):
    """One replica on one device: the core's placement (``place`` at capture) is all of it."""

    @override
    def adopt(self, tensors: list[tuple[torch.Tensor, bool]]) -> None:
        """Nothing more: each tensor was placed on the device when it was captured."""

    @override
    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing: one replica's gradients are the update's."""
