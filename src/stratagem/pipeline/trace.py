"""Splitting a model that is not an ``nn.Sequential``: traced by ``torch.export``, cut at module
paths (``split_points=["transformer.h.1"]``: that module's call starts a new stage).

``torch.distributed.pipelining.pipeline`` traces and cuts; this module adapts its result to our
runtime. The model is traced through ``ModelCall``: one tensor in, one tensor out (a Hugging
Face model gets ``use_cache=False``, and its output's ``.logits``). Each stage becomes a
``TracedStage`` that takes what the previous stage hands on and returns what the next ones need,
so stages talk to neighbours only, as slices of a Sequential do. Every stage's parameters and
buffers are put back to the whole model's own tensors, under the whole model's names: a stage
trains the model's parameters, a tied one is one tensor per process (``shared.SharedCopies``
across processes), and the stages' state dicts together are the model's. A graph is specialised
to its shapes: a pipeline traces again (once, cached) per micro-batch size; every other
dimension must stay that of the sample input.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.pipelining import SplitPoint, pipeline

from stratagem.errors import StratagemError
from stratagem.pipeline.stage_pieces import Chunks

SEQUENTIAL_ROUTE = (
    "or write the model as an nn.Sequential of its stages and split it at layer indices "
    "(an nn.Sequential needs no tracing)"
)

# The name ModelCall gives the model inside it: stripped from every traced name.
_INNER = "model"
_PREFIX = f"{_INNER}."
_MISSING = object()


class UntraceableModelError(StratagemError, ValueError):
    """``torch.export`` could not capture a model as one graph, so it cannot be split at module
    paths: the message names the module and the tracer's reason."""


class ModelCall(nn.Module):
    """The model as the tracer sees it: one tensor in, one tensor out."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.add_module(_INNER, model)
        try:
            accepted = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            accepted = {}  # type: ignore[assignment]
        # A Hugging Face model returns its key/value cache by default: an object, not a tensor.
        self._kwargs: dict[str, Any] = {"use_cache": False} if "use_cache" in accepted else {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = getattr(self, _INNER)(x, **self._kwargs)
        if isinstance(out, torch.Tensor):
            return out
        logits = getattr(out, "logits", None)
        if isinstance(logits, torch.Tensor):
            return logits
        raise UntraceableModelError(
            f"{type(getattr(self, _INNER)).__name__}.forward returned {type(out).__name__}: a "
            "pipeline's last stage gives its loss_fn one tensor (or an output with a .logits "
            "tensor); wrap the model in a module whose forward returns that tensor"
        )


# ---------------------------------------------------------------------- split points


def check_module_paths(model: nn.Module, split_points: object, num_chunks: int) -> list[str]:
    """Validated split points of a model that is not a Sequential: distinct paths of its
    submodules, one fewer than the chunks."""
    name = type(model).__name__
    if (
        isinstance(split_points, str)
        or not isinstance(split_points, Sequence)
        or not all(isinstance(p, str) for p in split_points)
    ):
        raise ValueError(
            f"split_points={split_points!r}: {name} is not an nn.Sequential, so its split "
            "points are module paths, a list of strings such as ['transformer.h.1'] (each named "
            "module's call starts a stage); balancing by 'parameters' or 'time' needs an "
            "nn.Sequential"
        )
    points = list(split_points)
    if len(points) != num_chunks - 1:
        raise ValueError(
            f"split_points={points} cut {name} into {len(points) + 1} stages, but the pipeline "
            f"has {num_chunks}; give {num_chunks - 1} module paths"
        )
    if len(set(points)) != len(points):
        raise ValueError(f"split_points={points} name a module twice")
    for path in points:
        _check_path(model, path)
    return points


def suggest_split_points(model: nn.Module, num_chunks: int) -> str:
    """An example for messages: even cuts of the model's longest ``nn.ModuleList`` (its blocks)."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        return "such as ['encoder', 'decoder'], the paths of the model's submodules"
    path, blocks = max(lists, key=lambda item: len(item[1]))
    cuts = [round(i * len(blocks) / num_chunks) for i in range(1, num_chunks)]
    return f"such as {[f'{path}.{c}' for c in cuts]}"


