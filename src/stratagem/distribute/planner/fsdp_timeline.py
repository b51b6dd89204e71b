"""The memory peak of one FSDP2 training step, replayed buffer by buffer from ``ModelFacts``.

``fsdp_peak(facts, shard, slots, reshard)`` walks two training steps of ``fully_shard`` units
(each pipeline layer a unit, the root holding the rest, as ``choose.build_strategy`` wraps
them) in the order torch 2.13's ``torch/distributed/fsdp/_fully_shard/`` allocates and frees
(all-gathers, backward prefetch, reduce-scatters, the buffers FSDP and
``FullyShardedStrategy`` hold after a collective), and returns ``Memory`` at the moment of the
largest sum of live buffers. Pure arithmetic; each step below names the torch code it mirrors.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from stratagem.distribute.planner.model_trace import ModelFacts

# FullyShardedStrategy keeps the Work, output and input of FSDP's last 4 collectives
# (``FullyShardedExtended._held_works``, a deque of this length).
HELD_COLLECTIVES = 4


@dataclass
class _Heap:
    """Buffers alive while something holds them; the peak of their sum, by kind."""

    sizes: dict[str, int] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    holders: dict[str, set[str]] = field(default_factory=dict)
    peak: int = 0
    at_peak: dict[str, int] = field(default_factory=dict)
    counter: int = 0

    def alloc(self, size: float, kind: str, holder: str) -> str:
        self.counter += 1
        name = f"{kind}{self.counter}"
        self.sizes[name], self.kinds[name], self.holders[name] = int(size), kind, {holder}
        self.check()
        return name

    def hold(self, name: str, holder: str) -> None:
        self.holders[name].add(holder)

    def release(self, name: str | None, holder: str) -> None:
        if name is None or name not in self.holders:
            return
        self.holders[name].discard(holder)
        if not self.holders[name]:
            del self.sizes[name], self.kinds[name], self.holders[name]

    def check(self, transient: float = 0, kind: str = "gathered") -> None:
        """Record the peak, with ``transient`` bytes of ``kind`` alive for a moment."""
        live = sum(self.sizes.values()) + int(transient)
        if live > self.peak:
            self.peak = live
            by_kind: dict[str, int] = {}
            for name, size in self.sizes.items():
                by_kind[self.kinds[name]] = by_kind.get(self.kinds[name], 0) + size
            by_kind[kind] = by_kind.get(kind, 0) + int(transient)
            self.at_peak = by_kind


@dataclass
class _Unit:
    name: str
    param_bytes: int
    saved_bytes: int
    grad_bytes: int = 0  # the gradient of its input its backward makes


class _Step:
    """Two training steps of FSDP2 over ``units`` (the root first) on ``shard`` devices."""

    def __init__(
        self, facts: ModelFacts, units: list[_Unit], shard: int, slots: int, reshard: bool
    ):
        self.f, self.units, self.shard, self.reshard = facts, units, shard, reshard
        self.heap = _Heap()
        self.held: deque[list[str]] = deque()
        self.grads: list[str] = []
        self.gathered: dict[str, str] = {}
        self.pending: dict[str, str] = {}
        self.rs_state: str | None = None
        self.activations: list[str] = []
        share = facts.trainable_bytes / facts.param_bytes if facts.param_bytes else 0.0
        self.heap.alloc(facts.param_bytes / shard + facts.buffer_bytes, "params", "model")
        self.heap.alloc(slots * facts.param_bytes * share / shard, "optimizer", "model")
        self.heap.alloc(facts.batch_bytes, "activations", "loop")  # the batch, held all step

    def _hold_collective(self, buffers: list[str]) -> None:
        # _HeldAllGather/_HeldReduceScatter append (work, output, input) after the collective:
        # the oldest entry, and what only it held, goes when a fifth comes.
        for name in buffers:
            self.heap.hold(name, "held")
        self.held.append(buffers)
        if len(self.held) > HELD_COLLECTIVES:
            for name in self.held.popleft():
                self.heap.release(name, "held")

    def all_gather(self, unit: _Unit) -> None:
        if not unit.param_bytes:
            return  # fully_shard makes no param group, so no collective, for a unit without any
        # foreach_all_gather (_fsdp_collectives.py): one flat output of the whole unit, its
        # input a view into it (all_gather_copy_in); gloo's all_gather_into_tensor copies
        # through a scratch tensor of the output's size while it runs.
        out = self.heap.alloc(unit.param_bytes, "buffers", "pending")
        self.heap.check(transient=unit.param_bytes)
        self._hold_collective([out])
        self.pending[unit.name] = out

    def wait_for_unshard(self, unit: _Unit) -> None:
        # FSDPParamGroup.wait_for_unshard: foreach_all_gather_copy_out allocates the unsharded
        # parameters (alloc_storage) and drops the all-gather result.
        if unit.name in self.gathered or not unit.param_bytes:
            return
        if unit.name not in self.pending:
            self.all_gather(unit)
        self.gathered[unit.name] = self.heap.alloc(unit.param_bytes, "gathered", "fsdp")
        self.heap.release(self.pending.pop(unit.name), "pending")

    def free_unsharded(self, unit: _Unit) -> None:
        # FSDPParamGroup.reshard: free_storage of the unsharded parameters.
        name = self.gathered.pop(unit.name, None)
        self.heap.release(name, "fsdp")

    def reduce_scatter(self, unit: _Unit, unsharded_grad: str) -> None:
        # FSDPParamGroup.post_backward: first drop the previous reduce-scatter input it kept
        # (comm_ctx.reduce_scatter_states, at most reduce_scatter_max_input_buffers = 1);
        # foreach_reduce: a flat input of the whole unit's gradients (copied in, then the
        # unsharded gradients freed) and an output of the shard, which the sharded gradients
        # view; gloo's reduce_scatter_tensor works in a scratch tensor of the input's size.
        if not unit.param_bytes:
            self.heap.release(unsharded_grad, "autograd")
            return
        self.heap.release(self.rs_state, "rs_state")
        rs_in = self.heap.alloc(unit.param_bytes, "buffers", "rs_state")
        self.heap.release(unsharded_grad, "autograd")
        rs_out = self.heap.alloc(unit.param_bytes / self.shard, "grads", "grad")
        self.heap.check(transient=unit.param_bytes)
        self._hold_collective([rs_in, rs_out])
        self.rs_state = rs_in
        self.grads.append(rs_out)

    def step(self) -> None:
        root, layers = self.units[0], self.units[1:]
        # optimizer.zero_grad(): the sharded gradients go (the held collectives may keep some).
        for g in self.grads:
            self.heap.release(g, "grad")
        self.grads = []
        # Forward: each unit's pre_forward unshards it, post_forward reshards it (the root,
        # reshard_after_forward=None, stays unsharded until its post_backward); ZeRO-2
        # (reshard_after_forward=False) keeps every unit unsharded until backward's end.
        self.wait_for_unshard(root)
        self._save(self.f.pre.saved_bytes)
        for unit in layers:
            self.wait_for_unshard(unit)
            self._save(unit.saved_bytes)
            if self.reshard:
                self.free_unsharded(unit)
        self._save(self.f.post.saved_bytes)
        # Backward: FSDPParamGroup._backward_prefetch all-gathers the unit before the current
        # one (post_forward_order[index - 1], which lists units holding parameters only) as the
        # current one's backward starts; the root's pre_backward prefetches the last layer.
        holding = [i for i, unit in enumerate(layers) if unit.param_bytes]
        before = {b: a for a, b in itertools.pairwise(holding)}
        if holding and self.reshard:
            self.all_gather(layers[holding[-1]])
        # The head's gradients (the root's parameters after the layers) come first.
        root_grad = self.heap.alloc(self.f.post.param_bytes, "gathered", "autograd")
        self._unsave(self.f.post.saved_bytes)
        flowing = None  # the gradient of the current unit's output (cost_model.backward_moment)
        for i in range(len(layers) - 1, -1, -1):
            unit = layers[i]
            self.wait_for_unshard(unit)
            if i in before and self.reshard:
                self.all_gather(layers[before[i]])
            grad = self.heap.alloc(unit.param_bytes, "gathered", "autograd")
            if unit.grad_bytes:
                # The gradient of its input, alive until the unit before it has run backward
                # (through its post-backward reduce-scatter below).
                made = self.heap.alloc(unit.grad_bytes, "activations", "autograd")
                self.heap.release(flowing, "autograd")
                flowing = made
            self._unsave(unit.saved_bytes)
            self.free_unsharded(unit)
            self.reduce_scatter(unit, grad)
        # The root's post_backward runs last, when the embeddings' gradients are made.
        self.heap.release(flowing, "autograd")
        self.heap.release(root_grad, "autograd")
        root_grad = self.heap.alloc(root.param_bytes, "gathered", "autograd")
        self._unsave(self.f.pre.saved_bytes)
        self.free_unsharded(root)
        self.reduce_scatter(root, root_grad)
        # FSDPState._root_post_backward_final_callback clears reduce_scatter_states.
        self.heap.release(self.rs_state, "rs_state")
        self.rs_state = None
        # optimizer.step(): single-tensor Adam's scratch (sqrt, div) of one parameter's shard.
        self.heap.check(transient=2 * self.f.largest_param_bytes / self.shard, kind="temporary")

    def _save(self, size: int) -> None:
        self.activations.append(self.heap.alloc(size, "activations", "autograd"))

    def _unsave(self, size: int) -> None:
        # Saved activations go as backward passes the region that saved them (last first).
        if self.activations:
            self.heap.release(self.activations.pop(), "autograd")


def units_of(facts: ModelFacts) -> list[_Unit]:
    """The FSDP units ``build_strategy`` makes, the root first: each pipeline layer a unit, the
    root holding the rest; without layers, FullyShardedStrategy's default, each top-level
    child holding parameters (a tied parameter's children the root's: counted in it)."""
    if facts.layers:
        units = [_Unit(x.path, x.param_bytes, x.saved_bytes, x.grad_bytes) for x in facts.layers]
    else:
        # Without layers the trace puts every saved activation before them (facts.pre).
        units = [_Unit(f"child{i}", b, 0) for i, b in enumerate(facts.child_bytes)]
    root = facts.param_bytes - sum(u.param_bytes for u in units)
    return [_Unit("", max(root, 0), 0), *units]


def fsdp_peak(facts: ModelFacts, shard: int, slots: int, reshard: bool) -> dict[str, int]:
    """The live bytes by kind (params, optimizer, grads, activations, gathered, buffers,
    temporary) at the peak of the second of two steps (the first one's collectives held)."""
    steps = _Step(facts, units_of(facts), shard, slots, reshard)
    steps.step()
    steps.heap.peak = 0
    steps.step()
    return dict(steps.heap.at_peak)
