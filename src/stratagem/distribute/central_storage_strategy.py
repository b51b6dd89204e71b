"""CentralStorageStrategy: one process; parameters on one device, replicas compute on others.

1. Scope: parameters and buffers created inside, and the optimizer state the update creates,
   live on the ``parameter_device`` (the primaries); every compute device gets a copy
   (``MirroredVariables(central=...)``), sharing storage on the parameter device's own device.
2. ``run(fn)``: fn runs once per compute device, concurrently, each replica seeing its copies
   (``ReplicaView``), replica 0 included.
3. ``optimizer.step()`` inside fn is a merge call: the replicas' gradients are summed onto the
   parameter device (``ReductionToOneDevice``), the optimizer steps once there, on the
   primaries, and the replicas meet again to refresh their copies.

Defaults follow TensorFlow: the compute devices are every GPU (or the CPU), and the parameter
device is the single compute device when there is one, else the CPU.
"""

from __future__ import annotations

import torch
from typing_extensions import override

from stratagem.comm.cross_device_ops import ReductionToOneDevice
from stratagem.distribute.machinery.replica_devices import (
    ReplicaDevice,
    default_devices,
    parse_device,
)
from stratagem.distribute.mirrored_strategy import MirroredExtended
from stratagem.distribute.strategy import Strategy


class CentralStorageStrategy(Strategy):
    """``sg.distribute.experimental.CentralStorageStrategy(compute_devices=None,
    parameter_device=None)``."""

    def __init__(
        self,
        compute_devices: list[str | torch.device] | None = None,
        parameter_device: str | torch.device | None = None,
    ) -> None:
        super().__init__(CentralStorageExtended(self, compute_devices, parameter_device))

    def __repr__(self) -> str:
        return (
            f"CentralStorageStrategy(compute_devices=[{', '.join(self.extended.worker_devices)}]"
            f", parameter_device={self.extended.parameter_devices[0]})"
        )


class CentralStorageExtended(MirroredExtended):
    """Mirrored replicas whose primaries, and the update, live on the parameter device."""

    def __init__(
        self,
        container: Strategy,
        compute_devices: list[str | torch.device] | None,
        parameter_device: str | torch.device | None,
    ) -> None:
        # TF's default (local_devices_from_num_gpus): every GPU, or the one CPU; logical CPU
        # devices count only when named.
        defaults = [d.name for d in default_devices() if d.torch_device.type == "cuda"]
        computes = (defaults or ["cpu:0"]) if compute_devices is None else compute_devices
        parameters = _parameter_device(computes, parameter_device)
        super().__init__(
            container,
            computes,
            ReductionToOneDevice(parameters.torch_device),
            mirrors_on=parameters.torch_device,
        )
        self._parameter_device = parameters
        self._stepping = False

    @property
    @override
    def parameter_devices(self) -> tuple[str, ...]:
        return (self._parameter_device.name,)

    @property
    @override
    def _placement_device(self) -> torch.device:
        return self._parameter_device.torch_device

    # The update, once, on the parameter device --------------------------------------------

    @override
    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
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

        self.merge_call("optimizer.step()", reduce_and_update)

    @override
    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._stepping:
            return
        self.merge_call("the end of optimizer.step()", self._mirrors.refresh)


def _parameter_device(
    compute_devices: list[str | torch.device], parameter_device: str | torch.device | None
) -> ReplicaDevice:
    if parameter_device is not None:
        return parse_device(parameter_device)
    if len(compute_devices) == 1:
        return parse_device(compute_devices[0])
    return ReplicaDevice("cpu", torch.device("cpu"))


__all__ = ["CentralStorageStrategy"]