def _check_path(model: nn.Module, path: str) -> None:
    if path == "":
        raise ValueError("split point '' is the whole model: name a submodule that starts a stage")
    module, walked = model, []
    for atom in path.split("."):
        child = module._modules.get(atom)
        if child is None:
            where = f"under {'.'.join(walked)!r}" if walked else "at the top"
            raise ValueError(
                f"split point {path!r} names no module of {type(model).__name__} (its modules "
                f"{where} are {list(module._modules)})"
            )
        module, walked = child, [*walked, atom]


# ---------------------------------------------------------------------- tracing


def trace_split(model: nn.Module, split_points: Sequence[str], sample: torch.Tensor) -> Any:
    """``torch.distributed.pipelining``'s ``Pipe`` of ``ModelCall(model)`` cut at
    ``split_points``, traced on ``sample``; the model is left as it was (the tracer patches the
    forward of the modules it splits at: put back here)."""
    check_sample(model, sample)
    call = ModelCall(model)
    patched = {p: model.get_submodule(p).__dict__.get("forward", _MISSING) for p in split_points}
    running: list[nn.Module] = []
    hooks = _watch_calls(call, running)
    try:
        return pipeline(
            call,
            (sample,),
            split_spec={_PREFIX + p: SplitPoint.BEGINNING for p in split_points},
        )
    except UntraceableModelError:
        raise
    except Exception as e:  # the tracer's errors have many types: each is named the same way
        raise _untraceable(model, split_points, running, e) from e
    finally:
        for hook in hooks:
            hook.remove()
        for path, forward in patched.items():
            module = model.get_submodule(path)
            module.__dict__.pop("_orig_forward", None)
            if forward is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.forward = forward  # type: ignore[method-assign]


def check_sample(model: nn.Module, sample: object) -> None:
    """A traced pipeline's input is one tensor: what its first stage gets, split in
    micro-batches."""
    if not isinstance(sample, torch.Tensor):
        raise UntraceableModelError(
            f"cannot trace {type(model).__name__} on a {type(sample).__name__} input: a traced "
            "pipeline's input is one tensor (token ids, pixel values); wrap the model in a "
            "module whose forward takes that tensor and builds the other arguments"
        )


def _watch_calls(call: ModelCall, running: list[nn.Module]) -> list[Any]:
    """Hooks that keep ``running`` the stack of modules being called: when the tracer fails, its
    top is the innermost module it was in (the export runs the model's Python code)."""

    def enter(module: nn.Module, args: Any) -> None:
        if module is call:
            running.clear()
        running.append(module)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if running and running[-1] is module:
            running.pop()

    hooks = []
    for module in call.modules():
        hooks.append(module.register_forward_pre_hook(enter))
        hooks.append(module.register_forward_hook(leave))
    return hooks


def _untraceable(
    model: nn.Module, split_points: Sequence[str], running: list[nn.Module], error: Exception
) -> Exception:
    cause: BaseException = error
    while cause.__cause__ is not None:
        cause = cause.__cause__
    if isinstance(cause, UntraceableModelError):
        return cause
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    reason = f"{type(cause).__name__}: {lines[0] if lines else repr(cause)}"
    paths = {id(m): n for n, m in model.named_modules()}
    inner = next((m for m in reversed(running) if id(m) in paths), None)
    if inner is None or paths[id(inner)] == "":
        where = f"{type(model).__name__}.forward"
    else:
        where = f"module {paths[id(inner)]!r} ({type(inner).__name__})"
    return UntraceableModelError(
        f"cannot split {type(model).__name__} at {list(split_points)}: torch.export could not "
        f"trace {where}: {reason}. A traced pipeline needs the whole forward as one graph (no "
        "control flow on tensor values, one tensor in and one out): make that module "
        f"traceable, {SEQUENTIAL_ROUTE}"
    )


