"""``LayoutMap``: layouts for a model's weights by regular expressions on their paths.

A path is what ``module.named_parameters()`` calls a weight: attribute paths such as
``feature.weight`` for modules that assign their layers to attributes (the seed's subclassed
model), and the children's names for ``nn.Sequential`` (``nn.Sequential(OrderedDict(feature=
nn.Linear(...)))`` names its weight ``feature.weight``, as Keras names a layer ``feature``).
A key matches a path when ``re.search`` finds it there (``key_matches``; an exact key wins
outright); a path that matches no key is replicated, one that matches two is an error.

``with layout_map.scope():`` lays out every module built inside it when the block ends (where
the full paths are first known); ``apply_layout_map(module, layout_map)`` does the same for a
module built earlier. Buffers (BatchNorm's statistics) follow the same map.
Keys that match no weight, and weights of ``large_weight_size`` elements or more that no key
matches, are named in a warning (with ``strict=True`` an error, before any weight changes).
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator, MutableMapping

import torch
from torch.nn.modules import module as module_hooks

from stratagem.dtensor.errors import LayoutError
from stratagem.dtensor.layout import Layout
from stratagem.dtensor.mesh import Mesh

# Elements from which a weight no key matches is named rather than replicated in silence: a
# 1024 × 1024 matrix (4 MiB in float32); smaller ones (biases, norms) are replicated on purpose.
LARGE_WEIGHT_SIZE = 2**20


class LayoutMap(MutableMapping[str, Layout]):
    """``LayoutMap(mesh)``: dict-like, regex keys → ``Layout``; unmatched weights replicated.

    ``strict=True`` makes a key that matches no weight, or a weight of at least
    ``large_weight_size`` elements that no key matches, an error instead of a warning.
    """

    def __init__(
        self, mesh: Mesh, *, strict: bool = False, large_weight_size: int = LARGE_WEIGHT_SIZE
    ) -> None:
        if not isinstance(mesh, Mesh):
            raise LayoutError(f"LayoutMap needs a sg.dtensor.Mesh, got {type(mesh).__name__}")
        if isinstance(large_weight_size, bool) or not isinstance(large_weight_size, int):
            raise LayoutError(
                f"LayoutMap: large_weight_size={large_weight_size!r}; expected a number of "
                "elements (an int >= 1)"
            )
        if large_weight_size < 1:
            raise LayoutError(
                f"LayoutMap: large_weight_size={large_weight_size}; expected an int >= 1"
            )
        self._mesh = mesh
        self._layouts: dict[str, Layout] = {}
        self.strict = bool(strict)
        self.large_weight_size = large_weight_size
        self._said_unmatched: set[str] = set()  # keys and weights already warned of (once each)

    def get_default_mesh(self) -> Mesh:
        """The mesh of the replicated layout given to weights that match no key."""
        return self._mesh

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    # --- the mapping -----------------------------------------------------------------------

    def __getitem__(self, path: str) -> Layout | None:
        """The layout for ``path``: its exact key, else the one key whose regex it matches.

        None when no key matches (the weight is then replicated); ``LayoutError`` when several
        do.
        """
        if path in self._layouts:
            return self._layouts[path]
        matching = [key for key in self._layouts if self.key_matches(key, path)]
        if len(matching) > 1:
            raise LayoutError(
                f"path {path!r} matches several LayoutMap keys: {matching}; each weight may "
                "match at most one key"
            )
        return self._layouts[matching[0]] if matching else None

    def key_matches(self, key: str, path: str) -> bool:
        """Whether regex ``key`` matches the weight at ``path``: ``re.search`` finds it there
        (TF's rule; a subclass may have its own, as Keras 3's map has)."""
        return re.search(key, path) is not None

    def __setitem__(self, key: str, layout: Layout) -> None:
        if not isinstance(key, str):
            raise LayoutError(f"LayoutMap keys are regex strings, got {type(key).__name__}")
        if key in self._layouts:
            raise LayoutError(f"LayoutMap already has key {key!r}; delete it first to change it")
        if not isinstance(layout, Layout):
            raise LayoutError(
                f"LayoutMap[{key!r}] must be a sg.dtensor.Layout, got {type(layout).__name__}"
            )
        if layout.mesh != self._mesh:
            raise LayoutError(
                f"LayoutMap[{key!r}] = {layout!r} is on another mesh than the map's {self._mesh}"
            )
        try:
            re.compile(key)
        except re.error as e:
            raise LayoutError(f"LayoutMap key {key!r} is not a regular expression: {e}") from e
        self._layouts[key] = layout

    def __delitem__(self, key: str) -> None:
        del self._layouts[key]

    def __len__(self) -> int:
        return len(self._layouts)

    def __iter__(self) -> Iterator[str]:
        return iter(self._layouts)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k!r}: {v.sharding_specs}" for k, v in self._layouts.items())
        return f"LayoutMap({self._mesh}, {{{inner}}})"

    def layout_for(self, path: str, rank: int) -> Layout:
        """The layout for a weight at ``path`` of ``rank`` dims; replicated when none matches."""
        found = self[path]
        return found if found is not None else Layout.replicated(self._mesh, rank)

    # --- applying it -----------------------------------------------------------------------

    def apply(self, module: torch.nn.Module) -> torch.nn.Module:
        """Lay out ``module``'s parameters and buffers in place; returns the module."""
        return apply_layout_map(module, self)

    @contextlib.contextmanager
    def scope(self) -> Iterator[LayoutMap]:
        """Lay out every module built inside the block (its outermost ones) when it ends."""
        with CreatedModules() as created:
            yield self
        for module in created.roots():
            apply_layout_map(module, self)


