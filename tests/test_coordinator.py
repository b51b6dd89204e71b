"""TF2's ClusterCoordinator: functions sent by reference (``stratagem.shipping``, in one process
and a subprocess compiling its own copy), and one real job (1 chief, 2 workers, 1 ps, with a job
secret) that schedules, joins, fetches, uses a per-worker dataset, checks each error and loses a
worker mid-function."""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import math
import subprocess
import sys
import threading
import typing
import warnings
from pathlib import Path

import pytest
import torch

import stratagem as sg
from cluster_utils import WORKERS, Process, child_env, free_ports
from stratagem import shipping
from stratagem.cluster import SimpleClusterResolver
from stratagem.comm import plain_data
from stratagem.distribute.coordinator.cluster_coordinator import check_coordinator_cluster
from stratagem.distribute.coordinator.worker import check_same_program

HERE = Path(__file__).resolve().parent
WEIGHTS = torch.tensor([1.0, 2.0])
TABLE = {"name": "t", "sizes": (3, 4)}


def double(x):
    return 2 * x


def make_functions():
    """Nested functions: closures, defaults, recursion, modules, tensors and plain data."""
    offset = torch.tensor(0.5)

    def scaled(x, power=2, *, extra=TABLE["sizes"]):
        return (WEIGHTS * x).sum() ** power + offset + extra[1] + math.floor(2.7)

    def factorial(n):
        return 1 if n <= 1 else n * factorial(n - 1)

    def uses_others(x):
        return {"d": double(x), "f": factorial(4), "name": TABLE["name"], "s": scaled(x)}

    def members(x):
        return x in {"alpha", "beta", "gamma"}  # a frozenset constant: hashed in sorted order

    return scaled, factorial, uses_others, members


Pair = collections.namedtuple("Pair", "left right", defaults=[0])  # no class statement


class Scored(typing.NamedTuple):  # a class statement whose base makes the namedtuple
    name: str
    score: float = 1.0

    def doubled(self):
        return 2 * self.score


class Summed(Pair):  # a class statement on a namedtuple
    def total(self):
        return self.left + self.right


class Stack(list):
    pass


SUBCLASSED = (
    Pair(1, torch.tensor(2.0)),
    Scored("a"),
    Summed(3, 4),
    inspect.ArgInfo([1], None, None, {}),  # a library's namedtuple
    torch.Size([2, 3]),
    torch.max(torch.tensor([[1.0, 3.0]]), 1),  # torch.return_types.max
    Stack([1, 2]),
)


def uses_subclassed():
    return SUBCLASSED, Pair(5), Scored("b", 3.0).doubled(), Summed(1, 2).total()


def _round_trip(fn, special=None, resolve=None):
    describer = shipping.Describer(root=HERE, special=special)
    ref = describer.function(fn, what="test")
    # What the chief sends is plain data: encode and decode it as the wire does.
    frame = plain_data.encode({"table": describer.functions, "ref": ref}, what="test")
    sent = plain_data.decode(frame, sender="chief", what="test")
    rebuilder = shipping.Rebuilder(sent["table"], root=HERE, resolve_special=resolve)
    return rebuilder.value(sent["ref"]), sent


def test_a_function_is_rebuilt_from_this_tasks_own_file_with_its_captures():
    scaled, _, uses_others, members = make_functions()
    rebuilt, sent = _round_trip(uses_others)
    assert rebuilt is not uses_others and rebuilt.__code__ is not uses_others.__code__
    expected, got = uses_others(torch.tensor(1.0)), rebuilt(torch.tensor(1.0))
    assert got["d"] == expected["d"] and got["f"] == 24 and got["name"] == "t"
    torch.testing.assert_close(got["s"], expected["s"])
    rebuilt_scaled, _ = _round_trip(scaled)
    torch.testing.assert_close(rebuilt_scaled(torch.tensor(2.0), 1), scaled(torch.tensor(2.0), 1))
    rebuilt_members, _ = _round_trip(members)
    assert rebuilt_members("beta") and not rebuilt_members("delta")
    # The references: the file relative to the program root, qualname and line; captures kinds.
    desc = sent["table"][sent["ref"]["ref"]]
    assert desc["where"]["file"] == "test_coordinator.py"
    assert desc["qualname"] == "make_functions.<locals>.uses_others"
    assert desc["line"] == uses_others.__code__.co_firstlineno
    kinds = {name: entry["k"] for name, entry in desc["globals"].items()}
    assert kinds == {"double": "function", "TABLE": "dict"}
    assert [c["k"] for c in desc["closure"]] == ["function", "function"]