# ---------------------------------------------------------------------- stages


@dataclass(frozen=True)
class Route:
    """How a stage meets its neighbours. The stage gets a *carry* (the tensors the previous one
    handed on; the model's input for the first): ``takes`` picks its graph's arguments from it,
    ``picks`` its graph's outputs that are used (None: the graph returns one tensor), and
    ``emits`` what it hands on, as positions in the carry followed by those outputs."""

    takes: tuple[int, ...]
    picks: tuple[int, ...] | None
    emits: tuple[int, ...]


# A value between stages: (the stage that makes it, its output index), or (-1, None): the input.
_Key = tuple[int, int | None]
_INPUT: _Key = (-1, None)


def plan_routes(split_gm: fx.GraphModule, num_chunks: int) -> list[Route]:
    """Each stage's ``Route``, from the graph that calls the traced stages."""
    nodes = list(split_gm.graph.nodes)
    stages = [n for n in nodes if n.op == "call_module"]
    inputs = [n for n in nodes if n.op == "placeholder"]
    if len(stages) != num_chunks or len(inputs) != 1:
        raise UntraceableModelError(
            f"the traced model has {len(stages)} stages and {len(inputs)} inputs; expected "
            f"{num_chunks} stages (one per split point, plus one: a module called more than once "
            "starts a stage at each call, one never called starts none) and one input"
        )
    index = {n: i for i, n in enumerate(stages)}

    def key(arg: object) -> _Key:
        if isinstance(arg, fx.Node) and arg.op == "placeholder":
            return _INPUT
        if isinstance(arg, fx.Node) and arg.op == "call_module":
            return (index[arg], None)
        if (
            isinstance(arg, fx.Node)
            and arg.target is operator.getitem
            and isinstance(arg.args[0], fx.Node)
            and arg.args[0] in index
            and isinstance(arg.args[1], int)
        ):
            return (index[arg.args[0]], arg.args[1])
        raise UntraceableModelError(
            f"a traced stage is given {arg!r}: stages may only pass tensors to each other"
        )

    needs = [[key(a) for a in s.args] for s in stages]
    [output] = [n for n in nodes if n.op == "output"]
    results = fx.node.map_aggregate(output.args[0], lambda a: a)
    flat = list(results) if isinstance(results, tuple | list) else [results]
    if len(flat) != 1:
        raise UntraceableModelError(f"the traced model returns {len(flat)} values; expected one")
    final = key(flat[0])
    routes, carry = [], [_INPUT]
    for i in range(num_chunks):
        made = _made_by(i, needs, final)
        picks = None if made == [None] else tuple(m for m in made if m is not None)
        pool = carry + [(i, m) for m in made]
        later = {k for n in needs[i + 1 :] for k in n} | {final}
        emits = tuple(j for j, k in enumerate(pool) if k in later and pool.index(k) == j)
        routes.append(Route(tuple(carry.index(k) for k in needs[i]), picks, emits))
        carry = [pool[j] for j in emits]
    if carry != [final]:
        raise UntraceableModelError(f"the last traced stage hands on {carry}; expected {final}")
    return routes


def _made_by(stage: int, needs: list[list[_Key]], final: _Key) -> list[int | None]:
    """The outputs of ``stage`` that later stages or the result use, in order."""
    used = {k[1] for n in needs for k in n if k[0] == stage}
    if final[0] == stage:
        used.add(final[1])
    if None in used:
        return [None]
    return sorted(used)  # type: ignore[type-var]


