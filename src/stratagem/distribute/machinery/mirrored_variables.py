"""Mirrored variables of one process: a primary tensor and one copy per other local replica.

The primary is the tensor the model holds (replica 0 computes on it; the optimizer updates it);
replica i > 0 computes on its copy, seen through ``ReplicaView``. With ``central=True``
(CentralStorageStrategy) the primary lives on a parameter device and every replica computes on
a copy. A parameter copy on the primary's physical device shares its storage (a separate leaf
with its own ``.grad``); other copies, and every buffer copy, are overwritten from the primary
at every refresh, so the primary's values win. After backward the replicas' gradients are
summed into the primary's ``.grad`` by the strategy's cross-device op and the copies' cleared,
so several backward passes before a step accumulate exactly; under PyTorch's mean convention
(``grad_scale=1/n``) each replica's gradient is scaled as it arrives.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from stratagem.comm.cross_device_ops import CrossDeviceOps
from stratagem.comm.reduce_op import ReduceOp
from stratagem.distribute.machinery.replica_devices import ReplicaDevice
from stratagem.distribute.machinery.replica_threads import MIRROR_KEY


@dataclass
class _Mirror:
    primary: weakref.ref
    copies: list[torch.Tensor]  # one per replica with copies (1..n-1, or all when central)
    shared: list[bool]


class MirroredVariables:
    """The mirrored parameters and buffers of one strategy, and their replica copies."""

    def __init__(
        self,
        devices: list[ReplicaDevice],
        *,
        grad_scale: float | None = None,
        primary_device: torch.device | None = None,
    ) -> None:
        self.devices = devices
        self.grad_scale = grad_scale
        self.scaling = False  # set by the strategy while replicas run
        # Where primaries live; replicas from ``_first_copy`` on compute on copies.
        self.primary_device = primary_device or devices[0].torch_device
        self._first_copy = 1 if primary_device is None else 0
        self._copy_devices = devices[self._first_copy :]
        self._mirrors: dict[int, _Mirror] = {}
        # One id → copy map per replica with copies: what ReplicaView swaps in its thread.
        self._views: list[dict[int, torch.Tensor]] = [{} for _ in self._copy_devices]

    def __len__(self) -> int:
        return len(self._mirrors)

    def view(self, replica: int) -> dict[int, torch.Tensor]:
        """The copies replica ``replica`` computes on (empty: it computes on the primaries)."""
        if replica < self._first_copy:
            return {}
        return self._views[replica - self._first_copy]

    def add(self, tensor: torch.Tensor, *, is_parameter: bool) -> None:
        key = id(tensor)
        if key in self._mirrors:
            return
        copies, shared = [], []
        for d in self._copy_devices:
            same_storage = is_parameter and d.torch_device == tensor.device
            copies.append(self._make_copy(tensor, d.torch_device, same_storage))
            shared.append(same_storage)
        self._mirrors[key] = _Mirror(weakref.ref(tensor), copies, shared)
        setattr(tensor, MIRROR_KEY, key)
        if is_parameter:
            for leaf in (tensor, *copies):
                self._scale_gradients_of(leaf)
        for view, c in zip(self._views, copies):
            view[key] = c
        # Drop the entry when the primary dies, before its id can be reused.
        weakref.finalize(tensor, self._forget, key)

    def _scale_gradients_of(self, leaf: torch.Tensor) -> None:
        if self.grad_scale is not None and leaf.requires_grad:
            leaf.register_hook(self._scale)

    def _scale(self, grad: torch.Tensor) -> torch.Tensor | None:
        return grad * self.grad_scale if self.scaling else None

    def _forget(self, key: int) -> None:
        self._mirrors.pop(key, None)
        for view in self._views:
            view.pop(key, None)

    @staticmethod
    def _make_copy(tensor: torch.Tensor, device: torch.device, shared: bool) -> torch.Tensor:
        with torch.no_grad():
            copy = tensor.detach() if shared else tensor.detach().to(device, copy=True)
        return copy.requires_grad_(tensor.requires_grad)

    def refresh(self) -> None:
        """Bring every copy up to date with its primary (shared-storage copies cost nothing)."""
        with torch.no_grad():
            for key, m in list(self._mirrors.items()):
                primary = m.primary()
                if primary is None:
                    continue
                for i, copy in enumerate(m.copies):
                    if copy.requires_grad != primary.requires_grad:
                        copy.requires_grad_(primary.requires_grad)
                    if m.shared[i]:
                        if copy.data_ptr() != primary.data_ptr() or copy.shape != primary.shape:
                            # The primary's storage was replaced (``p.data = ...``): re-share.
                            self._replace(key, m, i, primary, True)
                        continue
                    if copy.shape != primary.shape or copy.dtype != primary.dtype:
                        self._replace(key, m, i, primary, False)
                    else:
                        copy.copy_(primary)

    def _replace(self, key: int, m: _Mirror, i: int, primary: torch.Tensor, shared: bool) -> None:
        copy = self._make_copy(primary, self._copy_devices[i].torch_device, shared)
        self._scale_gradients_of(copy)
        m.copies[i] = copy
        self._views[i][key] = copy

    def pending_gradients(self) -> bool:
        """Whether some replica copy holds a gradient not yet summed into its primary."""
        return any(c.grad is not None for m in list(self._mirrors.values()) for c in m.copies)

    def reduce_gradients(self, ops: CrossDeviceOps) -> None:
        """Add every replica copy's gradient into its primary's ``.grad``; clear the copies'.

        Copies on the primary's own physical device (logical CPU devices) are added in place:
        there is nothing to transfer, so packing them for a cross-device op would only copy
        memory. Copies on other devices go through the strategy's cross-device op.
        """
        if not self._copy_devices:
            return  # the primary's gradient is already the only one
        remote_lists, remote_targets = [], []
        with torch.no_grad():
            # A snapshot: a primary that dies meanwhile (garbage collection, in any thread) is
            # forgotten through its finalizer, which changes the dict under an iteration.
            for m in list(self._mirrors.values()):
                primary = m.primary()
                if primary is None:
                    continue
                grads = [c.grad for c in m.copies]
                if all(g is None for g in grads):
                    continue
                if all(g is None or g.device == primary.device for g in grads):
                    total = primary.grad
                    for g in grads:
                        if g is not None:
                            total = g.clone() if total is None else total.add_(g)
                    primary.grad = total
                else:
                    # A replica that produced no gradient (did not use the parameter) adds zeros.
                    remote_lists.append(
                        [
                            g if g is not None else torch.zeros_like(primary, device=like.device)
                            for g, like in zip([primary.grad, *grads], [primary, *m.copies])
                        ]
                    )
                    remote_targets.append(primary)
                for c in m.copies:
                    c.grad = None
            if remote_targets:
                reduced = ops.batch_reduce(ReduceOp.SUM, remote_lists, self.primary_device)
                for primary, total in zip(remote_targets, reduced):
                    if primary.grad is None:
                        primary.grad = total.clone()
                    else:
                        primary.grad.copy_(total)
