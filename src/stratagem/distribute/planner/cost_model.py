"""The planner's cost model: per-device memory and bytes sent per step, from ``ModelFacts``.

Pure arithmetic (no torch), so that thousands of cases are priced in a moment. Every figure is
per device, in bytes, for one training step on a global batch of ``world`` example batches:

- memory: parameters + buffers + optimizer state, then the larger of two phases: the end of
  forward (activations saved for backward, and whatever the strategy keeps gathered) and the
  optimizer step (gradients and the optimizer's temporaries); MWMS and FSDP take the largest
  moment of a step, backward's among them (the gradient flowing back through the layers);
- communication: bytes each device sends, ring algorithms: an all-reduce of n bytes over k
  devices sends 2(k-1)/k n, an all-gather or reduce-scatter (k-1)/k n; a pipeline stage sends
  its boundary activations forward and their gradients back, once per micro-batch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from stratagem.distribute.planner.fsdp_timeline import fsdp_peak
from stratagem.distribute.planner.model_trace import LayerFacts, ModelFacts

# Optimizer state kept per trainable parameter, in parameter-sized slots.
OPTIMIZER_SLOTS = {"sgd": 0, "momentum": 1, "adagrad": 1, "rmsprop": 1, "adam": 2, "adamw": 2}


@dataclass(frozen=True)
class Memory:
    """One device's memory at its peak, by what holds it."""

    params: int
    grads: int
    optimizer: int
    activations: int  # with the example batch, which the training loop holds
    gathered: int  # parameters and gradients a sharded strategy holds whole for a while
    temporary: int  # the optimizer step's scratch tensors
    buffers: int = 0  # communication buffers kept from step to step
    # The fields are what is alive at one moment of a replayed step (``fsdp_timeline``), so
    # the peak is their sum, rather than the larger of the two phases below.
    one_moment: bool = False

    @property
    def peak(self) -> int:
        if self.one_moment:
            return (
                self.params
                + self.grads
                + self.optimizer
                + self.activations
                + self.gathered
                + self.temporary
                + self.buffers
            )
        at_backward = self.activations + self.gathered
        at_step = self.grads + self.temporary
        return self.params + self.optimizer + self.buffers + max(at_backward, at_step)


def allreduce(n: float, k: int) -> float:
    return 2 * (k - 1) / k * n


def allgather(n: float, k: int) -> float:
    return (k - 1) / k * n


def _memory(
    f: ModelFacts, params: float, slots: int, activations: float, gathered: float
) -> Memory:
    share = params / f.param_bytes if f.param_bytes else 0.0
    grads = f.trainable_bytes * share
    return Memory(
        params=int(params + f.buffer_bytes),
        grads=int(grads),
        optimizer=int(slots * grads),
        activations=int(activations),
        gathered=int(gathered),
        # The optimizer updates one parameter at a time (torch's default on CPU): two scratch
        # tensors the size of the largest parameter (of its shard) at most.
        temporary=int(2 * min(f.largest_param_bytes, grads)),
    )


def backward_moment(f: ModelFacts) -> tuple[int, int]:
    """The largest moment of backward as (activations, parameter gradients): walking the
    layers last to first, each one's backward holds the activations saved up to it, the
    gradient of its output, the gradient of its input it makes, and the parameter gradients
    made so far (the layers after it and its own)."""
    share = f.trainable_bytes / f.param_bytes if f.param_bytes else 0.0
    saved = f.activation_bytes - f.post.saved_bytes
    made = f.post.param_bytes * share
    flowing = 0  # the gradient of the current layer's output
    best = (f.activation_bytes, int(made))
    for layer in reversed(f.layers):
        made += layer.param_bytes * share
        moment = (saved + flowing + layer.grad_bytes, int(made))
        if sum(moment) > sum(best):
            best = moment
        saved -= layer.saved_bytes
        # A layer that makes no gradient of its input returns a view of it (its output's
        # gradient flows on) or is the first to need none (nothing flows on that matters).
        flowing = layer.grad_bytes or flowing
    return best