WATCHED_MODEL = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
WATCHED_OPTIMIZER = torch.optim.SGD(WATCHED_MODEL.parameters(), lr=0.5)
WATCHED_ITEMS = [1, 2]
WATCHED_OPTIONS = argparse.Namespace(depth=2)


def make_watched_step():
    calls = 0

    def step(x):
        nonlocal calls
        loss = WATCHED_MODEL(x).sum() * WATCHED_OPTIONS.depth + len(WATCHED_ITEMS) + calls
        WATCHED_OPTIMIZER.zero_grad()
        loss.backward()
        WATCHED_OPTIMIZER.step()
        return float(loss.detach())

    return step


def _rebuilt_and_watched():
    describer = shipping.Describer(root=HERE)
    ref = describer.function(make_watched_step(), what="test")
    frame = plain_data.encode({"table": describer.functions, "ref": ref}, what="test")
    sent = plain_data.decode(frame, sender="chief", what="test")
    rebuilder = shipping.Rebuilder(sent["table"], root=HERE)
    fn = rebuilder.value(sent["ref"])
    # Tensors travel as plain values here (no strategy): the worker's variables train.
    for p in fn.__globals__["WATCHED_MODEL"].parameters():
        p.requires_grad_(True)
    snapshot = shipping.watch(rebuilder.built, [fn])
    assert snapshot is not None and snapshot.unchanged()
    return fn, fn.__globals__, snapshot


# What a call (on a worker) or the chief's program (between two schedules) may change of a
# model the function captures.
MODEL_CHANGES = [
    lambda fn, g: g["WATCHED_MODEL"].eval(),
    lambda fn, g: g["WATCHED_MODEL"][0].register_forward_hook(lambda *_: None),
    lambda fn, g: setattr(g["WATCHED_MODEL"][0], "note", 1),
    lambda fn, g: setattr(g["WATCHED_MODEL"][0], "in_features", 3),
    lambda fn, g: setattr(g["WATCHED_MODEL"], "__class__", torch.nn.ModuleList),
    lambda fn, g: g["WATCHED_MODEL"].append(torch.nn.ReLU()),
]


@pytest.mark.parametrize(
    "change",
    [
        *MODEL_CHANGES,
        lambda fn, g: g["WATCHED_OPTIMIZER"].param_groups[0].__setitem__("lr", 0.1),
        lambda fn, g: g["WATCHED_OPTIMIZER"].state[g["WATCHED_MODEL"][0].weight].update(a=1),
        lambda fn, g: g["WATCHED_ITEMS"].append(3),
        lambda fn, g: g.__setitem__("WATCHED_ITEMS", [1, 2]),  # equal, yet another list
        lambda fn, g: setattr(g["WATCHED_OPTIONS"], "depth", 3),
        lambda fn, g: setattr(fn.__closure__[0], "cell_contents", 1),
        lambda fn, g: setattr(fn, "__defaults__", (1,)),
    ],
)
def test_a_snapshot_of_rebuilt_objects_sees_each_change_a_call_can_make(change):
    fn, glob, snapshot = _rebuilt_and_watched()
    fn(torch.ones(1, 2))  # a training step: values change in the tensors, no container does
    assert snapshot.unchanged()
    change(fn, glob)
    assert not snapshot.unchanged()


def _described_and_read(fn):
    """``fn`` described as the chief does (tensors as variables: their shape and whether they
    train), with a snapshot of what the describe read."""
    reads = shipping.Reads()
    describer = shipping.Describer(
        root=HERE,
        special=lambda t: {"variable": list(t.shape), "trainable": t.requires_grad},
        special_types=(torch.Tensor,),
        reads=reads,
    )
    describer.function(fn, what="test")
    snapshot = reads.snapshot()
    assert snapshot is not None and snapshot.unchanged()
    return describer.functions, snapshot


class ComputedState(shipping.Portable):
    """What travels of it is computed: what that reads, a describe cannot record."""

    def _sg_portable_state(self):
        return {"items": len(WATCHED_ITEMS)}


def uses_late():
    return WATCHED_LATE if "WATCHED_LATE" in globals() else None  # noqa: F821


