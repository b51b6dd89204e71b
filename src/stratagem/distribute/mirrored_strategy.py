"""MirroredStrategy: synchronous training on several devices of one process.

1. Scope: parameters and buffers created inside (a module's, or on their own as TF's
   ``tf.Variable``) live on the first device (the primaries); every other device gets a copy
   (``MirroredVariables``).
2. ``run(fn)``: fn runs once per device, concurrently, replica 0 in the calling thread and the
   others on replica threads that see their copies (``ReplicaView``).
3. ``optimizer.step()`` inside fn is TF's merge call: the replicas meet, every replica's
   gradients are summed into the primaries (the cross-device op), the update is applied once,
   and the copies are refreshed. After ``run``, gradients not yet summed are summed.

Logical CPU devices (``["cpu:0", "cpu:1"]``) are replicas on the shared CPU, each on its own
thread with its share of the intra-op threads; CUDA devices work the same way, with NCCL for
the reduction when available.
"""

from __future__ import annotations

import torch
from typing_extensions import override

from stratagem.comm import LocalCommunicator, ReduceOp
from stratagem.comm.cross_device_ops import CrossDeviceOps, NcclAllReduce, ReductionToOneDevice
from stratagem.comm.process_group import Timeouts
from stratagem.distribute.machinery.mirrored_variables import MirroredVariables
from stratagem.distribute.machinery.replica_devices import (
    ReplicaDevice,
    default_devices,
    parse_devices,
)
from stratagem.distribute.strategy import Strategy
from stratagem.distribute.threaded_replicas import ThreadedReplicas


def _default_cross_device_ops(devices: list[ReplicaDevice]) -> CrossDeviceOps:
    if len(devices) > 1 and all(d.torch_device.type == "cuda" for d in devices):
        return NcclAllReduce()
    return ReductionToOneDevice()


class MirroredStrategy(Strategy):
    """``sg.distribute.MirroredStrategy(devices=None, cross_device_ops=None)``."""

    def __init__(
        self,
        devices: list[str | torch.device] | None = None,
        cross_device_ops: CrossDeviceOps | None = None,
        *,
        gradient_aggregation: ReduceOp | str = ReduceOp.SUM,
    ) -> None:
        super().__init__(
            MirroredExtended(
                self, devices, cross_device_ops, gradient_aggregation=gradient_aggregation
            )
        )


class MirroredExtended(ThreadedReplicas):
    """MirroredStrategy's ``extended``: mirrored variables, replica threads, merge calls."""

    def __init__(
        self,
        container: Strategy,
        devices: list[str | torch.device] | None,
        cross_device_ops: CrossDeviceOps | None,
        *,
        gradient_aggregation: ReduceOp | str = ReduceOp.SUM,
        mirrors_on: torch.device | None = None,
    ) -> None:
        parsed = parse_devices(devices) if devices is not None else default_devices()
        if cross_device_ops is not None and not isinstance(cross_device_ops, CrossDeviceOps):
            raise TypeError(
                "cross_device_ops must be an sg.distribute cross-device op (NcclAllReduce, "
                f"HierarchicalCopyAllReduce, ReductionToOneDevice), got {cross_device_ops!r}"
            )
        super().__init__(
            container,
            parsed,
            comm=LocalCommunicator(),
            cross_device_ops=cross_device_ops or _default_cross_device_ops(parsed),
            gradient_aggregation=gradient_aggregation,
            sync_timeout=Timeouts.operation_from_env(),
        )
        self._cross_device_ops.check_devices(
            [d.torch_device for d in parsed], [d.name for d in parsed]
        )
        # ``mirrors_on``: a device of their own for the primaries (CentralStorageStrategy);
        # every replica then computes on a copy.
        averaged = self.gradient_aggregation is ReduceOp.MEAN
        self._mirrors = MirroredVariables(
            parsed, grad_scale=1 / len(parsed) if averaged else None, primary_device=mirrors_on
        )

    # The mirrored variables --------------------------------------------------------------

    @override
    def capture_variable(self, param: torch.nn.Parameter) -> None:
        # TF mirrors every variable created in the scope, not only a layer's: a parameter on
        # its own is a mirrored variable too, or the replica threads would share it, racing
        # on its ``.grad`` and each stepping it.
        self._keep_variable(param)

    @override
    def adopt(self, tensors: list[tuple[torch.Tensor, bool]]) -> None:
        for tensor, is_parameter in tensors:
            self._mirrors.add(tensor, is_parameter=is_parameter)

    @override
    def _replica_view(self, replica: int) -> dict[int, torch.Tensor]:
        return self._mirrors.view(replica)

    # Around run ----------------------------------------------------------------------------

    @override
    def _before_run(self) -> None:
        self._mirrors.refresh()
        self._mirrors.scaling = True

    @override
    def _leave_run(self) -> None:
        self._mirrors.scaling = False

    @override
    def _after_run(self) -> None:
        # Not after a run that accumulated (``accumulate_gradients``): the next run or step
        # sums everything the replicas hold, once.
        if self._mirrors.pending_gradients() and not self._deferred_in_run():
            self._reduce_gradients()

    def _reduce_gradients(self) -> None:
        self._mirrors.reduce_gradients(self._cross_device_ops)

    @override
    def reduce_pending_gradients(self) -> None:
        if self._mirrors.pending_gradients():
            self._reduce_gradients()

    # The merge call around optimizer.step() ------------------------------------------------

    @override
    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.merge_call("optimizer.step()", self._reduce_gradients)
        # The other replicas' steps find no gradient and wait: lend replica 0 their threads.
        self.lend_threads(to_replica_zero=True)

    @override
    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.lend_threads(to_replica_zero=False)
        self.merge_call("the end of optimizer.step()", self._mirrors.refresh)
