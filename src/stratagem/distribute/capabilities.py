"""What a strategy may opt into beyond the core contract (``StrategyExtended``).

A capability is something only some strategies do; a strategy opts in by deriving from it, and
code that needs it asks ``isinstance(strategy.extended, Capability)``, never which strategy it is.

- ``MergesReplicas`` (Mirrored, CentralStorage, through ``ThreadedReplicas``): local replicas
  that run at once and meet at ``merge_call``.
- ``DefersGradients`` (MultiWorkerMirrored, FullySharded, Mesh, Pipeline): gradients combined
  during backward, held back inside ``accumulate_gradients`` (or refused, saying why).
- ``PipelinedSteps`` (Pipeline): stages instead of replicas; Keras runs its pipelined steps
  instead of ``run``.
- ``ChiefCoordination`` (ParameterServer): TF2's coordinator on the chief
  (``extended.coordinator_seam``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from stratagem.distribute.machinery.context import ReplicaContext


class MergesReplicas(ABC):
    """Local replicas that run at once (threads) and meet: inside ``run``, ``merge_call``
    waits for every local replica and runs the action once (TF's merge call)."""

    @abstractmethod
    def merge_replicas(self, ctx: ReplicaContext, what: str, action: Callable[[], None]) -> None:
        """Called by ``merge_call`` in replica ``ctx`` when there are several local replicas:
        meet the others at ``what``; one of them runs ``action``, seeing the primaries."""

    def reduce_pending_gradients(self) -> None:
        """Sum what the local replicas' gradients hold that is not summed yet, before a merged
        call that reads them (``GradScaler.unscale_``); nothing by default."""


class DefersGradients(ABC):
    """Gradients combined during backward (hooks, buckets, a reduce-scatter), so
    ``accumulate_gradients`` must tell the strategy to hold them back. Without this capability
    a strategy combines gradients at the optimizer step, and there is nothing to defer."""

    @abstractmethod
    def defer_gradient_reduction(self, defer: bool) -> None:
        """Where ``accumulate_gradients`` begins (True) and ends (False): stop and resume
        combining gradients during backward; a strategy that cannot raises here, saying why."""


class PipelinedSteps(ABC):
    """A pipeline: processes hold stages of one model, not replicas of it. ``run``, ``reduce``,
    ``gather`` and ``distribute_datasets_from_function`` are refused (``replica_steps_refused``
    says how to train instead); Keras cuts the model with ``pipeline`` and runs its own
    pipelined steps."""

    @property
    @abstractmethod
    def num_microbatches(self) -> int:
        """Micro-batches per global batch."""

    @abstractmethod
    def pipeline(self, module: nn.Module, loss_fn: Any, sample_input: Any = None) -> Any:
        """This process's stages of ``module`` (a ``pipeline.stages.PipelineModel``)."""

    @abstractmethod
    def register_whole_model(self, module: nn.Module, pipe: Any) -> None:
        """Checkpoints of ``module`` (kept whole on every process) gather every stage first."""

    @abstractmethod
    def replica_steps_refused(self, what: str) -> str:
        """The message refusing ``what`` (``"run"``, ``"reduce"``...): how to train instead."""


class ChiefCoordination(ABC):
    """TF2's parameter-server training: the chief coordinates, the workers serve it."""

    @property
    @abstractmethod
    def coordinating(self) -> bool:
        """Whether this process is the chief of a cluster with a chief (it schedules)."""

    @property
    @abstractmethod
    def coordinator_seam(self) -> Any:
        """What the coordinator (and its worker tasks) use of the strategy."""
