"""What scope does for a strategy that distributes whole models, not tensors one by one:
FullyShardedStrategy shards a model into FSDP units, MeshStrategy lays it out by a LayoutMap.
Both need a model's parameter paths, known only once the model is whole; this is their shared
placement, written once.

1. Each scope entry records the modules built in it (``CreatedModules``) and distributes the
   outermost ones (the models) when it ends, or at a step inside the scope (TF's tutorials
   train there) when something was built since.
2. Parameters registered meanwhile are claimed at once, so that an optimizer created in the
   scope over these soon-replaced tensors is the strategy's, and at its first step it is
   pointed at their replacements (``repoint_optimizer``).
3. A strategy says how a model is distributed (``distribute_whole``: in place, again a no-op)
   and which of its tensors it owns afterwards (``owns_after``).
"""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary
from typing_extensions import override

from stratagem.distribute.extended import StrategyExtended
from stratagem.distribute.machinery import scope_hooks
from stratagem.distribute.machinery.replaced_parameters import repoint_optimizer
from stratagem.dtensor.layout_map import CreatedModules


class WholeModulesExtended(StrategyExtended):
    """Placement for a strategy that distributes whole models (see the module)."""

    # Whether buffers registered in scope are claimed then (FSDP shards them with the model;
    # a mesh replicates them, and owns only what it lays out).
    claims_buffers_in_scope = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._recording: list[CreatedModules] = []  # one per scope entered, innermost last
        # old parameter -> its replacement (for optimizers made over the old ones)
        self._replaced: WeakIdKeyDictionary = WeakIdKeyDictionary()

    @abstractmethod
    def distribute_whole(self, module: torch.nn.Module) -> None:
        """Distribute ``module`` in place (a second call is a no-op), replacing its parameters
        through ``replacing_parameters`` so that optimizers follow."""

    def owns_after(self, tensor: torch.Tensor) -> bool:
        """Whether a tensor of a distributed model is this strategy's (all by default)."""
        return True

    @contextlib.contextmanager
    def replacing_parameters(self, module: torch.nn.Module) -> Iterator[None]:
        """Around a change of ``module``'s parameters: remember which replaced which, and claim
        what the strategy owns afterwards."""
        before = dict(module.named_parameters(remove_duplicate=False))
        yield
        for path, new in module.named_parameters(remove_duplicate=False):
            old = before.get(path)
            if old is not None and old is not new:
                self._replaced[old] = new
        self.claim_module(module)

    def claim_module(self, module: torch.nn.Module) -> None:
        for t in [*module.parameters(), *module.buffers()]:
            if self.owns_after(t) and scope_hooks.owner_of(t) is None:
                scope_hooks.claim(t, self.strategy)

    def repoint(self, optimizer: torch.optim.Optimizer, *, what_happened: str, remedy: str) -> None:
        """Point an optimizer made before the model was distributed at the replacements."""
        repoint_optimizer(optimizer, self._replaced, what_happened=what_happened, remedy=remedy)

    # ------------------------------------------------------------------ placement

    @override
    @contextlib.contextmanager
    def in_scope(self) -> Iterator[None]:
        with CreatedModules() as created:
            self._recording.append(created)
            try:
                yield
            finally:
                self._recording.remove(created)
        for module in created.roots():
            self.distribute_whole(module)

    @override
    def capture_parameter(
        self, module: torch.nn.Module, name: str, param: torch.nn.Parameter
    ) -> torch.nn.Parameter | None:
        # Distributed with its model later; claimed now (see the module).
        scope_hooks.claim(param, self.strategy)
        return None

    @override
    def capture_buffer(
        self, module: torch.nn.Module, name: str, buffer: torch.Tensor
    ) -> torch.Tensor | None:
        if self.claims_buffers_in_scope:
            scope_hooks.claim(buffer, self.strategy)
        return None

    @override
    def adopt(self, tensors: list[tuple[torch.Tensor, bool]]) -> None:
        """Nothing tensor by tensor: the scopes' exits distribute whole models (``in_scope``)."""

    @override
    def adopt_captured(self) -> None:
        pass  # the scopes' exits have distributed everything (in_scope)

    @override
    def adopt_pending(self) -> None:
        # A step inside the scope: distribute the models built so far, as the scope's end
        # would; nothing to do at later steps until a module changes.
        for created in self._recording:
            for module in created.changed_roots():
                self.distribute_whole(module)

    @override
    def adopt_model(self, module: torch.nn.Module) -> None:
        self.distribute_whole(module)

    @override
    def distribute_module(self, module: torch.nn.Module) -> torch.nn.Module:
        self.distribute_whole(module)
        return module
