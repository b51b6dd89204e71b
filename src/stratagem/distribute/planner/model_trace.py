"""What the planner needs to know about a model, read from one step traced on the meta device.

``trace_model(model, example_batch)`` runs forward and backward with every parameter, buffer
and input replaced by a meta tensor (``torch.func.functional_call``; no real memory is used
and the model is not changed) and returns ``ModelFacts``: plain numbers, in bytes, of the
parameters (a tied parameter once), their gradients, the activations autograd saves for the
backward pass (``saved_tensors_hooks``; one tensor saved by several operations, or views of
it, counts once, parameters and their views and the batch not at all), the gradient of each
layer's input its backward makes, the largest FSDP unit, the Megatron-splittable
projections and the activations they all-reduce, and the pipeline's layers in call order
(the biggest ``nn.ModuleList``, or an ``nn.Sequential``'s children). ``ModelFacts.scaled``
gives the facts of a model k times as wide and a batch m times as large (the simulations).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

# Autograd nodes of operations that return a view: what they save is no new memory when their
# input is a parameter.
_VIEWS = {
    "TBackward0",
    "TransposeBackward0",
    "ViewBackward0",
    "UnsafeViewBackward0",
    "PermuteBackward0",
    "ExpandBackward0",
    "AliasBackward0",
    "SliceBackward0",
    "SelectBackward0",
}


@dataclass(frozen=True)
class LayerFacts:
    """One pipeline layer (or the pieces before the first and after the last layer)."""

    path: str
    param_bytes: int
    saved_bytes: int  # activations saved for backward while it runs, on the example batch
    input_bytes: int  # the activation entering it: what a stage boundary before it sends
    # The gradient of that input its backward makes: none when nothing before it trains, or
    # when it returns a view of its input (``Flatten``), whose gradient is a view too.
    grad_bytes: int = 0


@dataclass(frozen=True)
class ModelFacts:
    """A model's sizes in bytes, for one example batch (one device's share of a step)."""

    param_bytes: int
    trainable_bytes: int
    buffer_bytes: int
    activation_bytes: int
    largest_param_bytes: int  # the largest single parameter (an optimizer's temporaries)
    megatron_bytes: int  # parameters of the projections Megatron splits
    megatron_allreduce_bytes: int  # outputs of the row-wise projections (one step, forward)
    megatron_sharded_saved_bytes: int  # activations saved between and in split projections
    pre: LayerFacts  # before the first pipeline layer (embeddings)
    layers: tuple[LayerFacts, ...]
    post: LayerFacts  # after the last pipeline layer (final norm, head, loss)
    layers_are_sequential: bool  # split points are layer indices (else module paths)
    # Parameters of each top-level child holding some, in module order: FSDP's default units.
    child_bytes: tuple[int, ...] = ()
    # The example batch's tensors, which the training loop holds through the step (not among
    # the activations, even where an operation saves them).
    batch_bytes: int = 0

    def scaled(self, width: float = 1.0, batch: float = 1.0) -> ModelFacts:
        """The facts of this model with ``width`` times the parameters and ``batch`` times the
        activations (a model scaled in width and depth alike, a larger batch)."""

        def layer(f: LayerFacts) -> LayerFacts:
            return LayerFacts(
                f.path,
                int(f.param_bytes * width),
                int(f.saved_bytes * batch),
                int(f.input_bytes * batch),
                int(f.grad_bytes * batch),
            )

        return replace(
            self,
            param_bytes=int(self.param_bytes * width),
            trainable_bytes=int(self.trainable_bytes * width),
            buffer_bytes=int(self.buffer_bytes * width),
            activation_bytes=int(self.activation_bytes * batch),
            batch_bytes=int(self.batch_bytes * batch),
            largest_param_bytes=int(self.largest_param_bytes * width),
            megatron_bytes=int(self.megatron_bytes * width),
            megatron_allreduce_bytes=int(self.megatron_allreduce_bytes * batch),
            megatron_sharded_saved_bytes=int(self.megatron_sharded_saved_bytes * batch),
            pre=layer(self.pre),
            layers=tuple(layer(f) for f in self.layers),
            post=layer(self.post),
            child_bytes=tuple(int(b * width) for b in self.child_bytes),
        )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _pipeline_layers(model: nn.Module) -> tuple[str, list[str], bool]:
    """The container whose children are the pipeline's layers, their paths, and whether split
    points are indices (an ``nn.Sequential`` model) or module paths (a traced model)."""
    if isinstance(model, nn.Sequential):
        return "", [name for name, _ in model.named_children()], True
    best, best_size = "", -1
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1:
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                best, best_size = path, size
    if best_size < 0:
        return "", [], False
    children = [f"{best}.{name}" for name, _ in model.get_submodule(best).named_children()]
    return best, children, False


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


def _megatron_modules(model: nn.Module) -> dict[str, str]:
    """Module path -> ``"colwise"``/``"rowwise"`` for the projections Megatron's plan splits."""
    from stratagem.dtensor.megatron import MEGATRON_PLAN  # DTensor only when planning

    found = {}
    for path, module in model.named_modules():
        for pattern, split in MEGATRON_PLAN.items():
            if re.search(f"(?:{pattern})$", path) and getattr(module, "weight", None) is not None:
                found[path] = split
    return found


