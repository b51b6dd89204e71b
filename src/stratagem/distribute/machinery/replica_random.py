"""Random draws of replica threads, reproducible given ``torch.manual_seed``.

At each ``run``, the calling thread draws one seed per other CPU replica from the default
generator (so ``torch.manual_seed`` fixes them, and each step gets fresh ones), and each such
replica draws from its own ``torch.Generator`` with that seed: a ``TorchDispatchMode``
(``ReplicaRandom``) hands it to every random CPU operation that was given no generator,
``dropout``'s ``bernoulli_`` included. Replica 0, in the calling thread, keeps the default
generator, as a single-device program does. CUDA replicas need none of this: each device has
its own default generator.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# OpOverload -> the overload to call with a generator (itself, or its ``generator`` sibling,
# as ``rand.generator`` for ``rand``), or None for operations that draw nothing; once each.
_with_generator: dict[Any, Any] = {}


def _generator_overload(func: Any) -> Any:
    if any(a.name == "generator" for a in func._schema.arguments):
        return func
    name = func._overloadname
    packet = func.overloadpacket
    for sibling in ("generator" if name == "default" else f"{name}_generator", f"generator_{name}"):
        if sibling in packet.overloads():
            return getattr(packet, sibling)
    return None


class ReplicaRandom(TorchDispatchMode):
    """Give this thread's random CPU operations ``generator`` where they were given none."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.generator = generator

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Otherwise torch.compile skips every frame while the mode is on (it would have to
        # pass each compiled operation through it): compiled code runs as compiled, with
        # the mode on again only around it. Random operations fused into compiled code are out
        # of its reach: torch.compile makes its own random numbers anyway.
        return True

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func not in _with_generator:
            _with_generator[func] = _generator_overload(func)
        drawing = _with_generator[func]
        if (
            drawing is not None
            and kwargs.get("generator") is None
            and _device(args, kwargs).type == "cpu"
        ):
            return drawing(*args, **{**kwargs, "generator": self.generator})
        return func(*args, **kwargs)


def _device(args: tuple, kwargs: dict) -> torch.device:
    # A factory (torch.rand) names its device or takes the default; others act on a tensor.
    if kwargs.get("device") is not None:
        return torch.device(kwargs["device"])
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.get_default_device()


def replica_generators(devices: list[torch.device]) -> list[torch.Generator | None]:
    """One generator per replica that would share the default CPU generator with replica 0
    (None for replica 0 and for replicas with a device generator of their own), seeded from
    the default generator: called in the calling thread, before the replicas start."""
    generators: list[torch.Generator | None] = [None]
    for device in devices[1:]:
        if device.type != "cpu":
            generators.append(None)
            continue
        seed = int(torch.randint(2**62, (), dtype=torch.int64))
        generators.append(torch.Generator().manual_seed(seed))
    return generators