class CreatedModules:
    """Records the modules built while it is entered, through PyTorch's global registration
    hooks; ``roots()`` are the outermost of them so far (the models, whose paths the layout
    map's regexes match). A strategy asks mid-scope too, to lay a model out before a step."""

    def __init__(self) -> None:
        self._created: dict[int, torch.nn.Module] = {}
        self._children: set[int] = set()
        self._handles: list = []
        self._registrations = 0  # weights and children registered so far
        self._asked_at = 0  # ... when changed_roots() last answered

    def __enter__(self) -> CreatedModules:
        def on_tensor(module: torch.nn.Module, name: str, value: object) -> None:
            self._created.setdefault(id(module), module)
            self._registrations += 1

        def on_module(module: torch.nn.Module, name: str, child: object) -> None:
            self._created.setdefault(id(module), module)
            if isinstance(child, torch.nn.Module):
                self._children.add(id(child))
            self._registrations += 1

        self._handles = [
            module_hooks.register_module_parameter_registration_hook(on_tensor),
            module_hooks.register_module_buffer_registration_hook(on_tensor),
            module_hooks.register_module_module_registration_hook(on_module),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def roots(self) -> list[torch.nn.Module]:
        return [m for key, m in self._created.items() if key not in self._children]

    def changed_roots(self) -> list[torch.nn.Module]:
        """The roots when something was registered since the last call, else none: what a
        step inside the scope must lay out, without re-planning unchanged models each step."""
        if self._registrations == self._asked_at:
            return []
        self._asked_at = self._registrations
        return self.roots()


def apply_layout_map(module: torch.nn.Module, layout_map: LayoutMap) -> torch.nn.Module:
    """Lay out every parameter and buffer of ``module`` per ``layout_map``, in place.

    Each weight becomes a DTensor on the map's mesh carrying ``.layout``; every layout is
    checked (rank, even split) before any weight changes, so an error leaves the module as it
    was. A weight reachable by several paths (tied embeddings: GPT-2's ``lm_head.weight`` is
    ``transformer.wte.weight``) stays one weight: it is laid out once, by the layout a key gives
    any of its paths, and every path gets the same DTensor. Returns ``module``.
    """
    from stratagem.dtensor import translate

    if not isinstance(layout_map, LayoutMap):
        raise LayoutError(f"apply_layout_map needs a LayoutMap, got {type(layout_map).__name__}")
    plan: list[_Placement] = []
    for kind, named in (
        ("parameter", module.named_parameters(remove_duplicate=False)),
        ("buffer", module.named_buffers(remove_duplicate=False)),
    ):
        by_tensor: dict[int, _Placement] = {}
        for path, tensor in named:
            placement = by_tensor.get(id(tensor))
            if placement is None:
                placement = by_tensor[id(tensor)] = _Placement(kind, tensor)
                plan.append(placement)
            placement.add(path, layout_map[path])
    for placement in plan:
        placement.check(layout_map.mesh)
    _report_silent_replication(module, layout_map, plan)
    for placement in plan:
        current, layout = placement.tensor, placement.layout
        if translate.assigned_layout(current) == layout:
            continue
        what = f"{placement.kind} {placement.paths[0]!r}"
        replacement = translate.layout_parameter(
            current, layout, what, parameter=placement.kind == "parameter"
        )
        for path in placement.paths:
            owner_path, _, name = path.rpartition(".")
            owner = module.get_submodule(owner_path)
            store = owner._parameters if placement.kind == "parameter" else owner._buffers
            store[name] = replacement
    return module


def _report_silent_replication(
    module: torch.nn.Module, layout_map: LayoutMap, plan: list[_Placement]
) -> None:
    """Name what a map leaves replicated that it likely meant to shard: keys that match none of
    a model's weights (a misspelt path, or Keras's ``dense.kernel`` for PyTorch's
    ``dense.weight``), and weights of at least ``large_weight_size`` elements that no key
    matches (a renamed layer, which would otherwise be copied whole to every device). A warning
    once each, or with ``strict`` one error before any weight changes. A module without
    parameters (a loss) is not a model the map was meant for; an empty map (data parallelism)
    shards nothing on purpose."""
    if not len(layout_map) or not any(True for _ in module.parameters()):
        return
    paths = [p for placement in plan for p in placement.paths]
    said = layout_map._said_unmatched
    keys = [
        key
        for key in layout_map
        if not any(key == path or layout_map.key_matches(key, path) for path in paths)
    ]
    large = [
        placement
        for placement in plan
        if not placement.keyed and placement.tensor.numel() >= layout_map.large_weight_size
    ]
    if not layout_map.strict:
        keys = [key for key in keys if key not in said]
        large = [placement for placement in large if placement.paths[0] not in said]
    if not keys and not large:
        return
    name = type(module).__name__
    problems = []
    if keys:
        shown = ", ".join(repr(p) for p in paths[:6]) + (", ..." if len(paths) > 6 else "")
        problems.append(
            f"LayoutMap keys {keys} match none of the {len(paths)} weights of {name} (paths "
            f"such as {shown}): those layouts shard nothing, and the weights they were meant "
            "for are replicated. Keys are regexes matched against the weights' full paths "
            "(PyTorch's names: 'weight' and 'bias', not 'kernel')"
        )
    if large:
        listed = ", ".join(
            f"{p.paths[0]!r} ({p.kind}, shape {list(p.tensor.shape)}, {p.tensor.numel()} elements)"
            for p in large
        )
        problems.append(
            f"{len(large)} weight(s) of {name} with at least {layout_map.large_weight_size} "
            f"elements match no LayoutMap key and are replicated whole on every device of "
            f"{layout_map.mesh}: {listed}. Add a key for each (a replicated Layout if a full "
            "copy is meant), or raise large_weight_size="
        )
    if layout_map.strict:
        raise LayoutError("; and ".join(problems) + " (strict=True)")
    said.update(keys)
    said.update(placement.paths[0] for placement in large)
    for problem in problems:
        warnings.warn(problem, stacklevel=3)


class _Placement:
    """One tensor of a module, the paths that reach it, and the layout keys give them."""

    def __init__(self, kind: str, tensor: torch.Tensor) -> None:
        self.kind = kind
        self.tensor = tensor
        self.paths: list[str] = []
        self._keyed: dict[str, Layout] = {}  # path -> the layout a key gives it

    @property
    def keyed(self) -> bool:
        """Whether a key gives any of the tensor's paths a layout."""
        return bool(self._keyed)

    def add(self, path: str, layout: Layout | None) -> None:
        self.paths.append(path)
        if layout is not None:
            self._keyed[path] = layout

    def check(self, mesh: Mesh) -> None:
        """One layout for the tensor, fitting its shape; ``LayoutError`` naming the paths."""
        distinct = set(self._keyed.values())
        if len(distinct) > 1:
            given = ", ".join(f"{p!r}: {lay.sharding_specs}" for p, lay in self._keyed.items())
            raise LayoutError(
                f"{self.kind} {self.paths[0]!r} is one tensor reached by the paths {self.paths} "
                f"(tied weights), but the LayoutMap gives them different layouts ({given}); "
                "expected one layout for all of them (a key for one path, or the same layout)"
            )
        self.layout = distinct.pop() if distinct else Layout.replicated(mesh, self.tensor.dim())
        self.layout.check_shape(self.tensor.shape, f"{self.kind} {self.paths[0]!r}")


def layout_weights(
    module: torch.nn.Module, mesh: Mesh | None = None, **layouts: Layout
) -> torch.nn.Module:
    """Lay out one layer's own weights by name: the seed's ``kernel_layout=``/``bias_layout=``.

    ``layout_weights(nn.Linear(784, 128), weight=Layout.replicated(mesh, 2), bias=...)``; weights
    not named are replicated on the mesh of the given layouts (or ``mesh``). Returns the module.
    """
    meshes = {layout.mesh for layout in layouts.values() if isinstance(layout, Layout)}
    if mesh is not None:
        meshes.add(mesh)
    if len(meshes) != 1:
        raise LayoutError(
            f"layout_weights needs layouts on one mesh (or mesh=); got {len(meshes)} meshes"
        )
    known = dict(module.named_parameters()) | dict(module.named_buffers())
    unknown = sorted(set(layouts) - set(known))
    if unknown:
        raise LayoutError(
            f"layout_weights: {type(module).__name__} has no weights {unknown}; it has "
            f"{sorted(known)}"
        )
    layout_map = LayoutMap(meshes.pop())
    for name, layout in layouts.items():
        layout_map[name] = layout  # an exact key wins over every regex
    return apply_layout_map(module, layout_map)