def _to_meta(batch: Any) -> Any:
    return pytree.tree_map(
        lambda v: torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else v, batch
    )


def _call(model: nn.Module, state: dict[str, torch.Tensor], batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return torch.func.functional_call(model, state, (), dict(batch))
    args = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
    return torch.func.functional_call(model, state, args)


def _loss_of(output: Any) -> torch.Tensor:
    """A scalar to differentiate: the output's ``.loss``, else the sum of its float tensors."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    leaves = [
        v
        for v in pytree.tree_leaves(
            output if not hasattr(output, "to_tuple") else output.to_tuple()
        )
        if isinstance(v, torch.Tensor) and v.requires_grad
    ]
    if not leaves:
        raise ValueError(
            f"plan: the model's output on example_batch ({type(output).__name__}) holds no "
            "tensor that requires grad; expected a loss (an output with .loss) or outputs"
        )
    return sum(v.float().sum() for v in leaves)  # type: ignore[return-value]


def trace_model(model: nn.Module, example_batch: Any) -> ModelFacts:
    """Trace one training step of ``model`` on ``example_batch`` on the meta device."""
    params = dict(model.named_parameters())  # a tied parameter once
    buffers = dict(model.named_buffers())
    meta = {
        n: torch.empty_like(p, device="meta").requires_grad_(p.requires_grad)
        for n, p in params.items()
    }
    meta.update({n: torch.empty_like(b, device="meta") for n, b in buffers.items()})
    param_ids = {id(t) for n, t in meta.items() if n in params}

    _, layer_paths, sequential = _pipeline_layers(model)
    megatron = _megatron_modules(model)
    regions = ["<pre>", *layer_paths, "<post>"]
    saved = dict.fromkeys(regions, 0)
    inputs = dict.fromkeys(regions, 0)
    grads = dict.fromkeys(regions, 0)
    entering: dict[str, torch.Tensor | None] = {}
    state = {"region": "<pre>", "split": None, "allreduce": 0, "sharded_saved": 0}
    seen: dict[int, torch.Tensor] = {}  # keeps each saved tensor alive so ids stay unique
    counted: dict[tuple[int, int], int] = {}  # bytes counted per (storage, offset)

    batch = _to_meta(example_batch)
    batch_tensors = [v for v in pytree.tree_leaves(batch) if isinstance(v, torch.Tensor)]
    batch_storages = {v.untyped_storage()._cdata for v in batch_tensors}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if id(t) in param_ids or id(t) in seen or (t.is_leaf and t.requires_grad):
            return t
        if t.untyped_storage()._cdata in batch_storages:
            return t  # the batch (or a view of it): counted on its own, held all step
        fn = t.grad_fn
        if type(fn).__name__ in _VIEWS and all(
            f is None or type(f).__name__ == "AccumulateGrad" for f, _ in fn.next_functions
        ):
            return t  # a view of a parameter (its transpose, say): no new memory
        seen[id(t)] = t
        # A view of a tensor already saved (``Flatten``'s output of a saved ``ReLU`` output,
        # say) keeps no new memory: count each start in a storage once, its largest view.
        where = (t.untyped_storage()._cdata, t.storage_offset())
        size = max(_nbytes(t) - counted.get(where, 0), 0)
        counted[where] = counted.get(where, 0) + size
        saved[state["region"]] += size
        if state["split"] is not None:
            state["sharded_saved"] += size
        return t

    # Parameters outside the layers belong to the region (before or after them) that first
    # calls their module; a tied head is counted where the embedding is.
    outside: dict[str, str] = {}

    def attribute(module_path: str) -> None:
        for name, _ in model.get_submodule(module_path).named_parameters(recurse=False):
            outside.setdefault(f"{module_path}.{name}" if module_path else name, state["region"])

    handles = []
    for path, module in model.named_modules():
        if not any(path == q or path.startswith(f"{q}.") for q in layer_paths):
            handles.append(module.register_forward_pre_hook(lambda *_, p=path: attribute(p)))
    for i, path in enumerate(layer_paths):
        module = model.get_submodule(path)

        def enter(
            _m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], p: str = path
        ) -> None:
            state["region"] = p
            first = next(
                (a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None
            )
            inputs[p] = _nbytes(first) if first is not None else 0
            entering[p] = first

        def leave(
            _m: nn.Module, _a: Any, out: Any, p: str = path, last: bool = i == len(layer_paths) - 1
        ) -> None:
            first = entering.pop(p, None)
            if first is not None and first.requires_grad:
                out = next(iter(pytree.tree_leaves(out)), None)
                view = isinstance(out, torch.Tensor) and _same_storage(out, first)
                grads[p] = 0 if view else _nbytes(first)
            if last:
                state["region"] = "<post>"

        handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(module.register_forward_hook(leave))
    # Under Megatron's split, what runs from the end of a column-wise projection to the end of
    # the row-wise one after it (the attention heads, the MLP's hidden units) is split too.
    for path, split in megatron.items():
        module = model.get_submodule(path)

        def end(_m: nn.Module, _a: Any, out: Any, s: str = split) -> None:
            if s == "colwise":
                state["split"] = "inside"
                return
            state["split"] = None
            if isinstance(out, torch.Tensor):
                state["allreduce"] += _nbytes(out)

        handles.append(module.register_forward_hook(end))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = _loss_of(_call(model, meta, batch))
        loss.backward()
    finally:
        for h in handles:
            h.remove()
        seen.clear()

    def owned(prefixes: list[str]) -> int:
        return sum(
            _nbytes(p) for n, p in params.items() if any(n.startswith(f"{q}.") for q in prefixes)
        )

    layer_bytes = [owned([p]) for p in layer_paths]
    post_bytes = sum(
        _nbytes(params[n]) for n, r in outside.items() if r == "<post>" and n in params
    )
    in_layers = sum(layer_bytes)
    total = sum(_nbytes(p) for p in params.values())
    units = [owned([name]) for name, _ in model.named_children()]
    return ModelFacts(
        param_bytes=total,
        trainable_bytes=sum(_nbytes(p) for p in params.values() if p.requires_grad),
        buffer_bytes=sum(_nbytes(b) for b in buffers.values()),
        activation_bytes=sum(saved.values()),
        largest_param_bytes=max((_nbytes(p) for p in params.values()), default=0),
        megatron_bytes=owned(list(megatron)),
        megatron_allreduce_bytes=state["allreduce"],
        megatron_sharded_saved_bytes=state["sharded_saved"],
        pre=LayerFacts("<pre>", total - in_layers - post_bytes, saved["<pre>"], 0),
        layers=tuple(
            LayerFacts(p, b, saved[p], inputs[p], grads[p])
            for p, b in zip(layer_paths, layer_bytes, strict=True)
        ),
        post=LayerFacts("<post>", post_bytes, saved["<post>"], 0),
        layers_are_sequential=sequential,
        child_bytes=tuple(b for b in units if b),
        batch_bytes=sum(_nbytes(v) for v in batch_tensors),
    )
