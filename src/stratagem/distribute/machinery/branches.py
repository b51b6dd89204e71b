"""Independent parts of a model run at once, each on its own device: parallel branches and
ensembles.

``ParallelBranches(a, b, devices=["cuda:0", "cuda:1"])`` is a module whose forward takes one
input per branch and runs branch i on device i, all at once; ``Ensemble(models, devices)`` gives
every model the same batch and averages their predictions. Each branch beyond the first runs in
a thread of its own, joined before forward returns: on CUDA on a stream of its device (the
caller's streams wait for it on the GPU), on logical CPU devices with its share of the intra-op
threads (backward then runs in the caller's thread). Values and gradients are those of running
the branches one after the other; the thread-local state a branch needs (grad mode, its
``sg.device``, the placement log's hook) is carried into its thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from stratagem.distribute.machinery import device_scope, placement_log
from stratagem.distribute.machinery.replica_devices import ReplicaDevice, parse_device
from stratagem.errors import DeviceError


def run_on_devices(
    calls: Sequence[tuple[ReplicaDevice, Callable[[], Any]]],
) -> list[Any]:
    """``fn()`` of each ``(device, fn)``, all at once, each on its device; results in order.

    The first runs in the caller's thread; an exception in any is raised here (the first
    one's, in call order) after every thread has ended.
    """
    grad = torch.is_grad_enabled()
    # The caller's current stream on each GPU, read in the caller's thread (streams are per
    # thread): the branches start after its work and it waits for theirs.
    callers = {
        device.torch_device: torch.cuda.current_stream(device.torch_device)
        for device, _ in calls
        if device.torch_device.type == "cuda"
    }
    # CPU branches share the process's intra-op threads: each computes with its share, so two
    # branches on a 2-core machine use one core each instead of 2 x 2 threads fighting over
    # two cores (OpenMP's thread count is per calling thread; the caller's is restored).
    on_cpu = sum(device.torch_device.type == "cpu" for device, _ in calls)
    threads_each = max(1, torch.get_num_threads() // max(1, on_cpu))
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException | None] = [None] * len(calls)

    def run(i: int) -> None:
        device, fn = calls[i]
        try:
            with (
                _intra_op_threads(threads_each if device.torch_device.type == "cpu" else None),
                torch.set_grad_enabled(grad),
                device_scope.naming(device),
                placement_log.thread_logging(),
                OnDevice(device, callers) as done,
            ):
                results[i] = done(fn())
        except BaseException as exc:  # raised in the caller, with its traceback
            errors[i] = exc

    threads = [
        threading.Thread(target=run, args=(i,), name=f"stratagem-branch-{i}", daemon=True)
        for i in range(1, len(calls))
    ]
    for thread in threads:
        thread.start()
    try:
        run(0)
    finally:
        for thread in threads:
            thread.join()
    for error in errors:
        if error is not None:
            raise error
    return results


@contextlib.contextmanager
def _intra_op_threads(count: int | None) -> Iterator[None]:
    if count is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class OnDevice:
    """Run on a side stream of ``device`` when it is a GPU; ``done(result)`` hands the result
    back to the caller's stream."""

    def __init__(self, device: ReplicaDevice, callers: dict[torch.device, Any]) -> None:
        self.device = device.torch_device
        self.caller = callers.get(self.device)
        self.stream: torch.cuda.Stream | None = None
        self._contexts: list[Any] = []

    def __enter__(self) -> Callable[[Any], Any]:
        if self.device.type != "cuda":
            return lambda result: result
        self.stream = torch.cuda.Stream(self.device)
        self.stream.wait_stream(self.caller)  # inputs made on the caller's stream come first
        for ctx in (torch.cuda.device(self.device), torch.cuda.stream(self.stream)):
            ctx.__enter__()
            self._contexts.append(ctx)
        return self._hand_back

    def _hand_back(self, result: Any) -> Any:
        assert self.stream is not None and self.caller is not None
        self.caller.wait_stream(self.stream)
        for value in _tensors(result):
            if value.is_cuda:
                value.record_stream(self.caller)
        return result

    def __exit__(self, *exc: Any) -> None:
        while self._contexts:
            self._contexts.pop().__exit__(*exc)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def _devices_of(
    modules: Sequence[nn.Module], devices: Sequence[str | torch.device] | None, what: str
) -> list[ReplicaDevice]:
    if devices is None:
        found = [_placed(m) for m in modules]
        missing = [i for i, d in enumerate(found) if d is None]
        if missing:
            raise DeviceError(
                f"{what}: devices=None takes each part's device from the sg.device scope it was "
                f"created in, but part(s) {missing} were created outside any; pass devices=[...]"
            )
        return [d for d in found if d is not None]
    parsed = [parse_device(d) for d in devices]
    if len(parsed) != len(modules):
        raise DeviceError(
            f"{what}: {len(modules)} part(s) but {len(parsed)} device(s) "
            f"{[d.name for d in parsed]}; give one device per part"
        )
    return parsed


def _placed(module: nn.Module) -> ReplicaDevice | None:
    for part in module.modules():
        named = device_scope.module_device(part)
        if named is not None:
            return named
    return None


class ParallelBranches(nn.Module):
    """Branches run at once, branch i on ``devices[i]`` with ``inputs[i]``; returns a tuple of
    their outputs, each on its branch's device. ``devices=None``: where each branch was
    created (``with sg.device(...)``). The branches are moved to their devices."""

    def __init__(
        self, *branches: nn.Module, devices: Sequence[str | torch.device] | None = None
    ) -> None:
        super().__init__()
        if not branches:
            raise ValueError("ParallelBranches needs at least one branch module")
        placed = _devices_of(branches, devices, "ParallelBranches")
        self.branches = nn.ModuleList(b.to(d.torch_device) for b, d in zip(branches, placed))
        self.devices = placed

    def forward(self, *inputs: Any) -> tuple[Any, ...]:
        if len(inputs) != len(self.branches):
            raise ValueError(
                f"ParallelBranches has {len(self.branches)} branches but forward got "
                f"{len(inputs)} input(s); pass one input per branch"
            )
        calls = [
            (device, _call(branch, _to(x, device.torch_device)))
            for branch, device, x in zip(self.branches, self.devices, inputs)
        ]
        return tuple(run_on_devices(calls))


class Ensemble(nn.Module):
    """Every model predicts the same batch at once, each on its device; the mean of their
    outputs, on ``output_device`` (the first model's device by default)."""

    def __init__(
        self,
        models: Sequence[nn.Module],
        devices: Sequence[str | torch.device] | None = None,
        output_device: str | torch.device | None = None,
    ) -> None:
        super().__init__()
        if not models:
            raise ValueError("Ensemble needs at least one model")
        placed = _devices_of(models, devices, "Ensemble")
        self.members = nn.ModuleList(m.to(d.torch_device) for m, d in zip(models, placed))
        self.devices = placed
        out = placed[0] if output_device is None else parse_device(output_device)
        self.output_device = out.torch_device

    def forward(self, x: Any) -> torch.Tensor:
        calls = [
            (device, _call(model, _to(x, device.torch_device)))
            for model, device in zip(self.members, self.devices)
        ]
        outputs = [y.to(self.output_device) for y in run_on_devices(calls)]
        # Summed in member order whatever order they finished in: the same value every time.
        return torch.stack(outputs).mean(dim=0)


def _call(module: nn.Module, x: Any) -> Callable[[], Any]:
    return lambda: module(x)