@pytest.mark.parametrize(
    "change",
    [
        *MODEL_CHANGES,
        lambda fn, g: g["WATCHED_MODEL"][0].weight.requires_grad_(False),
        lambda fn, g: setattr(g["WATCHED_MODEL"][0].bias, "data", torch.zeros(3)),
        lambda fn, g: g["WATCHED_OPTIMIZER"].param_groups[0].__setitem__("lr", 0.1),
        lambda fn, g: g["WATCHED_ITEMS"].append(3),
        lambda fn, g: g.__setitem__("WATCHED_ITEMS", [1, 2]),  # equal, yet another list
        lambda fn, g: setattr(g["WATCHED_OPTIONS"], "depth", 3),
        lambda fn, g: setattr(fn.__closure__[0], "cell_contents", 1),
        lambda fn, g: setattr(fn, "__defaults__", (1,)),
        lambda fn, g: setattr(fn, "__code__", fn.__code__.replace(co_qualname="another")),
    ],
)
def test_the_reads_of_a_chiefs_describe_see_each_change_of_what_it_described(change):
    # The chief keeps a function's description while nothing its describe read has changed.
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    glob = globals()
    saved = {k: glob[k] for k in ("WATCHED_MODEL", "WATCHED_OPTIMIZER", "WATCHED_ITEMS")}
    glob.update(
        WATCHED_MODEL=model,
        WATCHED_OPTIMIZER=torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
        WATCHED_ITEMS=[1, 2],
    )
    try:
        step = make_watched_step()
        table, snapshot = _described_and_read(step)
        # A training step (values and optimizer state change in place) and a pull into the
        # parameters change no description, and the snapshot says so.
        step(torch.ones(1, 2))
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p))
        assert snapshot.unchanged()
        assert _described_and_read(step)[0] == table
        change(step, glob)
        assert not snapshot.unchanged()
    finally:
        glob.update(saved)
        WATCHED_OPTIONS.depth = 2


def test_the_reads_of_a_chiefs_describe_see_a_global_added_and_refuse_a_computed_state():
    table, snapshot = _described_and_read(uses_late)
    globals()["WATCHED_LATE"] = 1
    try:
        assert not snapshot.unchanged()
        assert _described_and_read(uses_late)[0] != table  # now it captures the global
    finally:
        del globals()["WATCHED_LATE"]
    assert snapshot.unchanged()
    reads = shipping.Reads()
    shipping.Describer(root=HERE, reads=reads).value(ComputedState(), owner="test", name="c")
    assert reads.snapshot() is None and "computes its own state" in (reads.untrusted or "")


def test_a_volatile_attribute_is_read_again_not_watched_and_the_rest_is_watched():
    # fit's step counter changes at every call: the chief puts its value in the kept table
    # (ClusterCoordinator) rather than describing again; every other attribute is watched.
    from stratagem.keras.optimizer_recipes import BoundOptimizer

    model = torch.nn.Linear(2, 2)
    bound = BoundOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    entry, reads, snapshot = _read(bound)
    assert [(key, obj, name) for key, obj, name in reads.volatile] == [
        (entry["ref"], bound, "_batches")
    ]
    bound.count_step()
    assert snapshot.unchanged()
    for change in (
        lambda: setattr(bound, "gradient_accumulation_steps", 2),
        lambda: setattr(bound, "note", 1),  # an attribute added
        lambda: bound.torch_optimizer.param_groups[0].__setitem__("lr", 0.1),
    ):
        change()
        assert not snapshot.unchanged()
        snapshot = _read(bound)[2]


