"""OneDeviceStrategy: everything created in scope lives on one device, one replica computes.

Useful to write code once for a strategy and test it on a single device; the input pipeline
moves each batch to the device. The base ``StrategyExtended`` with one device is all of it.
"""

from __future__ import annotations

import torch

from stratagem.comm import LocalCommunicator
from stratagem.distribute.extended import StrategyExtended
from stratagem.distribute.machinery.devices import parse_device
from stratagem.distribute.strategy import Strategy


class OneDeviceStrategy(Strategy):
    """``sg.distribute.OneDeviceStrategy(device)``: place variables and compute on ``device``."""

    def __init__(self, device: str | torch.device) -> None:
        super().__init__(StrategyExtended(self, [parse_device(device)], comm=LocalCommunicator()))
