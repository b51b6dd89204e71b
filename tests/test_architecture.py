"""stratagem's layering and privacy, checked on its source with ``ast`` (nothing is imported).

Over every ``.py`` under ``src/stratagem/``:

1. a package imports only the packages of ours that LAYERS allows it; imports inside functions
   and under ``if TYPE_CHECKING:`` count, as they are dependencies all the same;
2. no module imports another package's private module (``stratagem.data._structure``) or private
   name (``from stratagem.train.checkpoint import _kind``);
3. no module reaches ``obj._x`` (``obj`` not ``self``, ``cls`` or ``super()``) where ``_x`` is a
   private member that stratagem defines only in other modules;
4. no two modules import each other, directly or through others (an import circle), counting
   every import as rule 1 does, except the circles ALLOWED_CIRCLES lists.
5. no two classes share a name, and no two modules a file name, but those the SHARED_* tables
   list with their reasons; every module docstring is at most 15 lines; no strategy's extended
   object reads or calls its strategy.

The checker is plain functions over source text; the last tests feed it snippets, so that it
cannot pass by reporting nothing.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pytest

# Each package of stratagem (a subfolder, or a top-level module: cli.py is "cli", the root
# __init__.py is "__init__") and the packages of ours it may import. This is the one place the
# layering is written down: a new edge is a deliberate edit here, and it must keep the table
# acyclic. Listed top (may import most) to bottom (imports nothing of ours).
LAYERS: dict[str, set[str]] = {
    # tf.debugging: the device placement log, over sg.device's scopes.
    "debugging": {"distribute", "errors"},
    # Vertex-style studies: trials are jobs.
    "tune": {"jobs", "cluster", "errors"},
    # notebook_launcher: a function as a local cluster of forked workers; it ends a worker's
    # connection itself (atexit does not run in a forked worker).
    "launch": {"cluster", "comm", "errors"},
    # Elastic jobs: torch's elastic agent running the launcher's processes over our store.
    "elastic": {"cluster", "comm", "errors"},
    # Vertex-style custom jobs: launch a script as a local cluster.
    "jobs": {"cluster", "errors"},
    # tf.saved_model's save/load over the directory format of Keras's model.save.
    "saved_model": {"keras"},
    # Keras on top of strategies. It asks a strategy's `extended` about the cluster (which
    # process writes, the world), never the communicator itself: no `comm`. Its pipelined steps
    # drive the stages `PipelineStrategy.pipeline` returns (as torchtitan's trainer owns the
    # pipelined step): `pipeline`.
    # Its losses, metrics, optimizers and Model travel to a coordinator's workers by state:
    # `shipping`'s protocol (`Portable`) only. Keras 3's distribution API (meshes, layouts)
    # is written over `dtensor`.
    "keras": {
        "distribute",
        "dtensor",
        "pipeline",
        "train",
        "data",
        "nn",
        "recompute",
        "shipping",
        "errors",
    },
    # sg.nn: layers that are aware of the strategy in scope.
    "nn": {"distribute", "comm"},
    # Checkpoints: a strategy's public `strategy.extended` says whether this process writes.
    "train": {"distribute", "comm", "cluster", "errors"},
    # Strategies: replicas, values, input pipelines, over the engines below.
    "distribute": {
        "pipeline",
        "dtensor",
        "comm",
        "cluster",
        "data",
        "config",
        "shipping",
        "errors",
    },
    # Function shipping: functions by reference to each task's own copy of the program, and
    # objects by state, as plain data (TF2's coordinator sends its functions this way).
    "shipping": {"comm", "errors"},
    # Pipeline parallelism: stages, schedules, point-to-point sends.
    "pipeline": {"comm", "data", "errors"},
    # DTensor's meshes and layouts.
    "dtensor": {"comm", "cluster", "errors"},
    # tf.data: datasets, no distribution. A parallel map's AUTOTUNE reads the cores this
    # process may use as the thread pools do (`config`).
    "data": {"config", "errors"},
    # Process groups, collectives, RPC, rendezvous.
    "comm": {"cluster", "errors"},
    # Cluster specs, resolvers, the launcher: no torch.
    "cluster": {"errors"},
    # Leaves.
    "config": set(),
    "errors": set(),
    # tf.recompute_grad: activation checkpointing over torch.utils.checkpoint.
    "recompute": set(),
}
# The root package's lazy loader: `sg.<name>` imports that subpackage on first use (importlib,
# by name) and `sg.Model` is keras's Model, so the root may reach every package above; and the
# `stratagem` command, the top, may use any package and the root. Nothing else imports them.
LAYERS["__init__"] = set(LAYERS)
LAYERS["cli"] = set(LAYERS)

# Private names that stratagem defines and that some module also reads on an object that is not
# stratagem's (torch's or Python's own member of the same name). Each entry is
# (the module that reads it, the name): that module's reads of that name are not checked.
FOREIGN_PRIVATE: set[tuple[str, str]] = set()

# Import circles that stand for now, each as the set of its modules; any other circle fails
# test_no_import_circles, and so does an entry here that is no longer a circle (remove it).
# None stands: a new circle is a design question, not an entry here.
ALLOWED_CIRCLES: set[frozenset[str]] = set()

SRC = Path(__file__).resolve().parent.parent / "src"
ROOT = "stratagem"


# --- the source ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """One module of stratagem, parsed."""

    path: str  # "src/stratagem/keras/model.py", as failures print it
    module: str  # "stratagem.keras.model"; a package's __init__.py is the package's name
    package: str  # its LAYERS key: "keras"; "cli" for cli.py; "__init__" for the root
    is_package: bool  # an __init__.py: relative imports resolve from the module itself
    tree: ast.Module


def make_source(relative: str, text: str) -> Source:
    """Parse ``text`` as the module at ``relative`` (a path under src/: "stratagem/keras/x.py")."""
    parts = PurePosixPath(relative).with_suffix("").parts
    assert parts[0] == ROOT, relative
    is_package = parts[-1] == "__init__"
    dotted = parts[:-1] if is_package else parts
    package = "__init__" if len(parts) == 2 and is_package else parts[1]
    return Source(
        path=f"src/{relative}",
        module=".".join(dotted),
        package=package,
        is_package=is_package,
        tree=ast.parse(text, filename=relative),
    )


@functools.cache
def load_sources() -> tuple[Source, ...]:
    """Every module under src/stratagem/, in path order."""
    return tuple(
        make_source(path.relative_to(SRC).as_posix(), path.read_text(encoding="utf-8"))
        for path in sorted((SRC / ROOT).rglob("*.py"))
    )


def packages_of(sources: tuple[Source, ...]) -> set[str]:
    """The LAYERS keys that ``sources`` make up."""
    return {source.package for source in sources}


def is_private(name: str) -> bool:
    """``_x`` and ``__x`` are private; ``__x__`` (a dunder) is not."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