def test_a_worker_keeps_a_portable_whose_call_changed_only_what_a_rebuild_sets_anew():
    # A metric's totals (local state) and a Keras optimizer's step counter (volatile) change
    # at every call; a kept call restarts them (``Rebuilder.restarted``). The rest is watched.
    from stratagem.keras.optimizer_recipes import BoundOptimizer

    model = torch.nn.Linear(2, 2)
    objects = [BoundOptimizer(torch.optim.SGD(model.parameters(), lr=0.5)), sg.keras.metrics.Sum()]
    describer = shipping.Describer(root=HERE)
    entry = describer.value(objects, owner="test", name="objects")
    table = plain_data.decode(
        plain_data.encode(describer.functions, what="test"), sender="chief", what="test"
    )
    rebuilder = shipping.Rebuilder(table, root=HERE)
    bound, total = rebuilder.value(entry)
    snapshot = shipping.watch(rebuilder.built, [])
    assert snapshot is not None and snapshot.unchanged()
    bound.count_step()
    total.update_state(torch.tensor(3.0))
    assert snapshot.unchanged()
    # The chief's next table: its counter moved on by 5 (fit's), nothing else.
    key = entry["items"][0]["ref"]
    state = {**table[key]["state"], "_batches": {"k": "value", "v": 5}}
    changes = {key: {**table[key], "state": state}}
    assert rebuilder.restarted({**table, **changes}, changes)
    assert bound.iterations == 5 and float(total.result()) == 0.0  # as a rebuild makes them
    assert snapshot.unchanged()
    # Anything else changed is built again: another attribute, another object's entry.
    lr = {**state, "gradient_accumulation_steps": {"k": "value", "v": 2}}
    assert not rebuilder.restarted(table, {key: {**table[key], "state": lr}})
    other = entry["items"][1]["ref"]
    assert not rebuilder.restarted(table, {other: {**table[other], "kind": "module"}})
    assert bound.iterations == 5  # (nothing done)
    for change in (
        lambda: setattr(total, "name", "renamed"),
        lambda: setattr(bound, "note", 1),  # an attribute added
    ):
        change()
        assert not snapshot.unchanged()
        snapshot = shipping.watch(rebuilder.built, [])

    class OwnState(shipping.Portable):
        def _sg_from_state(self, state):
            self.__dict__.update(state, seen=True)

    assert shipping.watch([OwnState()], []) is None  # only a rebuild makes it as described


def warns_of_its_target(x):
    # A warning shown for this function's own line (as torch's loss functions warn of a
    # target's size, stacklevel 2): its registry goes into this function's globals.
    warnings.warn(f"a target of size {tuple(x.shape)}", UserWarning, stacklevel=1)
    return x + 1


def test_a_worker_keeps_a_function_that_warned_and_warns_once():
    # Python records a warning it showed in the warning frame's globals
    # (``__warningregistry__``): for a rebuilt function, the globals the worker made. That is
    # the interpreter's bookkeeping, not the program's: the kept call stays kept, and (its
    # registry kept with it) shows the warning once, as the same function called in one
    # process would.
    describer = shipping.Describer(root=HERE)
    ref = describer.function(warns_of_its_target, what="test")
    rebuilder = shipping.Rebuilder(
        plain_data.decode(plain_data.encode(describer.functions, what="t"), sender="c", what="t"),
        root=HERE,
    )
    fn = rebuilder.value(ref)
    snapshot = shipping.watch(rebuilder.built, [fn])
    assert snapshot is not None
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")
        for _ in range(3):
            assert float(fn(torch.zeros(2))[0]) == 1.0
            assert snapshot.unchanged()
    assert [str(w.message) for w in shown] == ["a target of size (2,)"]
    fn.__globals__["added"] = 1  # the program's own globals are still watched
    assert not snapshot.unchanged()


def _read(obj):
    """``obj`` described (tensors by shape), what the describe read, and its snapshot."""
    reads = shipping.Reads()
    entry = shipping.Describer(
        root=HERE, special=lambda t: {"shape": list(t.shape)}, special_types=(torch.Tensor,),
        reads=reads,
    ).value(obj, owner="test", name="obj")  # fmt: skip
    snapshot = reads.snapshot()
    assert snapshot is not None and snapshot.unchanged()
    return entry, reads, snapshot


def test_a_function_sent_again_resolves_no_path_again(monkeypatch):
    # Every schedule describes its function again and the worker rebuilds it: resolving its
    # file's path (a stat per component) each time was a fifth of the chief's time per
    # schedule. The second round trip resolves nothing; the file's hash is still checked.
    *_, uses_others, _ = make_functions()
    _round_trip(uses_others)
    resolves = []
    real_resolve = Path.resolve
    monkeypatch.setattr(Path, "resolve", lambda p, *a: resolves.append(p) or real_resolve(p, *a))
    hashed = []
    real_hash = shipping.program.file_hash
    monkeypatch.setattr(shipping.program, "file_hash", lambda p: hashed.append(p) or real_hash(p))
    rebuilt, _ = _round_trip(uses_others)
    assert rebuilt(torch.tensor(1.0))["f"] == 24
    assert resolves == [], resolves
    assert hashed, "the worker no longer checks its copy of the file"