class TracedStage(nn.Module):
    """One traced stage (``body``, a graph of ATen operations) between its neighbours:
    ``forward(*carry)`` returns what the next stage needs (one tensor: itself)."""

    def __init__(
        self, body: nn.Module, route: Route, input_shape: tuple[int, ...] | None = None
    ) -> None:
        super().__init__()
        self.body = body
        self.route = route
        # The first stage's traced input shape but the batch: the graph's shapes are fixed.
        self.input_shape = input_shape

    def forward(self, *carry: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if self.input_shape is not None and tuple(carry[0].shape[1:]) != self.input_shape:
            raise ValueError(
                f"the pipeline was traced for inputs of shape (batch, "
                f"{', '.join(map(str, self.input_shape))}), got {tuple(carry[0].shape)}: a "
                "traced graph fixes every dimension but the batch; pad the inputs to that "
                "shape, or cut a new pipeline with a sample of the new shape"
            )
        route = self.route
        out = self.body(*(carry[i] for i in route.takes))
        made = (out,) if route.picks is None else tuple(out[k] for k in route.picks)
        pool = (*carry, *made)
        handed = tuple(pool[i] for i in route.emits)
        return handed[0] if len(handed) == 1 else handed


# ---------------------------------------------------------------------- names


def whole_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` under every name it has, in module order."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    return tensors


def read_names(body: nn.Module) -> list[str]:
    """The names (in ``body``) of the parameters and buffers its graphs read: ``get_attr``
    nodes, scoped by the submodule whose graph holds them, and all of a module without a graph
    that a graph calls. A module no graph calls is not read (the tracer hangs aliases of tied
    weights on such modules)."""
    names: list[str] = []

    def visit(module: nn.Module, scope: str) -> None:
        graph = module.graph
        assert isinstance(graph, fx.Graph)
        for node in graph.nodes:
            if node.op == "get_attr":
                names.append(scope + str(node.target))
            elif node.op == "call_module":
                called = module.get_submodule(str(node.target))
                if not _has_graph(called):
                    prefix = f"{scope}{node.target}."
                    names.extend(prefix + n for n, _ in called.named_parameters())
                    names.extend(prefix + n for n, _ in called.named_buffers())
        for child_name, child in module.named_children():
            if _has_graph(child):
                visit(child, f"{scope}{child_name}.")

    visit(body, "")
    return list(dict.fromkeys(names))


def _has_graph(module: nn.Module) -> bool:
    return isinstance(getattr(module, "graph", None), fx.Graph)


def adopt_whole_tensors(body: nn.Module, whole: dict[str, torch.Tensor]) -> list[str]:
    """Point ``body``'s parameters and buffers at the whole model's tensors of the same name, drop
    those its graphs do not read (the tracer leaves aliases of tied weights behind); return the
    whole model's names of what it reads."""
    read = read_names(body)
    used: list[str] = []
    for name in read:
        own = name.removeprefix(_PREFIX)
        tensor = whole.get(own) if name.startswith(_PREFIX) else None
        if tensor is None:
            continue  # a constant the tracer lifted out of forward: the graph's own
        _set_tensor(body, name, tensor)
        used.append(own)
    keep = set(read)
    stray = [n for n, _ in body.named_parameters(remove_duplicate=False) if n not in keep]
    stray += [n for n, _ in body.named_buffers(remove_duplicate=False) if n not in keep]
    for name in stray:
        parent, _, leaf = name.rpartition(".")
        owner = body.get_submodule(parent)
        if hasattr(owner, leaf):
            delattr(owner, leaf)
    return used


def _set_tensor(body: nn.Module, name: str, tensor: torch.Tensor) -> None:
    parent, _, leaf = name.rpartition(".")
    owner = body.get_submodule(parent)
    if getattr(owner, leaf, None) is tensor:
        return
    if hasattr(owner, leaf):
        delattr(owner, leaf)
    if isinstance(tensor, nn.Parameter):
        owner.register_parameter(leaf, tensor)
    else:
        owner.register_buffer(leaf, tensor, persistent=False)


def tensor_tree(model: nn.Module, names: Sequence[str]) -> nn.Module:
    """A module holding ``model``'s tensors of ``names`` under those names (empty modules along
    the paths), in ``model``'s order: its ``state_dict`` keys are the whole model's."""
    tensors = whole_tensors(model)
    persistent = set(model.state_dict(keep_vars=True))
    wanted = set(names)
    root = nn.Module()
    for name, tensor in tensors.items():
        if name not in wanted:
            continue
        *path, leaf = name.split(".")
        module = root
        for atom in path:
            child = module._modules.get(atom)
            if child is None:
                child = nn.Module()
                module.add_module(atom, child)
            module = child
        if isinstance(tensor, nn.Parameter):
            module.register_parameter(leaf, tensor)
        else:
            module.register_buffer(leaf, tensor, persistent=name in persistent)
    return root


def assign_names(model: nn.Module, read: Sequence[Sequence[str]]) -> list[list[str]]:
    """Each chunk's names: those its graph reads, and every name no chunk reads given to the
    chunk that reads the same tensor under another name (else to the first): so each of the
    whole model's names is in some chunk."""
    tensors = whole_tensors(model)
    names = [list(r) for r in read]
    seen = {n for r in read for n in r}
    reader = {id(tensors[n]): c for c in reversed(range(len(read))) for n in read[c]}
    for name, tensor in tensors.items():
        if name not in seen:
            names[reader.get(id(tensor), 0)].append(name)
    return names


# ---------------------------------------------------------------------- a rank's pieces


class TracedPieces:
    """A rank's traced chunks of ``model``, cut at ``split_points`` (module paths), and its
    parameters under the whole model's names. Every process builds one alike (each traces the
    whole model: the tracer is deterministic)."""

    def __init__(
        self,
        model: nn.Module,
        split_points: Sequence[str],
        sample: torch.Tensor,
        *,
        num_chunks: int,
        mine: Sequence[int],
    ) -> None:
        check_sample(model, sample)
        self.model = model
        self.split_points = list(split_points)
        self.num_chunks = num_chunks
        self._mine = list(mine)
        self._row = sample[:1].detach().clone()
        self._cache: dict[tuple[int, bool], Chunks] = {}
        chunks, read = self._trace(sample.shape[0])
        # Each chunk's names (the same for every trace: checked in _trace).
        self._read = read
        self.names = assign_names(model, read)
        self._module = tensor_tree(model, [n for c in self._mine for n in self.names[c]])
        self._cache[(sample.shape[0], model.training)] = chunks

    @property
    def module(self) -> nn.Module:
        return self._module

    @property
    def fixed_chunks(self) -> Chunks | None:
        return None  # each micro-batch size has its own traced graphs

    def chunk_of_name(self) -> dict[str, int]:
        """The chunk holding each of the whole model's names."""
        return {n: c for c, names in enumerate(self.names) for n in names}

    def chunks_for(self, batch_size: int) -> Chunks:
        key = (batch_size, self.model.training)
        chunks = self._cache.get(key)
        if chunks is None:
            chunks, read = self._trace(batch_size)
            if read != self._read:
                raise UntraceableModelError(
                    f"tracing {type(self.model).__name__} for a batch of {batch_size} read "
                    f"other parameters per stage than the first trace: {read} vs {self._read}"
                )
            self._cache[key] = chunks
        return chunks

    def _trace(self, batch_size: int) -> tuple[Chunks, list[list[str]]]:
        sample = self._row.expand(batch_size, *self._row.shape[1:]).clone()
        pipe = trace_split(self.model, self.split_points, sample)
        routes = plan_routes(pipe.split_gm, self.num_chunks)
        whole = whole_tensors(self.model)
        read, chunks = [], []
        shape = tuple(self._row.shape[1:])
        for c in range(self.num_chunks):
            body = pipe.get_stage_module(c)
            read.append(adopt_whole_tensors(body, whole))
            if c in self._mine:
                stage = TracedStage(body, routes[c], shape if c == 0 else None)
                chunks.append((c, stage))
        return chunks, read
