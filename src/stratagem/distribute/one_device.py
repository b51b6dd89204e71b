"""OneDeviceStrategy: everything created in scope lives on one device, one replica computes.

Useful to write code once for a strategy and test it on a single device; the input pipeline
moves each batch to the device.
"""

from __future__ import annotations

import torch

from stratagem.comm import LocalCommunicator
from stratagem.distribute.devices import parse_device
from stratagem.distribute.strategy import Strategy


class OneDeviceStrategy(Strategy):
    """``sg.distribute.OneDeviceStrategy(device)``: place variables and compute on ``device``."""

    def __init__(self, device: str | torch.device) -> None:
        super().__init__([parse_device(device)], comm=LocalCommunicator())