def mirrored(f: ModelFacts, world: int, slots: int) -> tuple[Memory, float]:
    """MultiWorkerMirroredStrategy: everything whole; gradients copied into buckets that it
    keeps (``comm.bucketing``) and all-reduced there. The peak is the largest of three
    moments: the end of forward, the largest moment of backward, the optimizer step."""
    memory = _memory(f, f.param_bytes, slots, f.activation_bytes, 0)
    activations, made = backward_moment(f)
    moments = [
        (f.activation_bytes + f.batch_bytes, 0, 0),
        (activations + f.batch_bytes, made, 0),
        (f.batch_bytes, memory.grads, memory.temporary),
    ]
    activations, grads, temporary = max(moments, key=sum)
    memory = replace(
        memory,
        activations=activations,
        grads=grads,
        temporary=temporary,
        buffers=memory.grads if world > 1 else 0,
        one_moment=True,
    )
    return memory, allreduce(f.trainable_bytes, world)


def sharded(
    f: ModelFacts, shard: int, replicate: int, slots: int, reshard: bool
) -> tuple[Memory, float]:
    """FSDP over ``shard`` devices (ZeRO-3 when ``reshard``, else ZeRO-2), times ``replicate``
    (HSDP): the peak of a step replayed buffer by buffer (``fsdp_timeline``)."""
    live = fsdp_peak(f, shard, slots, reshard)
    memory = Memory(
        params=live.get("params", 0),
        grads=live.get("grads", 0),
        optimizer=live.get("optimizer", 0),
        activations=live.get("activations", 0),
        gathered=live.get("gathered", 0),
        temporary=live.get("temporary", 0),
        buffers=live.get("buffers", 0),
        one_moment=True,
    )
    gathers = 2 if reshard else 1
    sent = gathers * allgather(f.param_bytes, shard) + allgather(f.trainable_bytes, shard)
    sent += allreduce(f.trainable_bytes / shard, replicate)
    return memory, sent


def megatron_mesh(f: ModelFacts, data: int, model: int, slots: int) -> tuple[Memory, float]:
    """A (data, model) mesh, Megatron's projections split over ``model``: each group of
    ``model`` devices runs one replica on ``model`` example batches; activations saved from a
    column-wise projection's output to a row-wise one's are split too, the others (norms,
    residuals, embeddings, the head) are whole on each device."""
    params = f.megatron_bytes / model + (f.param_bytes - f.megatron_bytes)
    whole = (f.activation_bytes - f.megatron_sharded_saved_bytes) * model
    activations = whole + f.megatron_sharded_saved_bytes
    memory = _memory(f, params, slots, activations, 0)
    # forward: the row-wise outputs; backward: the column-wise inputs' gradients, as large.
    sent = 2 * allreduce(f.megatron_allreduce_bytes * model, model)
    sent += allreduce(memory.grads, data)
    return memory, sent


def stage_pieces(f: ModelFacts, split_points: list[int]) -> list[list[LayerFacts]]:
    """The layers of each stage (the pieces before and after the layers join the first and
    last stage) for split points given as layer indices."""
    bounds = [0, *split_points, len(f.layers)]
    stages = [list(f.layers[a:b]) for a, b in itertools.pairwise(bounds)]
    stages[0].insert(0, f.pre)
    stages[-1].append(f.post)
    return stages


def pipeline(
    f: ModelFacts, stages: int, replicas: int, slots: int, split_points: list[int]
) -> tuple[Memory, float, list[Memory]]:
    """1F1B over ``stages`` stages, ``stages`` micro-batches of one example batch each per
    replica: stage k holds the activations of ``stages - k`` micro-batches at once."""
    worst: Memory | None = None
    most_sent = 0.0
    memories = []
    pieces = stage_pieces(f, split_points)
    for k, layers in enumerate(pieces):
        params = sum(x.param_bytes for x in layers)
        activations = (stages - k) * sum(x.saved_bytes for x in layers)
        memory = _memory(f, params, slots, activations, 0)
        memories.append(memory)
        out = pieces[k + 1][0].input_bytes if k + 1 < stages else 0
        back = layers[0].input_bytes if k > 0 else 0
        sent = stages * (out + back) + allreduce(memory.grads, replicas)
        most_sent = max(most_sent, sent)
        if worst is None or memory.peak > worst.peak:
            worst = memory
    assert worst is not None
    return worst, most_sent, memories