# --- imports -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    """One name an import statement binds from stratagem."""

    line: int
    module: str  # the module the statement names, absolute: "stratagem.data._structure"
    name: str | None  # `from module import name`; None for `import module`

    @property
    def dotted(self) -> str:
        """What is imported, as one dotted path: "stratagem.train.checkpoint._kind"."""
        return self.module if self.name is None else f"{self.module}.{self.name}"


def absolute_module(source: Source, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` names, with a relative one (``from ..x``) resolved."""
    if node.level == 0:
        return node.module or ""
    base = source.module.split(".")
    if not source.is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports_of(source: Source) -> list[Import]:
    """Every import of stratagem in ``source``, wherever it stands (functions, TYPE_CHECKING),
    in line order."""
    found = []
    for node in ast.walk(source.tree):
        if isinstance(node, ast.Import):
            found += [
                Import(node.lineno, alias.name, None)
                for alias in node.names
                if alias.name == ROOT or alias.name.startswith(f"{ROOT}.")
            ]
        elif isinstance(node, ast.ImportFrom):
            module = absolute_module(source, node)
            if module == ROOT or module.startswith(f"{ROOT}."):
                found += [Import(node.lineno, module, alias.name) for alias in node.names]
    return sorted(found, key=lambda imp: imp.line)


def imported_package(imp: Import, packages: set[str]) -> str:
    """The LAYERS key an import reaches: ``from stratagem import keras`` reaches "keras", and
    ``import stratagem`` or ``from stratagem import __version__`` reach the root, "__init__"."""
    parts = imp.module.split(".")
    if len(parts) > 1:
        return parts[1]
    return imp.name if imp.name in packages else "__init__"


def layer_violations(sources: tuple[Source, ...], layers: dict[str, set[str]]) -> list[str]:
    """``file:line: P -> Q (what)`` for each import from package P of a package Q that
    ``layers[P]`` does not allow."""
    packages = packages_of(sources)
    found = []
    for source in sources:
        allowed = layers.get(source.package, set())
        for imp in imports_of(source):
            target = imported_package(imp, packages)
            if target != source.package and target not in allowed:
                found.append(
                    f"{source.path}:{imp.line}: {source.package} -> {target} ({imp.dotted})"
                )
    return found


def private_import_violations(sources: tuple[Source, ...]) -> list[str]:
    """``file:line: ...`` for each import of a private module or private name of another
    package (``stratagem.data._structure`` from keras; ``from stratagem.train.checkpoint import
    _kind`` from distribute). Within one package, private modules and names are its own."""
    packages = packages_of(sources)
    found = []
    for source in sources:
        for imp in imports_of(source):
            target = imported_package(imp, packages)
            if target == source.package:
                continue
            private = [part for part in imp.dotted.split(".")[1:] if is_private(part)]
            if private:
                found.append(
                    f"{source.path}:{imp.line}: {source.package} imports {imp.dotted} "
                    f"({private[0]} is private to {target})"
                )
    return found


# The one door into a package with a public face: from outside it, only these of its modules may
# be imported (the package itself and its public namespaces). `distribute`'s machinery, its
# strategy files and its contract's parts are its own business; what the layers above need,
# `stratagem.distribute` names (its __init__ says which of those are not TF's).
DOORS: dict[str, set[str]] = {
    "distribute": {
        "stratagem.distribute",
        "stratagem.distribute.capabilities",
        "stratagem.distribute.cluster_resolver",
        "stratagem.distribute.coordinator",
        "stratagem.distribute.experimental",
        "stratagem.distribute.partitioners",
    },
}


def door_violations(sources: tuple[Source, ...], doors: dict[str, set[str]]) -> list[str]:
    """``file:line: ...`` for each import, from outside a package with doors, of one of its
    modules that is not a door. The root package (the lazy loader) and the command are the top
    and may reach anything."""
    packages = packages_of(sources)
    modules = {source.module for source in sources}
    found = []
    for source in sources:
        if source.package in ("__init__", "cli"):
            continue
        for imp in imports_of(source):
            target = imported_package(imp, packages)
            if target == source.package or target not in doors:
                continue
            # `from stratagem.distribute import capabilities` reaches the module it names.
            reached = imp.dotted if imp.dotted in modules else imp.module
            if reached not in doors[target]:
                found.append(
                    f"{source.path}:{imp.line}: {source.package} imports {imp.dotted}, behind "
                    f"{target}'s door (import what {target} names: {sorted(doors[target])})"
                )
    return found


# --- private members -----------------------------------------------------------------------------

SELVES = {"self", "cls"}
ATTRIBUTE_FUNCTIONS = {"getattr", "hasattr", "setattr", "delattr"}
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _bound_names(statements: list[ast.stmt]) -> Iterator[str]:
    """The names that ``statements`` (a module's or a class's body) bind at their own level:
    defs, classes, assignments, imports; through if/try/with blocks, not into functions."""
    for node in statements:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        yield name.id
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                yield alias.asname or alias.name.split(".")[0]
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.AsyncWith, ast.For, ast.While)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for item in getattr(node, field, []):
                    yield from _bound_names(
                        item.body if isinstance(item, ast.ExceptHandler) else [item]
                    )


def module_privates(source: Source) -> set[str]:
    """The private names ``source`` binds at module level (``_x = ...``, ``def _f``)."""
    return {name for name in _bound_names(source.tree.body) if is_private(name)}


def _literal(node: ast.expr) -> str | None:
    """The string a node spells out, if it is a string literal."""
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _tag(node: ast.AST) -> str | None:
    """The attribute name that ``obj.__dict__["_x"] = ...`` or ``setattr(obj, "_x", ...)``
    stores, else None."""
    if (
        isinstance(node, ast.Subscript)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "__dict__"
    ):
        return _literal(node.slice)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "setattr"
        and len(node.args) >= 2
    ):
        return _literal(node.args[1])
    return None


def class_privates(source: Source) -> set[str]:
    """The private members of the objects ``source`` makes: methods and class attributes
    (``def _x``, ``_x: int``), instance attributes (``self._x = ...``), and attributes it tags
    other objects with by name (``obj.__dict__["_x"] = ...``, ``setattr(obj, "_x", ...)``)."""
    names = set()
    for node in ast.walk(source.tree):
        if isinstance(node, ast.ClassDef):
            names.update(_bound_names(node.body))
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in SELVES
        ):
            names.add(node.attr)
        elif name := _tag(node):
            names.add(name)
    return {name for name in names if is_private(name)}


def private_definitions(sources: tuple[Source, ...]) -> dict[str, set[str]]:
    """Each private name stratagem defines (module level or in a class), and the modules that
    define it."""
    defined: dict[str, set[str]] = {}
    for source in sources:
        for name in module_privates(source) | class_privates(source):
            defined.setdefault(name, set()).add(source.module)
    return defined


def class_modules(sources: tuple[Source, ...]) -> dict[str, set[str]]:
    """Each class name stratagem defines, and the modules that define it."""
    found: dict[str, set[str]] = {}
    for source in sources:
        for node in ast.walk(source.tree):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, set()).add(source.module)
    return found


def annotated_class(annotation: ast.expr | None) -> str | None:
    """The one class an annotation names (``Strategy``, ``base.Strategy``, ``Strategy | None``,
    ``"Strategy"``), or None."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return None
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        sides = {annotated_class(annotation.left), annotated_class(annotation.right)} - {"None"}
        return sides.pop() if len(sides) == 1 else None
    if isinstance(annotation, ast.Name):
        return annotation.id
    if isinstance(annotation, ast.Attribute):
        return annotation.attr
    if isinstance(annotation, ast.Constant) and annotation.value is None:
        return "None"
    return None


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> list[ast.arg]:
    """Every parameter of ``function``."""
    args = function.args
    extra = [arg for arg in (args.vararg, args.kwarg) if arg is not None]
    return [*args.posonlyargs, *args.args, *args.kwonlyargs, *extra]


def _attribute_types(cls: ast.ClassDef) -> dict[str, str]:
    """``{"self.x": class}`` for the attributes of ``cls`` an annotation types: ``x: C`` in the
    class body, ``self.x: C = ...``, or ``self.x = p`` where ``p`` is a parameter ``p: C``."""
    types = {}
    for statement in cls.body:
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and (kind := annotated_class(statement.annotation))
        ):
            types[f"self.{statement.target.id}"] = kind
    for method in cls.body:
        if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        parameters = {
            a.arg: kind for a in _parameters(method) if (kind := annotated_class(a.annotation))
        }
        for node in ast.walk(method):
            target = node.target if isinstance(node, ast.AnnAssign) else None
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
            if not (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                continue
            if isinstance(node, ast.AnnAssign):
                kind = annotated_class(node.annotation)
            else:
                kind = parameters.get(node.value.id) if isinstance(node.value, ast.Name) else None
            if kind:
                types.setdefault(f"self.{target.attr}", kind)
    return types


def _inherited_types(cls: ast.ClassDef, classes: dict[str, ast.ClassDef]) -> dict[str, str]:
    """``_attribute_types`` of ``cls`` and of its bases that its own module defines."""
    types: dict[str, str] = {}
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in classes and classes[base.id] is not cls:
            types |= _inherited_types(classes[base.id], classes)
    return types | _attribute_types(cls)


def _typed_nodes(
    node: ast.AST, types: dict[str, str], classes: dict[str, ast.ClassDef]
) -> Iterator[tuple[ast.AST, dict[str, str]]]:
    """Every node under ``node``, with what annotations in scope say of names there:
    ``{"strategy": "Strategy", "self._strategy": "Strategy"}`` (parameters, annotated locals,
    attributes of the enclosing class and of its bases in ``classes``, the module's own)."""
    yield node, types
    if isinstance(node, ast.ClassDef):
        types = {k: v for k, v in types.items() if not k.startswith("self.")}
        types |= _inherited_types(node, classes)
    elif isinstance(node, FUNCTIONS):
        types = {k: v for k, v in types.items() if k not in {a.arg for a in _parameters(node)}}
        types |= {a.arg: kind for a in _parameters(node) if (kind := annotated_class(a.annotation))}
        for statement in ast.walk(node):
            if (
                isinstance(statement, ast.AnnAssign)
                and isinstance(statement.target, ast.Name)
                and (kind := annotated_class(statement.annotation))
            ):
                types[statement.target.id] = kind
    for child in ast.iter_child_nodes(node):
        yield from _typed_nodes(child, types, classes)


def _is_self(node: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: an object whose private members are its own."""
    if isinstance(node, ast.Name):
        return node.id in SELVES
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


@dataclass(frozen=True)
class Access:
    """One reach for a private member of an object other than ``self``/``cls``/``super()``."""

    line: int
    name: str  # "_comm"
    text: str  # "strategy._comm", as written
    kind: str | None  # the object's class where an annotation says it ("Strategy"), else None


def private_accesses(source: Source) -> list[Access]:
    """Each ``obj._x`` in ``source`` (read, call or write) and each ``getattr(obj, "_x")``
    (or hasattr, setattr, delattr), where ``obj`` is not ``self``, ``cls`` or ``super()``."""
    classes = {node.name: node for node in ast.walk(source.tree) if isinstance(node, ast.ClassDef)}
    found = []
    for node, types in _typed_nodes(source.tree, {}, classes):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            receiver, name, text = node.value, node.attr, ast.unparse(node)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ATTRIBUTE_FUNCTIONS
            and len(node.args) >= 2
            and is_private(_literal(node.args[1]) or "")
        ):
            receiver, name, text = node.args[0], _literal(node.args[1]), ast.unparse(node)
        else:
            continue
        if not _is_self(receiver):
            found.append(Access(node.lineno, name, text, types.get(ast.unparse(receiver))))
    return sorted(found, key=lambda access: access.line)


def private_member_violations(
    sources: tuple[Source, ...], foreign: set[tuple[str, str]] | None = None
) -> list[str]:
    """``file:line: obj._x (_x is private to ...)`` for each reach from module M for a private
    member ``_x`` that stratagem defines in another module. Allowed:

    - a name no other module of stratagem defines: M's own, or torch's or Python's
      (``module._parameters``, ``torch._C``, ``sys._getframe``); ``foreign`` lists (module,
      name) pairs where a name stratagem does define is read on torch's or Python's objects;
    - an object that an annotation types as a class of M (another instance of the same class,
      or two classes of M cooperating);
    - an object of unknown class, when a class of M has a member ``_x`` too (it is taken as
      that class's). An object typed as a class of another module is never M's; nor is a name
      M binds only at module level (``_f`` is not ``obj._f``).
    """
    defined = private_definitions(sources)
    classes = class_modules(sources)
    found = []
    for source in sources:
        own_classes = {name for name, modules in classes.items() if source.module in modules}
        own_members = class_privates(source)
        for access in private_accesses(source):
            elsewhere = defined.get(access.name, set()) - {source.module}
            if not elsewhere or (source.module, access.name) in (foreign or set()):
                continue
            if access.kind in own_classes:
                continue
            if access.kind not in classes and access.name in own_members:
                continue
            if access.kind in classes and elsewhere & classes[access.kind]:
                elsewhere &= classes[access.kind]
            found.append(
                f"{source.path}:{access.line}: {access.text} ({access.name} is private to "
                f"{', '.join(sorted(elsewhere))})"
            )
    return found


# --- import circles ------------------------------------------------------------------------------


def imported_module(imp: Import, modules: set[str]) -> str | None:
    """The module of ours an import reaches: ``from pkg.mod import name`` is ``pkg.mod.name``
    where that is a module (a submodule), else ``pkg.mod`` (``from pkg import name``: the
    package's ``__init__``); ``import pkg.mod`` is ``pkg.mod``. A path that names no module (a
    typo, a module being moved) reaches the nearest module above it."""
    parts = (imp.dotted if imp.dotted in modules else imp.module).split(".")
    while parts and ".".join(parts) not in modules:
        parts = parts[:-1]
    return ".".join(parts) or None


def module_imports(sources: tuple[Source, ...]) -> Iterator[tuple[Source, Import, str]]:
    """Each import of one module of ``sources`` by another, wherever it stands (functions,
    ``if TYPE_CHECKING:``: a lazy import is a dependency all the same), with the module it
    reaches."""
    modules = {source.module for source in sources}
    for source in sources:
        for imp in imports_of(source):
            target = imported_module(imp, modules)
            if target is not None and target != source.module:
                yield source, imp, target


def module_graph(sources: tuple[Source, ...]) -> dict[str, set[str]]:
    """Each module of ``sources`` and the modules of ours it imports."""
    graph: dict[str, set[str]] = {source.module: set() for source in sources}
    for source, _, target in module_imports(sources):
        graph[source.module].add(target)
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of ``graph`` with more than one module: each a circle
    of imports (every module in it reaches every other), sorted, in sorted order. Tarjan's
    algorithm, with an explicit stack rather than recursion."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def enter(module: str) -> tuple[str, Iterator[str]]:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        return module, iter(sorted(graph.get(module, set())))

    for root in sorted(graph):
        if root in index:
            continue
        work = [enter(root)]
        while work:
            module, targets = work[-1]
            target = next(targets, None)
            if target is None:  # every import of ``module`` followed
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[module])
                if low[module] == index[module]:  # the root of a component: pop it whole
                    component = set()
                    while module not in component:
                        component.add(stack.pop())
                    on_stack.difference_update(component)
                    if len(component) > 1:
                        circles.append(tuple(sorted(component)))
            elif target not in index:
                work.append(enter(target))
            elif target in on_stack:
                low[module] = min(low[module], index[target])
    return sorted(circles)


def circle_problems(sources: tuple[Source, ...], allowed: set[frozenset[str]]) -> list[str]:
    """Each import circle of ``sources`` that ``allowed`` does not list, with the imports that
    make it (``file:line: a -> b``), and each entry of ``allowed`` that is no longer a circle."""
    circles = import_circles(module_graph(sources))
    found = []
    for circle in circles:
        if frozenset(circle) in allowed:
            continue
        members = set(circle)
        edges = dict.fromkeys(  # one line for `from m import a, b`
            f"{source.path}:{imp.line}: {source.module} -> {target}"
            for source, imp, target in module_imports(sources)
            if source.module in members and target in members
        )
        found.append(f"{', '.join(circle)}\n" + "\n".join(f"      {edge}" for edge in edges))
    found += [
        f"ALLOWED_CIRCLES lists {', '.join(sorted(entry))}, which is no longer a circle: "
        "remove the entry"
        for entry in sorted(allowed - {frozenset(circle) for circle in circles}, key=sorted)
    ]
    return found


# --- the table -----------------------------------------------------------------------------------


def find_cycle(layers: dict[str, set[str]]) -> list[str] | None:
    """A cycle of allowed edges, as the packages along it (first one repeated at the end), or
    None when the table is acyclic."""
    done: set[str] = set()

    def visit(package: str, path: list[str]) -> list[str] | None:
        if package in path:
            return [*path[path.index(package) :], package]
        if package in done:
            return None
        for target in sorted(layers.get(package, set())):
            cycle = visit(target, [*path, package])
            if cycle:
                return cycle
        done.add(package)
        return None

    for package in sorted(layers):
        cycle = visit(package, [])
        if cycle:
            return cycle
    return None


def table_problems(packages: set[str], layers: dict[str, set[str]]) -> list[str]:
    """What is wrong with ``layers`` for the ``packages`` there are: a package it does not list
    (a new one: say what it may import), or a package it names that does not exist."""
    problems = [
        f"package {package} is not in LAYERS: add it, with the packages it may import"
        for package in sorted(packages - layers.keys())
    ]
    problems += [
        f"LAYERS names {target} (in {package}'s entry), which src/stratagem/ does not have"
        for package in sorted(layers)
        for target in sorted(layers[package] | {package})
        if target not in packages
    ]
    return problems


def _report(title: str, found: list[str]) -> str:
    """A failure message: the rule, then one offender a line."""
    return f"{title} ({len(found)}):\n" + "\n".join(f"  {line}" for line in found)


# --- stratagem's source --------------------------------------------------------------------------


def test_every_package_is_in_the_table():
    problems = table_problems(packages_of(load_sources()), LAYERS)
    assert not problems, _report("LAYERS and src/stratagem/ disagree", problems)


def test_the_table_is_acyclic():
    cycle = find_cycle(LAYERS)
    assert cycle is None, f"LAYERS allows a cycle: {' -> '.join(cycle)}"


def test_imports_follow_the_layers():
    found = layer_violations(load_sources(), LAYERS)
    assert not found, _report("imports that LAYERS does not allow", found)


def test_no_import_of_another_packages_private_parts():
    found = private_import_violations(load_sources())
    assert not found, _report("imports of another package's private module or name", found)


def test_other_packages_use_the_doors_of_distribute():
    found = door_violations(load_sources(), DOORS)
    assert not found, _report("imports behind a package's door", found)


def test_checker_reports_an_import_behind_the_door_and_allows_the_doors():
    inside = "from stratagem.distribute.machinery import context"  # distribute's own: allowed
    sources = _sources(
        {
            "distribute/__init__": "",
            "distribute/capabilities": "",
            "distribute/machinery/__init__": "",
            "distribute/machinery/context": "",
            "distribute/extended": inside,
            "keras/x": (
                "from stratagem.distribute import get_strategy, capabilities\n"
                "from stratagem.distribute.capabilities import PipelinedSteps\n"
                "def f():\n"
                "    from stratagem.distribute.machinery.context import current_replica\n"
                "from stratagem.distribute.machinery import context\n"
            ),
        }
    )
    doors = {"distribute": {"stratagem.distribute", "stratagem.distribute.capabilities"}}
    found = door_violations(sources, doors)
    assert len(found) == 2, found
    assert found[0].startswith("src/stratagem/keras/x.py:4: keras imports "), found
    assert "stratagem.distribute.machinery.context.current_replica, behind" in found[0], found
    assert found[1].startswith("src/stratagem/keras/x.py:5: keras imports "), found
    assert "stratagem.distribute.machinery.context, behind distribute's door" in found[1], found


def test_no_access_to_private_members_of_other_modules():
    found = private_member_violations(load_sources(), FOREIGN_PRIVATE)
    assert not found, _report("private members reached from another module", found)


def test_no_import_circles():
    found = circle_problems(load_sources(), ALLOWED_CIRCLES)
    assert not found, _report("import circles (modules that import each other)", found)


# --- the checker itself --------------------------------------------------------------------------


def _sources(modules: dict[str, str]) -> tuple[Source, ...]:
    """Synthetic sources, by path under src/stratagem/ without ".py": {"data/x": "..."}."""
    return tuple(make_source(f"{ROOT}/{path}.py", text) for path, text in modules.items())


@pytest.mark.parametrize(
    "text, edge",
    [
        ("from stratagem.keras import Model\n", "data -> keras (stratagem.keras.Model)"),
        ("import stratagem.keras.model\n", "data -> keras (stratagem.keras.model)"),
        ("from stratagem import keras\n", "data -> keras (stratagem.keras)"),
        ("import stratagem\n", "data -> __init__ (stratagem)"),
        ("from .. import keras\n", "data -> keras (stratagem.keras)"),
        ("from ..keras.model import Model\n", "data -> keras (stratagem.keras.model.Model)"),
        ("def f():\n    from stratagem.comm import runtime\n", "data -> comm"),
        (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from stratagem.distribute.strategy import Strategy\n",
            "data -> distribute",
        ),
    ],
)
def test_checker_reports_an_upward_import(text, edge):
    sources = _sources({"data/x": text, "data/y": "", "keras/model": "", "comm/runtime": ""})
    found = layer_violations(sources, {"data": {"errors"}})
    assert len(found) == 1 and found[0].startswith("src/stratagem/data/x.py:"), found
    assert edge in found[0], found


def test_checker_allows_listed_and_own_package_imports():
    sources = _sources(
        {
            "data/x": "from stratagem.errors import InvalidArgumentError\n"
            "from stratagem.data import y\nfrom . import y\nfrom ._z import w\n",
            "data/y": "",
            "data/_z": "",
            "errors": "",
        }
    )
    assert layer_violations(sources, {"data": {"errors"}}) == []


@pytest.mark.parametrize(
    "text, private",
    [
        ("from stratagem.data._structure import unpack_batch\n", "_structure"),
        ("from stratagem.data import _structure\n", "_structure"),
        ("import stratagem.data._structure\n", "_structure"),
        ("from stratagem.train.checkpoint import _kind\n", "_kind"),
        ("def f():\n    from stratagem.data._shuffle import derive_seed\n", "_shuffle"),
    ],
)
def test_checker_reports_a_private_import(text, private):
    sources = _sources({"keras/x": text, "data/_structure": "", "train/checkpoint": ""})
    found = private_import_violations(sources)
    assert len(found) == 1 and found[0].startswith("src/stratagem/keras/x.py:"), found
    assert f"({private} is private to " in found[0], found


def test_checker_allows_private_imports_within_a_package():
    sources = _sources(
        {
            "data/x": "from stratagem.data._structure import unpack_batch\n"
            "from stratagem.data import _structure\nfrom ._structure import _helper\n",
            "data/_structure": "_helper = 1\n",
        }
    )
    assert private_import_violations(sources) == []


OWNER = """
_registry = {}

class Owner:
    _slot: int = 0

    def __init__(self):
        self._state = 1

    def _hook(self):
        return self._state


def tag(tensor):
    tensor.__dict__["_tagged"] = True
"""

# Readers that define some of Owner's private names themselves, and still reach for Owner's.
TYPED_READER = """
class Reader:
    def __init__(self, owner: Owner | None):
        self._state = 0
        self._owner = owner

    def peek(self, other: Owner):
        return other._state

class SubReader(Reader):
    def peek(self):
        return self._owner._state
"""
SHADOWING_READER = """
def _hook(value):
    return value

def f(other):
    return other._hook()
"""


@pytest.mark.parametrize(
    "text, access",
    [
        ("def f(other):\n    return other._state\n", "other._state"),
        ("def f(other):\n    other._hook()\n", "other._hook"),
        ("def f(other):\n    other._slot = 2\n", "other._slot"),
        ("from stratagem.comm import owner\nx = owner._registry\n", "owner._registry"),
        ("def f(other):\n    return getattr(other, '_state', None)\n", "getattr(other,"),
        ("def f(a):\n    return a.b._state\n", "a.b._state"),
        ("def f(t):\n    return getattr(t, '_tagged', False)\n", "getattr(t, '_tagged'"),
        (SHADOWING_READER, "other._hook"),
    ],
)
def test_checker_reports_a_private_member_of_another_module(text, access):
    sources = _sources({"comm/owner": OWNER, "comm/reader": text})
    found = private_member_violations(sources)
    assert len(found) == 1 and found[0].startswith("src/stratagem/comm/reader.py:"), found
    assert access in found[0] and "private to stratagem.comm.owner" in found[0], found


def test_checker_reports_an_annotated_object_of_another_modules_class():
    sources = _sources({"comm/owner": OWNER, "comm/reader": TYPED_READER})
    found = private_member_violations(sources)
    assert [line.split(" (")[0] for line in found] == [
        "src/stratagem/comm/reader.py:8: other._state",
        "src/stratagem/comm/reader.py:12: self._owner._state",
    ], found
    assert all("_state is private to stratagem.comm.owner" in line for line in found), found


def test_checker_allows_own_and_foreign_private_members():
    reader = """
import sys
import torch

class Reader:
    def __init__(self, other):
        self._other = other
        self._state = 0

    def peer(self, other):
        return self._other._other, other._state, super()._hook, type(self)._x

    def same(self, other: Reader):
        return other._hook, other._registry

    @classmethod
    def make(cls):
        return cls._x, torch._C, sys._getframe(0), torch.nn.Module()._parameters

_x = 1
"""
    sources = _sources({"comm/owner": OWNER, "comm/reader": reader})
    assert private_member_violations(sources) == []
    torchy = "def f(module):\n    return module._hook\n"
    sources = _sources({"comm/owner": OWNER, "comm/reader": torchy})
    assert len(private_member_violations(sources)) == 1
    assert private_member_violations(sources, {("stratagem.comm.reader", "_hook")}) == []


def test_checker_finds_cycles_and_unlisted_packages():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    sources = _sources({"__init__": "", "cli": "", "data/x": "", "data/__init__": "", "new": ""})
    assert packages_of(sources) == {"__init__", "cli", "data", "new"}
    layers = {"__init__": {"data"}, "cli": {"data", "gone"}, "data": set()}
    problems = table_problems(packages_of(sources), layers)
    assert len(problems) == 2, problems
    assert problems[0].startswith("package new is not in LAYERS"), problems
    assert problems[1].startswith("LAYERS names gone (in cli's entry)"), problems


# A package whose modules import each other twice over: x <-> y through an import inside a
# function, p <-> q through one under TYPE_CHECKING; and imports that make no circle (a package
# __init__ re-exporting its module, another package importing that __init__, a module importing
# itself by name).
CIRCLES = {
    "data/__init__": "from stratagem.data.x import X\n",
    "data/x": "from . import y\n\nX = 1\n",
    "data/y": "def f():\n    from stratagem.data.x import X\n\n    return X\n",
    "comm/__init__": "",
    "comm/p": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from ..comm.q import Q\n",
    "comm/q": "from stratagem.comm.p import A, B\n\nQ = 1\n",
    "errors": "",
    "keras/m": "import stratagem.keras.m\nfrom stratagem import errors\n"
    "from stratagem.data import X\n",
}


def test_checker_builds_the_module_graph():
    graph = module_graph(_sources(CIRCLES))
    assert graph == {
        "stratagem.data": {"stratagem.data.x"},
        "stratagem.data.x": {"stratagem.data.y"},
        "stratagem.data.y": {"stratagem.data.x"},
        "stratagem.comm": set(),
        "stratagem.comm.p": {"stratagem.comm.q"},
        "stratagem.comm.q": {"stratagem.comm.p"},
        "stratagem.errors": set(),
        "stratagem.keras.m": {"stratagem.errors", "stratagem.data"},
    }, graph


def test_checker_finds_circles_through_lazy_and_type_checking_imports():
    graph = module_graph(_sources(CIRCLES))
    assert import_circles(graph) == [
        ("stratagem.comm.p", "stratagem.comm.q"),
        ("stratagem.data.x", "stratagem.data.y"),
    ]
    # One long circle, its modules found in any order, with a chord and a tail outside it.
    ring = {"a": {"b"}, "b": {"c", "e"}, "c": {"d", "a"}, "d": {"b"}, "e": set(), "f": {"a"}}
    assert import_circles(ring) == [("a", "b", "c", "d")]
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_checker_reports_each_circle_and_each_stale_allowance():
    sources = _sources(CIRCLES)
    allowed = {
        frozenset({"stratagem.data.x", "stratagem.data.y"}),
        frozenset({"stratagem.comm.p", "stratagem.comm.gone"}),
    }
    found = circle_problems(sources, allowed)
    assert len(found) == 2, found
    assert found[0].splitlines() == [
        "stratagem.comm.p, stratagem.comm.q",
        "      src/stratagem/comm/p.py:4: stratagem.comm.p -> stratagem.comm.q",
        "      src/stratagem/comm/q.py:1: stratagem.comm.q -> stratagem.comm.p",
    ], found[0]
    assert found[1] == (
        "ALLOWED_CIRCLES lists stratagem.comm.gone, stratagem.comm.p, which is no longer a "
        "circle: remove the entry"
    ), found[1]
    assert (
        circle_problems(sources, {frozenset(c) for c in import_circles(module_graph(sources))})
        == []
    )


# --- class names ---------------------------------------------------------------------------------

# Class names that two modules may share, each with the reason. Keras itself defines these
# losses and metrics under one name in both `keras.losses` and `keras.metrics`; and TF's one
# `tf.keras.metrics.X(mesh=...)` is ported twice, as `sg.keras.metrics.X` and the DTensor metric
# `sg.dtensor.metrics.X(mesh=...)` (the seed's spelling, docs/porting.md). Every other class
# name is defined once, so a name in a traceback, a repr or a grep finds the one class.
SHARED_CLASS_NAMES: dict[str, str] = {
    "BinaryCrossentropy": "keras.losses and keras.metrics (Keras API)",
    "CategoricalCrossentropy": "keras.losses and keras.metrics (Keras API)",
    "KLDivergence": "keras.losses and keras.metrics (Keras API)",
    "MeanAbsoluteError": "keras.losses and keras.metrics (Keras API)",
    "MeanSquaredError": "keras.losses and keras.metrics (Keras API)",
    "SparseCategoricalCrossentropy": "keras.losses and keras.metrics (Keras API)",
    "LayoutMap": (
        "dtensor (tf.keras.dtensor.experimental.LayoutMap) and keras.distribution (Keras 3's "
        "keras.distribution.LayoutMap, TensorLayout values)"
    ),
    "Mean": "keras.metrics and dtensor.metrics (tf.keras.metrics.Mean, with mesh= on DTensor)",
    "SparseCategoricalAccuracy": (
        "keras.metrics and dtensor.metrics (tf.keras.metrics.SparseCategoricalAccuracy, with "
        "mesh= on DTensor)"
    ),
}


def class_definitions(sources: tuple[Source, ...]) -> dict[str, list[str]]:
    """Each class name, and where each class of that name is defined ("path:line")."""
    found: dict[str, list[str]] = {}
    for source in sources:
        for node in ast.walk(source.tree):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(f"{source.path}:{node.lineno}")
    return found


def duplicate_class_problems(sources: tuple[Source, ...], shared: dict[str, str]) -> list[str]:
    """Names of more than one class, unless ``shared`` lists them; and stale ``shared`` entries."""
    return shared_name_problems(
        class_definitions(sources), shared, "SHARED_CLASS_NAMES", "class(es)"
    )


def shared_name_problems(
    places: dict[str, list[str]], shared: dict[str, str], table: str, what: str
) -> list[str]:
    """The names with several ``places`` that ``shared`` does not list, then the entries of
    ``shared`` (the table named ``table``) that fewer than two places bear: a ``what`` of
    that name was renamed or removed, and the entry must go too."""
    problems = [
        f"{name}: {', '.join(where)}"
        for name, where in sorted(places.items())
        if len(where) > 1 and name not in shared
    ]
    problems += [
        f"{table} lists {name}, which {len(places.get(name, []))} {what} bear, not several: "
        "remove the entry"
        for name in sorted(shared)
        if len(places.get(name, [])) < 2
    ]
    return problems


def test_no_two_classes_share_a_name():
    found = duplicate_class_problems(load_sources(), SHARED_CLASS_NAMES)
    assert not found, _report(
        "class names defined more than once (rename one, or list it in SHARED_CLASS_NAMES)", found
    )


def test_checker_reports_classes_that_share_a_name():
    sources = _sources(
        {
            "data/x": "class Shard:\n    pass\n\n\nclass Fine:\n    class Inner:\n        pass\n",
            "data/y": "def f():\n    class Inner:\n        pass\n",
            "comm/z": "class Shard:\n    pass\nclass Listed:\n    pass\n",
            "comm/w": "class Listed:\n    pass\n",
        }
    )
    found = duplicate_class_problems(sources, {"Listed": "why", "Gone": "why"})
    assert found == [
        "Inner: src/stratagem/data/x.py:6, src/stratagem/data/y.py:2",
        "Shard: src/stratagem/data/x.py:1, src/stratagem/comm/z.py:1",
        "SHARED_CLASS_NAMES lists Gone, which 0 class(es) bear, not several: remove the entry",
    ], found
    assert duplicate_class_problems(sources, {"Inner": "", "Listed": "", "Shard": ""}) == []


# --- file names ----------------------------------------------------------------------------------

# File names that several packages may share, each with the reason. Every other module's file
# name is unique under src/stratagem/, so that it says what the file holds wherever it is read
# (a traceback's last line, an editor's tab, a log).
SHARED_FILE_NAMES: dict[str, str] = {
    "__init__.py": "a package",
    "experimental.py": "TF's `experimental` namespaces (sg.distribute.experimental, ...)",
    "errors.py": "a package's own error classes (sg.errors, sg.dtensor's, sg.tune's)",
    "metrics.py": "the public namespaces sg.keras.metrics and sg.dtensor.metrics",
}


def duplicate_file_problems(sources: tuple[Source, ...], shared: dict[str, str]) -> list[str]:
    """File names of more than one module, unless ``shared`` lists them; and stale entries."""
    paths: dict[str, list[str]] = {}
    for source in sources:
        paths.setdefault(PurePosixPath(source.path).name, []).append(source.path)
    return shared_name_problems(paths, shared, "SHARED_FILE_NAMES", "module(s)")


def test_no_two_modules_share_a_file_name():
    found = duplicate_file_problems(load_sources(), SHARED_FILE_NAMES)
    assert not found, _report(
        "file names used by several modules (name each for what it holds, or list it in "
        "SHARED_FILE_NAMES)",
        found,
    )


def test_checker_reports_modules_that_share_a_file_name():
    sources = _sources({"data/values": "", "comm/values": "", "comm/kept": "", "data/kept": ""})
    found = duplicate_file_problems(sources, {"kept.py": "why", "gone.py": "why"})
    assert found == [
        "values.py: src/stratagem/data/values.py, src/stratagem/comm/values.py",
        "SHARED_FILE_NAMES lists gone.py, which 0 module(s) bear, not several: remove the entry",
    ], found
    assert duplicate_file_problems(sources, {"kept.py": "", "values.py": ""}) == []


# --- module docstrings ---------------------------------------------------------------------------

# A module's docstring says what the module does and its contract; the reasoning behind it goes
# to docs/architecture.md, figures to docs/benchmarks.md, history to the commit log.
MAX_MODULE_DOCSTRING_LINES = 15


def long_module_docstrings(
    sources: tuple[Source, ...], limit: int = MAX_MODULE_DOCSTRING_LINES
) -> list[str]:
    """Each module whose docstring runs past ``limit`` lines, counted from the line of its
    opening quotes to the line of its closing ones."""
    found = []
    for source in sources:
        first = source.tree.body[0] if source.tree.body else None
        if not (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
        ):
            continue
        lines = (first.end_lineno or first.lineno) - first.lineno + 1
        if lines > limit:
            found.append(f"{source.path}:{first.lineno}: {lines} lines")
    return found


def test_module_docstrings_are_short():
    found = long_module_docstrings(load_sources())
    assert not found, _report(
        f"module docstrings longer than {MAX_MODULE_DOCSTRING_LINES} lines (say what the module "
        "does and its contract; reasoning goes to docs/architecture.md)",
        found,
    )


def test_checker_reports_a_long_module_docstring():
    def docstring(lines: int) -> str:  # a docstring of exactly ``lines`` lines, quotes included
        return '"""' + "\n".join(f"line {i}" for i in range(lines - 1)) + '\n"""\n'

    function = "def f():\n    " + docstring(30).replace("\n", "\n    ") + "\n"
    sources = _sources(
        {
            "comm/long": docstring(16),
            "comm/limit": docstring(15),
            "comm/later": "# a comment first\n\n" + docstring(17) + "x = 1\n",
            "comm/none": "x = 1\n",
            "comm/empty": "",
            "comm/function": function,
        }
    )
    found = long_module_docstrings(sources)
    assert found == [
        "src/stratagem/comm/long.py:1: 16 lines",
        "src/stratagem/comm/later.py:3: 17 lines",
    ], found
    assert long_module_docstrings(sources, limit=16) == ["src/stratagem/comm/later.py:3: 17 lines"]


# --- a strategy's extended object never calls back up into its strategy ---------------------------
#
# The strategy delegates down to ``strategy.extended``, which does the work (the two-class rule
# of docs/writing_a_strategy.md). A ``StrategyExtended`` subclass under distribute/ may hold its
# container strategy and hand it on (``scope_hooks.claim(p, self._container)``, ``type(...)``,
# ``ctx.strategy is self.strategy``), never read or call an attribute of it: no
# ``self._container.x``, ``self.strategy.x``, ``getattr(self.strategy, "x")``, nor the same
# through a local name bound to it, nor on the constructor's container parameter. Which
# attributes hold the container is read from the base class (whatever they are named).

EXTENDED_BASE = "StrategyExtended"


def _functions(cls: ast.ClassDef) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [f for f in cls.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _self_attributes_bound_to(
    function: ast.FunctionDef | ast.AsyncFunctionDef, name: str
) -> set[str]:
    """The ``self.x`` that ``function`` assigns ``name`` to (``self._container = container``)."""
    return {
        target.attr
        for node in ast.walk(function)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Name)
        and node.value.id == name
        for target in node.targets
        if isinstance(target, ast.Attribute) and _is_self(target.value)
    }


def _container_parameter(
    cls: ast.ClassDef,
) -> tuple[ast.FunctionDef | ast.AsyncFunctionDef | None, str | None]:
    """The class's ``__init__`` and its first parameter after ``self`` (the container)."""
    init = next((f for f in _functions(cls) if f.name == "__init__"), None)
    if init is None or len(init.args.args) < 2:
        return init, None
    return init, init.args.args[1].arg


def container_attributes(base: ast.ClassDef) -> set[str]:
    """The attributes of the extended base class that hold its container strategy: those its
    ``__init__`` binds to the container parameter, and the properties returning one of them."""
    init, param = _container_parameter(base)
    held = _self_attributes_bound_to(init, param) if init is not None and param else set()
    for function in _functions(base):
        returns = [n for n in ast.walk(function) if isinstance(n, ast.Return) and n.value]
        if any(
            isinstance(d, ast.Name) and d.id == "property" for d in function.decorator_list
        ) and any(
            isinstance(r.value, ast.Attribute) and _is_self(r.value.value) and r.value.attr in held
            for r in returns
        ):
            held = held | {function.name}
    return held


def _extended_classes(sources: tuple[Source, ...]) -> list[tuple[Source, ast.ClassDef]]:
    """Every subclass of the extended base (through other subclasses, by name) under
    distribute/, the base itself left out (it defines what holding the container means)."""
    classes = [
        (source, node)
        for source in sources
        if source.package == "distribute"
        for node in ast.walk(source.tree)
        if isinstance(node, ast.ClassDef)
    ]
    names = {EXTENDED_BASE}
    found: list[tuple[Source, ast.ClassDef]] = []
    grew = True
    while grew:
        grew = False
        for source, cls in classes:
            bases = {
                b.id if isinstance(b, ast.Name) else getattr(b, "attr", None) for b in cls.bases
            }
            if cls.name not in names and bases & names:
                names.add(cls.name)
                found.append((source, cls))
                grew = True
    return sorted(found, key=lambda pair: (pair[0].path, pair[1].lineno))


def _container_reads(
    function: ast.FunctionDef | ast.AsyncFunctionDef,
    held: set[str],
    names: set[str],
    returners: set[str] | frozenset[str] = frozenset(),
) -> Iterator[ast.AST]:
    """The nodes of ``function`` that read, call or set an attribute of the container:
    ``held`` are the ``self`` attributes holding it, ``names`` the local names that do (the
    constructor's parameter), ``returners`` the methods returning it (``self.m()``); a local
    name assigned one of these holds it too. A ``return`` of the container is yielded as well
    (``callback_violations`` takes it to make the method a returner, not to report it)."""
    names = set(names)

    def is_container(node: ast.expr | None) -> bool:
        if isinstance(node, ast.Attribute):
            return _is_self(node.value) and node.attr in held
        if isinstance(node, ast.Call):
            func = node.func
            return (
                isinstance(func, ast.Attribute)
                and _is_self(func.value)
                and (func.attr in returners)
            )
        return isinstance(node, ast.Name) and node.id in names

    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and is_container(node.value):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    for node in ast.walk(function):
        if isinstance(node, ast.Return) and is_container(node.value):
            yield node
            continue
        if isinstance(node, ast.Attribute):
            receiver: ast.expr | None = node.value
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ATTRIBUTE_FUNCTIONS
            and node.args
        ):
            receiver = node.args[0]
        else:
            receiver = None
        if receiver is not None and is_container(receiver):
            yield node


def callback_violations(sources: tuple[Source, ...]) -> list[str]:
    """``file:line: text (Class reads its strategy)`` for each attribute of the container
    strategy that a ``StrategyExtended`` subclass under distribute/ reads, calls or sets."""
    base = next(
        (
            node
            for source in sources
            for node in ast.walk(source.tree)
            if isinstance(node, ast.ClassDef) and node.name == EXTENDED_BASE
        ),
        None,
    )
    assert base is not None, f"no class {EXTENDED_BASE} in the sources"
    inherited = container_attributes(base)
    found = []
    for source, cls in _extended_classes(sources):
        init, param = _container_parameter(cls)
        held = inherited | (_self_attributes_bound_to(init, param) if init and param else set())
        functions = _functions(cls)
        # Methods that hand the container back (``return self.strategy``), until no more are
        # found: calling one reaches the container as surely as reading the attribute does.
        returners: set[str] = set()
        grew = True
        while grew:
            grew = False
            for function in functions:
                names = {param} if function is init and param else set()
                reads = _container_reads(function, held, names, returners)
                if function.name not in returners and any(isinstance(n, ast.Return) for n in reads):
                    returners.add(function.name)
                    grew = True
        for function in functions:
            names = {param} if function is init and param else set()
            found += [
                (source.path, node.lineno, f"{ast.unparse(node)} ({cls.name} reads its strategy)")
                for node in _container_reads(function, held, names, returners)
                if not isinstance(node, ast.Return)
            ]
    return [f"{path}:{line}: {text}" for path, line, text in sorted(set(found))]


def test_no_extended_object_calls_back_into_its_strategy():
    found = callback_violations(load_sources())
    assert not found, _report("a strategy's extended object reading its strategy", found)


CALLBACKS = {
    "distribute/extended": """
class StrategyExtended:
    def __init__(self, owner, devices):
        self._holder = owner

    @property
    def owner(self):
        return self._holder

    def describe(self):
        return self._holder.name  # the base itself: not checked
""",
    "distribute/good": """
from stratagem.distribute.extended import StrategyExtended

class Good(StrategyExtended):
    def __init__(self, container, n):
        super().__init__(container, [])
        self.name = type(container).__name__

    def capture(self, p, ctx):
        claim(p, self._holder)
        return type(self.owner).__name__, ctx.strategy is self.owner, self.strategy.x
""",
    "distribute/bad": """
from stratagem.distribute.good import Good
from stratagem.distribute import extended

class Bad(extended.StrategyExtended):
    def __init__(self, container, n):
        super().__init__(container, [])
        self._mine = container
        self._n = container.num_stages

    def a(self):
        return self.owner.pipeline(1)

    def b(self):
        return getattr(self._holder, "cluster_coordinator", None)

    def c(self):
        strategy = self.owner
        return strategy.num_microbatches

    def d(self):
        self._mine.rank = 2

    def _typed(self):
        strategy = self.owner
        assert isinstance(strategy, Good)
        return strategy

    def g(self):
        return self._typed().schedule

class Deeper(Good):
    def e(self):
        return [self._holder._comm]
""",
    "keras/elsewhere": """
from stratagem.distribute import StrategyExtended

class Outside(StrategyExtended):
    def f(self):
        return self._holder.rank  # not under distribute/: not this rule's
""",
}


def test_checker_reports_an_extended_object_reading_its_strategy():
    found = callback_violations(_sources(CALLBACKS))
    assert [line.split(": ", 1)[1] for line in found] == [
        "container.num_stages (Bad reads its strategy)",
        "self.owner.pipeline (Bad reads its strategy)",
        "getattr(self._holder, 'cluster_coordinator', None) (Bad reads its strategy)",
        "strategy.num_microbatches (Bad reads its strategy)",
        "self._mine.rank (Bad reads its strategy)",
        "self._typed().schedule (Bad reads its strategy)",
        "self._holder._comm (Deeper reads its strategy)",
    ], found
    assert all(line.startswith("src/stratagem/distribute/bad.py:") for line in found), found
