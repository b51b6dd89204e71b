"""CentralStorageStrategy: one process; parameters on one device, replicas compute on others.

1. Scope: parameters and buffers created inside live on the ``parameter_device`` (the
   primaries), and so does the optimizer state the update creates. Every compute device gets
   a copy to compute on (``MirroredVariables(central=...)``); a copy on the parameter device's
   own physical device shares its storage.
2. ``run(fn)``: fn runs once per compute device, concurrently, each replica seeing its copies
   (``ReplicaView``), replica 0 included.
3. ``optimizer.step()`` inside fn is a merge call: the replicas meet, their gradients are
   summed onto the parameter device (``ReductionToOneDevice`` to it) and the optimizer steps
   once there, on the primaries; each replica's own step then finds no gradient on its copy;
   the replicas meet again and the copies are refreshed from the primaries.

Defaults follow TensorFlow: the compute devices are every GPU (or the CPU), and the parameter
device is the single compute device when there is one, else the CPU.
"""

from __future__ import annotations

import torch

from stratagem.comm.cross_device_ops import ReductionToOneDevice
from stratagem.distribute.devices import LogicalDevice, default_devices, parse_device
from stratagem.distribute.mirrored import MirroredStrategy
from stratagem.distribute.mirrored_variables import MirroredVariables
from stratagem.distribute.strategy import StrategyExtended


class CentralStorageStrategy(MirroredStrategy):
    """``sg.distribute.experimental.CentralStorageStrategy(compute_devices=None,
    parameter_device=None)``."""

    def __init__(
        self,
        compute_devices: list[str | torch.device] | None = None,
        parameter_device: str | torch.device | None = None,
    ) -> None:
        computes = (
            [d.name for d in default_devices()] if compute_devices is None else compute_devices
        )
        parameters = _parameter_device(computes, parameter_device)
        super().__init__(computes, cross_device_ops=ReductionToOneDevice(parameters.torch_device))
        self._parameter_device = parameters
        self._mirrors = MirroredVariables(self._devices, primary_device=parameters.torch_device)
        self._stepping = False

    def __repr__(self) -> str:
        devices = ", ".join(d.name for d in self._devices)
        return (
            f"CentralStorageStrategy(compute_devices=[{devices}], "
            f"parameter_device={self._parameter_device.name})"
        )

    @property
    def extended(self) -> StrategyExtended:
        workers = tuple(d.name for d in self._devices)
        return StrategyExtended(workers, (self._parameter_device.name,), True, True)

    def _placement_device(self) -> torch.device:
        return self._parameter_device.torch_device

    # The update, once, on the parameter device --------------------------------------------

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._stepping:  # the step below, taken from inside this hook
            return

        def reduce_and_update() -> None:
            self._reduce_gradients()
            self._stepping = True
            try:
                optimizer.step()  # on the primaries: this runs outside every replica view
            finally:
                self._stepping = False
            # What follows must find nothing left to apply: the replicas' own steps (they see
            # their copies' gradients, cleared by the reduction) and, outside run, the step
            # this hook precedes, which acts on the primaries themselves.
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None

        self._sync_replicas("optimizer.step()", reduce_and_update)

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._stepping:
            return
        self._sync_replicas("the end of optimizer.step()", self._mirrors.refresh)


def _parameter_device(
    compute_devices: list[str | torch.device], parameter_device: str | torch.device | None
) -> LogicalDevice:
    if parameter_device is not None:
        return parse_device(parameter_device)
    if len(compute_devices) == 1:
        return parse_device(compute_devices[0])
    return LogicalDevice("cpu", torch.device("cpu"))


__all__ = ["CentralStorageStrategy"]