def test_the_code_hash_is_the_same_in_another_process_with_other_string_hashing():
    *_, members = make_functions()
    line = members.__code__.co_firstlineno
    # The subprocess runs shipping's code hashing alone (no torch to import: a fast "worker").
    program = (
        "from __future__ import annotations\nimport hashlib, types\nfrom pathlib import Path\n"
    )
    program += inspect.getsource(shipping.program.hash_into)
    program += inspect.getsource(shipping.program.compute_code_hash)
    program += (
        f"top = compile(Path({str(HERE / 'test_coordinator.py')!r}).read_bytes(), 'x', 'exec')\n"
        "def walk(c):\n"
        "    yield c\n"
        "    for k in c.co_consts:\n"
        "        if hasattr(k, 'co_code'): yield from walk(k)\n"
        f"print(next(compute_code_hash(c) for c in walk(top) if c.co_firstlineno == {line}))\n"
    )
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", program],
            env={**child_env(), "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert out.stdout.strip() == shipping.code_hash(members.__code__), out.stderr


def test_a_worker_refuses_a_changed_file_changed_code_and_a_module_it_may_not_import():
    _, factorial, *_ = make_functions()
    describer = shipping.Describer(root=HERE)
    ref = describer.function(factorial, what="test")
    desc = describer.functions[ref["ref"]]
    changed_file = {ref["ref"]: {**desc, "where": {**desc["where"], "sha": "0" * 64}}}
    with pytest.raises(ImportError, match="differs from the chief's"):
        shipping.Rebuilder(changed_file, root=HERE).function(ref["ref"])
    changed_code = {ref["ref"]: {**desc, "hash": "0" * 64}}
    with pytest.raises(ImportError, match="its code differs from the chief's"):
        shipping.Rebuilder(changed_code, root=HERE).function(ref["ref"])
    outside = {ref["ref"]: {**desc, "where": {"file": "../x.py", "sha": "0"}}}
    with pytest.raises(ValueError, match="outside the program"):
        shipping.Rebuilder(outside, root=HERE).function(ref["ref"])
    assert "tabnanny" not in sys.modules
    with pytest.raises(ImportError, match="'tabnanny', which this worker has not imported"):
        shipping.Rebuilder({}, root=HERE).value({"k": "module", "name": "tabnanny"})
    assert "tabnanny" not in sys.modules


def test_a_file_edited_between_calls_is_described_and_checked_anew(tmp_path: Path) -> None:
    """The chief keeps where a function's code is, and a worker the code it found, per file
    while the file stays as it was: an edit between two calls sends the new hash, and a
    worker whose copy changed refuses the old one (it found that code before)."""
    import importlib.util

    program = tmp_path / "edited_program.py"
    program.write_text("def f(x):\n    return x + 1\n")
    spec = importlib.util.spec_from_file_location("edited_program", program)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def describe() -> tuple[dict, dict]:
        describer = shipping.Describer(root=tmp_path)
        ref = describer.function(module.f, what="f")
        return ref, describer.functions

    ref, first = describe()
    assert shipping.Rebuilder(first, root=tmp_path).function(ref["ref"])(1) == 2
    assert describe()[1] == first  # unchanged: the same description

    program.write_text("def f(x):\n    return x + 1\n# edited\n")
    _, second = describe()
    assert second[ref["ref"]]["where"]["sha"] != first[ref["ref"]]["where"]["sha"]
    with pytest.raises(ImportError, match="differs from the chief's"):
        shipping.Rebuilder(first, root=tmp_path).function(ref["ref"])
    assert shipping.Rebuilder(second, root=tmp_path).function(ref["ref"])(2) == 3


def test_a_worker_calls_only_the_programs_functions_and_stratagems_scheduled_steps():
    """What a worker is told to call gets arguments from the wire: a table naming a library
    function (builtins.exec, or subprocess's code rebuilt with the table's globals) is refused
    before anything is made; the program's functions and Keras's scheduled steps are called."""
    import subprocess as subprocess_module

    from stratagem.keras import coordinated

    _, factorial, *_ = make_functions()
    describer = shipping.Describer(root=HERE)
    program_fn = describer.function(factorial, what="test")
    steps = describer.function(coordinated.train_steps, what="fit")
    library_code = describer.function(  # a library function rebuilt from its module's code
        lambda: None, what="x"
    )
    table = dict(describer.functions)
    getoutput = {
        **table[library_code["ref"]],
        "module": "subprocess",
        "qualname": "getoutput",
        "where": {
            "import": "subprocess",
            "sha": shipping.file_hash(Path(subprocess_module.__file__)),
        },
    }
    table["forged"] = getoutput
    rebuilder = shipping.Rebuilder(table, root=HERE)
    assert rebuilder.entry_point(program_fn, "the scheduled function")(5) == 120
    assert rebuilder.entry_point(steps, "the scheduled function") is coordinated.train_steps
    for forged, named in (
        ({"k": "named", "module": "builtins", "qualname": "exec"}, "builtins.exec"),
        ({"k": "named", "module": "os", "qualname": "system"}, "os.system"),
        ({"k": "function", "ref": "forged"}, "subprocess.getoutput"),
        ({"k": "value", "v": "print"}, "'v': 'print'"),
    ):
        with pytest.raises(ValueError, match="must be a function of the program") as refused:
            rebuilder.entry_point(forged, "the scheduled function")
        assert named in str(refused.value)


def test_what_cannot_be_sent_is_named_with_its_type():
    lock = threading.Lock()

    def locked():
        return lock.locked()

    with pytest.raises(TypeError, match=r"locked is a function that cannot be sent: it captures "):
        shipping.Describer(root=HERE).function(locked, what="locked")
    namespace: dict = {}
    exec("def typed_in():\n    return 1\n", namespace)  # no file: nothing a worker could compile
    with pytest.raises(TypeError, match="typed_in is a function that cannot be sent: its code"):
        shipping.Describer(root=HERE).function(namespace["typed_in"], what="typed_in")
    # A special object (the coordinator's iterators) is the caller's to name and resolve.
    marker = object()

    def reads_marker():
        return marker

    rebuilt, _ = _round_trip(
        reads_marker,
        special=lambda v: {"it": 7} if v is marker else None,
        resolve=lambda entry: f"iterator {entry['it']}",
    )
    assert rebuilt() == "iterator 7"


def test_namedtuples_and_other_list_and_tuple_subclasses_travel_as_their_classes():
    rebuilt, _ = _round_trip(uses_subclassed)
    got, expected = rebuilt(), uses_subclassed()
    assert got[1:] == (Pair(5, 0), 6.0, 3)  # made there: the default, the methods
    for copy, original in zip(got[0], expected[0], strict=True):
        assert type(copy).__qualname__ == type(original).__qualname__
        assert len(copy) == len(original)
        for a, b in zip(copy, original, strict=True):
            assert (a == b).all() if isinstance(b, torch.Tensor) else a == b
    pair, scored, summed, args, size, best, stack = got[0]
    # The program's classes are made on the worker (from its fields, or its class body);
    # a library's travel by name and are the same class.
    assert type(pair) is not Pair and pair._fields == ("left", "right") and pair.right == 2.0
    assert type(scored) is not Scored and scored.doubled() == 2.0
    assert scored._fields == Scored._fields
    assert type(summed) is not Summed and summed.total() == 7 and isinstance(summed, type(got[1]))
    assert type(args) is inspect.ArgInfo and type(size) is torch.Size
    assert type(best) is type(expected[0][5]) and best.indices.item() == 1
    assert type(stack).__qualname__ == "Stack" and isinstance(stack, list)
    # Only the items travel: a subclass's object with attributes of its own is refused.
    labelled = Stack([1])
    labelled.label = "x"

    def uses_labelled():
        return labelled

    with pytest.raises(TypeError, match=r"'labelled', a .*Stack with attributes besides its items"):
        _round_trip(uses_labelled)

    class Slotted(list):  # (a tuple subclass cannot have slots)
        __slots__ = ("note",)

    slotted = Slotted((1, 2))

    def uses_slotted():
        return slotted

    with pytest.raises(TypeError, match=r"Slotted with attributes besides its items \(\['note'\]"):
        _round_trip(uses_slotted)
    # A worker makes only list and tuple subclasses, with as many items as fields.
    popen = {"k": "named", "module": "subprocess", "qualname": "Popen"}
    with pytest.raises(ValueError, match="names a list or tuple subclass; got <class 'subprocess"):
        shipping.Rebuilder({}, root=HERE).value({"k": "sequence", "class": popen, "items": []})
    argument = {"k": "named", "module": "inspect", "qualname": "ArgInfo"}
    one = [{"k": "value", "v": 1}]
    with pytest.raises(ValueError, match=r"fields \['args', 'varargs', 'keywords', 'locals'\]"):
        shipping.Rebuilder({}, root=HERE).value({"k": "sequence", "class": argument, "items": one})


def test_server_and_coordinator_refuse_a_cluster_without_a_chief():
    ports = free_ports(2)
    cluster = {"worker": [f"localhost:{ports[0]}"], "ps": [f"localhost:{ports[1]}"]}
    with pytest.raises(ValueError, match="this cluster has no chief"):
        sg.distribute.Server(cluster, job_name="worker", task_index=0, protocol="grpc")
    resolver = SimpleClusterResolver(cluster, task_type="worker", task_id=0)
    with pytest.raises(ValueError, match=r"needs a cluster with a chief .*\['ps', 'worker'\]"):
        check_coordinator_cluster(resolver)
    with_chief = {**cluster, "chief": ["localhost:1"]}
    with pytest.raises(ValueError, match="runs on a ps task, or on a worker task of a cluster"):
        sg.distribute.Server(with_chief, job_name="chief", task_index=0)
    worker = SimpleClusterResolver(with_chief, task_type="worker", task_id=0)
    with pytest.raises(ValueError, match="runs on the chief; this process is worker 0"):
        check_coordinator_cluster(worker)
    with pytest.raises(TypeError, match="takes a ParameterServerStrategy; got OneDeviceStrategy"):
        sg.distribute.coordinator.ClusterCoordinator(sg.distribute.OneDeviceStrategy("cpu"))
    with pytest.raises(RuntimeError, match="is for a function scheduled by a ClusterCoordinator"):
        sg.distribute.coordinator.experimental_get_current_worker_index()
    assert sg.distribute.experimental.coordinator.ClusterCoordinator is (
        sg.distribute.coordinator.ClusterCoordinator
    )
    assert sg.distribute.experimental.ParameterServerStrategy is (
        sg.distribute.ParameterServerStrategy
    )


@pytest.mark.multiprocess
def test_a_coordinator_job_schedules_joins_fetches_and_names_every_error(tmp_path):
    argv = [sys.executable, "-m", "stratagem.cli", "run", "--chief", "-n", "2", "--ps", "1"]
    argv += ["--tolerate-worker-loss", str(WORKERS / "coordinator_job.py"), str(tmp_path), "kill"]
    env = child_env({"STRATAGEM_JOB_SECRET": "job-secret-of-the-test-0123456789abcdef"})
    result = Process(argv, env, tmp_path, "launcher", merge_output=True).wait(timeout=300)
    output = result.stdout
    assert result.returncode == 0, output
    assert "[chief] coordinator job done" in output, output
    assert "ps 0 exited 0" in output and "worker 0 exited 0" in output, output
    r = json.loads((tmp_path / "result.json").read_text())
    # Captured tensor SCALE, dict CONFIG, function helper, module math, a default.
    assert r["sums"] == [10.0, 16.0, 22.0, 28.0]
    assert r["helper"] == 6 and r["pair"] == [1, 2] and r["pair_is_tuple"] and r["sqrt"] == 4.0
    assert r["closure"] == [3.5, 3.5]  # a closure cell (a tensor) and a keyword argument
    assert r["strategy"] == 3  # the worker's own strategy: 1 replica, and strategy.run
    assert r["worker_indices"] == [0, 1]
    # Each worker read its own iterator of its own dataset, in order, nothing twice.
    per_worker: dict[int, list[float]] = {}
    for worker, value in r["reads"]:
        per_worker.setdefault(worker, []).append(value)
    assert sum(len(v) for v in per_worker.values()) == 8
    for worker, values in per_worker.items():
        assert values == [1000.0 * worker + i for i in range(len(values))], per_worker
    assert "on worker" in r["fetch_error"] and "in boom" in r["fetch_error"]
    assert "boom 7" in r["join_error"] and "was cancelled" in r["cancelled"]
    assert "boom 7" in r["held_cancelled"]  # running when boom failed: cancelled too
    # Scheduled while another failed: cancelled at once, not queued behind the pending error.
    assert r["raced_settled_at_once"] and "was cancelled" in r["raced"], r["raced"]
    assert "cannot be sent" in r["unsendable"] and "Input has an error" in r["remote_arg"]
    assert "the function's return value" in r["not_plain"]
    assert "only the chief" in r["from_worker"]
    assert "failed on worker 1" in r["dataset_error"]
    # Worker 1 died (-9) inside a function: it ran again on worker 0; each completed once.
    assert r["killed"] and r["after_kill"] == [0, 1, 2, 3, 4, 5]
    # Values set: 4 + 1 + 1 + 2 + 8, 6 after the kill; failed or cancelled ones (`hold`) not.
    assert r["completed"] == 22
    assert "worker 1 was lost: killed by signal 9" in output, output


def test_a_library_function_travels_by_name_and_a_program_function_by_file():
    describer = shipping.Describer(root=HERE)
    # torch's own Python function: the worker's torch holds it (its globals are torch's).
    assert describer.function(torch.nn.functional.relu, what="relu") == {
        "k": "named",
        "module": "torch.nn.functional",
        "qualname": "relu",
    }
    rebuilt, sent = _round_trip(double)  # this file is the program's own: compiled, captured
    assert sent["table"]["0"]["where"]["file"] == "test_coordinator.py" and rebuilt(4) == 8
    assert rebuilt is not double


def test_a_worker_refuses_a_chief_running_another_program_or_another_copy(monkeypatch, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('train')\n")
    monkeypatch.setattr(sys.modules["__main__"], "__file__", str(script))
    sha = shipping.file_hash(script)
    check_same_program("train.py", sha, me="worker 0", root=tmp_path)  # the same: accepted
    other = r"the chief runs 'other\.py' and worker 0 runs 'train\.py'"
    with pytest.raises(ValueError, match=other):
        check_same_program("other.py", sha, me="worker 0", root=tmp_path)
    with pytest.raises(ValueError, match=r"worker 0's copy of train\.py differs from the chief's"):
        check_same_program("train.py", "0" * 64, me="worker 0", root=tmp_path)


def test_the_coordinator_is_asked_about_each_kind_it_describes_and_nothing_else():
    """The describer asks the coordinator only about its kinds (one check in C): each of them
    still reaches it, and a module, a list or a function does not."""
    from torch.utils.weak import WeakIdKeyDictionary

    from stratagem.distribute.coordinator.cluster_coordinator import ClusterCoordinator
    from stratagem.distribute.coordinator.remote_values import PerWorkerDataset, PerWorkerIterator

    class Seam:
        def shards_of(self, tensor):
            return None

    coordinator = object.__new__(ClusterCoordinator)  # its specials alone: no cluster
    coordinator.strategy = object()
    coordinator._seam = Seam()
    coordinator._buffer_keys = WeakIdKeyDictionary()
    asked = []
    original = coordinator._special
    coordinator._special = lambda value, describer: (
        asked.append(value) or original(value, describer)
    )
    describer = coordinator._describer()
    kinds = {
        "dataset": sg.data.Dataset.range(3),
        "iterator": PerWorkerIterator(1),
        "per-worker dataset": PerWorkerDataset(coordinator, 2),
        "strategy": coordinator.strategy,
        "coordinator": coordinator,
    }
    for name, value in kinds.items():
        assert describer.value(value, owner="test", name=name)["k"] == "special", name
    tensor = torch.ones(2)
    assert describer.value(tensor, owner="test", name="t") == {"k": "value", "v": tensor}
    assert all(v is w for v, w in zip(asked, [*kinds.values(), tensor], strict=True))
    asked.clear()
    for value in (torch.nn.ReLU(), [1, (2, "x")], {"a": 1}, double, torch):
        describer.value(value, owner="test", name="other")
    assert asked == []


def test_a_worker_applies_changes_only_to_the_table_it_keeps():
    """A run may bring the entries that changed since the table the worker keeps (a loop's
    counter): the worker's table is its kept one with those in place; changes to a table it
    does not keep, or that are not a table's entries, are refused."""
    from stratagem.shipping import KeptTable

    worker = KeptTable("worker 0")
    first = {"f0": {"k": "function"}, "o1": {"step": 1}}
    assert worker.receive(first, 7).table == first
    changed = worker.receive({"o1": {"step": 2}}, 8, 7).table
    assert changed == {"f0": {"k": "function"}, "o1": {"step": 2}}
    assert worker.receive(None, 8).table is changed  # kept as table 8
    for table, changes_to in (({"o1": {}}, 7), ({"o1": {}}, "8"), ([1], 8)):
        with pytest.raises(ValueError, match=r"sent changes to table .* it keeps table 8"):
            worker.receive(table, 9, changes_to)
    assert worker.receive(None, 8).table is changed
