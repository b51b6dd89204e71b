"""Ready layout maps for Megatron's tensor parallelism of transformer blocks.

Megatron-LM splits each block's first projections column-wise (attention heads, MLP hidden
units) and the projections after them row-wise, so a block needs one all-reduce forward and one
backward. ``megatron_layout_map(mesh, model)`` finds the projections by name (a *plan*: regex on
module paths → ``"colwise"`` or ``"rowwise"``, torch's and Hugging Face's words), looks at each
matched module for its orientation (``nn.Linear``'s weight is (out, in); Hugging Face's
``Conv1D``, GPT-2's, is (in, out)), and writes one ``LayoutMap`` key per pattern and weight,
e.g. ``(?:\\.attn\\.c_attn)\\.weight$`` → ``[UNSHARDED, 'model']``: column-wise shards a
weight's output dimension and its bias, row-wise its input dimension (bias replicated). The
result is an ordinary ``LayoutMap``: print it, edit it, apply it to any model of the family.
Weights no pattern matches (embeddings, norms, the head) are replicated; DTensor derives the
activations' layouts and the all-reduces from the weights'.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from stratagem.dtensor.errors import LayoutError
from stratagem.dtensor.layout import UNSHARDED, Layout
from stratagem.dtensor.layout_map import LayoutMap
from stratagem.dtensor.mesh import Mesh

__all__ = ["MEGATRON_PLAN", "megatron_layout_map"]

COLUMN = "colwise"
ROW = "rowwise"

# Module paths (regex, matched at the path's end) → split, for the common transformer families.
MEGATRON_PLAN: dict[str, str] = {
    # GPT-2 (Conv1D): the fused q|k|v and the MLP's first projection, then the two c_proj.
    r"\.attn\.c_attn": COLUMN,
    r"\.attn\.c_proj": ROW,
    r"\.mlp\.c_fc": COLUMN,
    r"\.mlp\.c_proj": ROW,
    # Llama, Mistral, Qwen and kin (Linear): q, k, v then o; gate and up then down.
    r"\.self_attn\.(q|k|v)_proj": COLUMN,
    r"\.self_attn\.o_proj": ROW,
    r"\.mlp\.(gate|up)_proj": COLUMN,
    r"\.mlp\.down_proj": ROW,
    # BERT, RoBERTa (Linear): query, key, value then the attention's output; intermediate then
    # the layer's output (``layer.N.output.dense``, not ``attention.output.dense``).
    r"\.attention\.self\.(query|key|value)": COLUMN,
    r"\.attention\.output\.dense": ROW,
    r"\.intermediate\.dense": COLUMN,
    r"\.layer\.\d+\.output\.dense": ROW,
}

_SPLITS = {"colwise": COLUMN, "column": COLUMN, "rowwise": ROW, "row": ROW}


def megatron_layout_map(
    mesh: Mesh,
    model: torch.nn.Module,
    axis: str = "model",
    plan: Mapping[str, str] | None = None,
) -> LayoutMap:
    """A ``LayoutMap`` splitting ``model``'s attention and MLP projections along ``axis``.

    ``plan`` maps regexes on module paths to ``"colwise"`` or ``"rowwise"`` (default
    ``MEGATRON_PLAN``; a Hugging Face config's ``base_model_tp_plan`` works as it is). Each
    matched module must be an ``nn.Linear`` or a ``Conv1D``; a pattern that matches nothing in
    ``model`` adds no key. Raises ``LayoutError`` naming the module or pattern at fault.
    """
    if not isinstance(mesh, Mesh):
        raise LayoutError(f"megatron_layout_map needs a sg.dtensor.Mesh, got {type(mesh).__name__}")
    if not mesh.contains_dim(axis):
        raise LayoutError(
            f"megatron_layout_map: the mesh {mesh} has no dimension {axis!r} to split the "
            f"projections along; expected one of {list(mesh.dim_names)} (pass axis=)"
        )
    chosen = MEGATRON_PLAN if plan is None else _checked_plan(plan)
    layout_map = LayoutMap(mesh)
    orientation: dict[str, tuple[str, str]] = {}  # pattern -> (first module's path, kind)
    for path, module in model.named_modules():
        pattern = _pattern_of(path, chosen)
        if pattern is None:
            continue
        kind = _weight_kind(path, module)
        seen = orientation.get(pattern)
        if seen is None:  # the pattern's first module: its keys cover all the others
            orientation[pattern] = (path, kind)
            _add_keys(layout_map, pattern, kind, _SPLITS[chosen[pattern]], module, axis)
        elif seen[1] != kind:
            raise LayoutError(
                f"megatron_layout_map: pattern {pattern!r} matches {seen[0]!r} ({seen[1]}) and "
                f"{path!r} ({kind}), whose weights are transposed to each other; expected one "
                "kind of projection per pattern (split the pattern in two)"
            )
    return layout_map


def _checked_plan(plan: Mapping[str, str]) -> dict[str, str]:
    checked = {}
    for pattern, split in plan.items():
        if split not in _SPLITS:
            raise LayoutError(
                f"megatron_layout_map: plan[{pattern!r}] = {split!r}; expected one of "
                f"{sorted(_SPLITS)}"
            )
        try:
            re.compile(pattern)
        except re.error as e:
            raise LayoutError(f"megatron_layout_map: plan key {pattern!r} is no regex: {e}") from e
        checked[pattern] = split
    return checked


def _pattern_of(path: str, plan: Mapping[str, str]) -> str | None:
    """The one plan pattern matching the end of ``path``; None when none does."""
    matching = [p for p in plan if re.search(f"(?:{p})$", path)]
    if len(matching) > 1:
        raise LayoutError(
            f"megatron_layout_map: module {path!r} matches several plan patterns {matching}; "
            "expected at most one"
        )
    return matching[0] if matching else None


def _weight_kind(path: str, module: torch.nn.Module) -> str:
    """``"Linear"`` (weight (out, in)) or ``"Conv1D"`` (weight (in, out), Hugging Face's)."""
    if isinstance(module, torch.nn.Linear):
        return "Linear"
    weight = getattr(module, "weight", None)
    nx, nf = getattr(module, "nx", None), getattr(module, "nf", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and tuple(weight.shape) == (nx, nf):
        return "Conv1D"
    raise LayoutError(
        f"megatron_layout_map: module {path!r} is a {type(module).__name__}; expected an "
        "nn.Linear or a Conv1D (weight (in, out)) to split column- or row-wise (leave it out "
        "of the plan, or give its weights LayoutMap keys yourself)"
    )


def _add_keys(
    layout_map: LayoutMap, pattern: str, kind: str, split: str, module: torch.nn.Module, axis: str
) -> None:
    """The keys of ``pattern``'s weight (and bias) for a ``split`` of a ``kind`` projection."""
    mesh = layout_map.mesh
    # The weight dimension holding the outputs: 0 for a Linear (out, in), 1 for a Conv1D.
    outputs = 0 if kind == "Linear" else 1
    split_dim = outputs if split == COLUMN else 1 - outputs
    specs = [UNSHARDED, UNSHARDED]
    specs[split_dim] = axis
    layout_map[f"(?:{pattern})\\.weight$"] = Layout(specs, mesh)
    if split == COLUMN and getattr(module, "bias", None) is not None:
        layout_map[f"(?:{pattern})\\.bias$"] = Layout([axis], mesh)
