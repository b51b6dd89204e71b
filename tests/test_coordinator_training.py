"""TF2 coordinated training: objects sent by state (in one process), and real jobs: one worker
trains exactly as a single process, a worker killed or stopped mid-step loses nothing, and a
lost ps resumes from the chief's checkpoint (TF's tutorial has a file of its own:
``test_tutorial_parameter_server_training.py``)."""

from __future__ import annotations

import copy
import json
import pickle
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import stratagem as sg
from cluster_utils import WORKERS, Process, child_env
from stratagem import shipping
from stratagem.comm import plain_data
from stratagem.distribute.ps import chief_reads

HERE = Path(__file__).resolve().parent


class Block(torch.nn.Module):
    """A class of the program (this file): rebuilt from its class body, super() and all."""

    scale = 2.0

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)
        self.norm = torch.nn.BatchNorm1d(2)
        self.note = {"kind": "block", "sizes": {3, 2}}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x)) * Block.scale  # its own name: the worker's class


def _send(value, special=None, resolve=None, classes=None):
    describer = shipping.Describer(root=HERE, special=special)
    entry = describer.value(value, owner="test", name="value")
    frame = plain_data.encode({"table": describer.functions, "entry": entry}, what="test")
    sent = plain_data.decode(frame, sender="chief", what="test")
    rebuilder = shipping.Rebuilder(
        sent["table"], root=HERE, resolve_special=resolve, classes=classes
    )
    return rebuilder.value(sent["entry"]), describer, rebuilder


def test_a_model_optimizer_loss_and_metric_travel_by_state_and_a_metric_totals_back():
    torch.manual_seed(0)
    block = Block()
    optimizer = torch.optim.SGD(block.parameters(), lr=0.3, momentum=0.5)
    loss = sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    metric = sg.keras.metrics.SparseCategoricalAccuracy()
    metric.update_state(torch.tensor([1]), torch.tensor([[0.0, 1.0]]))  # the chief's: 1 of 1
    # Parameters go as specials (the ps variables), each the same object on the worker.
    params = {id(p): i for i, p in enumerate(block.parameters())}
    copies: dict[int, torch.nn.Parameter] = {}

    def special(v):
        return {"param": params[id(v)]} if id(v) in params else None

    def resolve(e):
        original = list(block.parameters())[e["param"]]
        return copies.setdefault(e["param"], torch.nn.Parameter(original.detach().clone()))

    classes: dict = {}
    (b2, opt2, loss2, metric2), describer, rebuilder = _send(
        [block, optimizer, loss, metric], special, resolve, classes
    )
    assert type(b2) is not Block and type(b2).__qualname__ == "Block"  # the worker's own class
    assert b2.note == {"kind": "block", "sizes": {3, 2}} and b2.norm.eps == block.norm.eps
    assert all(p2 is copies[i] for i, p2 in enumerate(b2.parameters()))
    assert opt2.param_groups[0]["params"] == list(b2.parameters())
    assert opt2.param_groups[0]["lr"] == 0.3 and not opt2.state  # the state is the ps's
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    torch.testing.assert_close(b2(x), block(x))
    torch.testing.assert_close(loss2(y, b2(x)), loss(y, block(x)))
    # The metric starts empty on the worker; its totals come back and add to the chief's.
    assert float(metric2.result()) == 0.0
    metric2.update_state(y, torch.eye(2)[[0, 0, 1, 1]])  # 2 of 4 right
    shipping.add_totals(describer.accumulators, shipping.totals_of(rebuilder.accumulators))
    assert metric.state_dict()["count"] == 5 and float(metric.result()) == pytest.approx(3 / 5)
    # A second call makes the same class (one class per worker, so isinstance holds).
    (b3, *_), _, _ = _send([block, optimizer, loss, metric], special, resolve, classes)
    assert type(b3) is type(b2)
    with pytest.raises(ValueError, match="sent totals for 'o9'"):
        shipping.add_totals(describer.accumulators, {"o9": torch.zeros(2)})


def test_what_may_not_be_made_on_a_worker_is_refused():
    # A table naming an arbitrary class as a "module" is refused before anything is made.
    table = {
        "o0": {
            "kind": "module",
            "class": {"k": "named", "module": "pathlib", "qualname": "Path"},
            "state": {},
        }
    }
    with pytest.raises(ValueError, match="not made here"):
        shipping.Rebuilder(table, root=HERE).value({"k": "object", "ref": "o0"})

    def local_class():
        class Inner(torch.nn.Module):
            def forward(self, x):
                return x + offset

        offset = 1
        return Inner()

    with pytest.raises(
        TypeError, match=r"defined inside a function and reads its locals \['offset'\]"
    ):
        shipping.Describer(root=HERE).value(local_class(), owner="f", name="m")


class Plain:
    """A plain class of the program: it opts in (``Portable``) or does not travel."""

    def __init__(self) -> None:
        self.size = 3


def test_a_librarys_plain_object_travels_by_its_attributes():
    # textwrap.TextWrapper stands for a Hugging Face config: a library's class (it cannot derive
    # from Portable) whose objects are their __dict__ of plain data.
    wrapper = textwrap.TextWrapper(width=12, placeholder=" ~", max_lines=2)
    holder = torch.nn.Module()
    holder.wrapper = holder.same = wrapper
    sent, describer, _ = _send(holder)
    data = [d for d in describer.functions.values() if d.get("kind") == "data"]
    assert len(data) == 1 and data[0]["class"] == {
        "k": "named",
        "module": "textwrap",
        "qualname": "TextWrapper",
    }
    assert type(sent.wrapper) is textwrap.TextWrapper and sent.wrapper is not wrapper
    assert sent.same is sent.wrapper  # one object there as here
    assert vars(sent.wrapper) == vars(wrapper)
    text = "one two three four five six"
    assert sent.wrapper.wrap(text) == wrapper.wrap(text) == ["one two", "three four ~"]


def test_a_plain_object_holding_what_cannot_travel_is_a_named_error():
    event = threading.Event()

    def waits() -> bool:
        return event.is_set()

    # Its attributes travel, recursively: the lock deep inside is named by its path and type.
    with pytest.raises(
        TypeError,
        match=r"waits is a function that cannot be sent: it captures 'event\._cond\._lock', a "
        r"_thread\.lock\. .*_thread\.lock is not a class of Python source",
    ):
        shipping.Describer(root=HERE).function(waits, what="waits")
    hooked = textwrap.TextWrapper()
    hooked.on_wrap = hooked.fill  # a bound method: no data
    with pytest.raises(TypeError, match=r"captures 'w\.on_wrap', a builtins\.method\."):
        shipping.Describer(root=HERE).value(hooked, owner="f", name="w")
    patched = textwrap.TextWrapper()
    patched.wrap = str.split  # an attribute named as a method would replace it there
    with pytest.raises(
        TypeError,
        match=r"captures 'w', a textwrap\.TextWrapper whose attributes travel, but not this "
        r"one: 'wrap' would hide TextWrapper\.wrap \(a function\)",
    ):
        shipping.Describer(root=HERE).value(patched, owner="f", name="w")
    # The program's and stratagem's classes opt in (Portable) or stay here.
    for obj, why in (
        (Plain(), "its class is the program's own"),
        (
            sg.distribute.InputContext(),
            "it is one of stratagem's own classes, and of those only Keras",
        ),
    ):
        with pytest.raises(TypeError, match=f"does not travel by its attributes: {why}"):
            shipping.Describer(root=HERE).value(obj, owner="f", name="x")


def test_a_worker_checks_an_object_described_by_its_attributes_itself():
    def make(module: str, qualname: str, state: dict) -> object:
        cls = {"k": "named", "module": module, "qualname": qualname}
        table = {"o0": {"kind": "data", "class": cls, "state": state}}
        return shipping.Rebuilder(table, root=HERE).value({"k": "object", "ref": "o0"})

    # A class of a module this worker has not imported: refused, and still not imported.
    assert "tabnanny" not in sys.modules
    with pytest.raises(ImportError, match="'tabnanny', which this worker has not imported"):
        make("tabnanny", "NannyNag", {})
    assert "tabnanny" not in sys.modules
    # A class outside the rule, whatever the chief says: nothing is made.
    with pytest.raises(ValueError, match=r"described <class 'pathlib\.Path'> by its attributes"):
        make("pathlib", "Path", {})
    with pytest.raises(ValueError, match="by its attributes: not made here, it defines __del__"):
        make("subprocess", "Popen", {})
    table = {"o0": {"kind": "data", "class": {"k": "value", "v": [1]}, "state": {}}}
    with pytest.raises(ValueError, match=r"described \[1\] by its attributes: .* not a class"):
        shipping.Rebuilder(table, root=HERE).value({"k": "object", "ref": "o0"})
    # An attribute that would replace a method, or a dunder.
    value = {"k": "value", "v": 1}
    with pytest.raises(ValueError, match=r"'wrap' would hide TextWrapper\.wrap"):
        make("textwrap", "TextWrapper", {"wrap": value})
    with pytest.raises(ValueError, match="'__class__' is a dunder name"):
        make("textwrap", "TextWrapper", {"__class__": value})
    assert make("textwrap", "TextWrapper", {"width": value}).width == 1


def test_the_chiefs_read_hook_refreshes_stays_on_the_chief_and_survives_copies():
    calls = []
    linear = torch.nn.Linear(3, 2)
    chief_reads.watch(linear, lambda: calls.append("refresh"))
    chief_reads.watch(linear, lambda: calls.append("twice"))  # once per module
    linear(torch.ones(1, 3))
    linear.state_dict()
    assert calls == ["refresh", "refresh"]
    # Described for a worker, the module travels without it (the worker pulls on its own).
    sent, _, _ = _send(linear)
    assert not sent._forward_pre_hooks and not sent._state_dict_pre_hooks
    # A deep copy shares it; a pickled module (torch.save of a whole module) has an inert one.
    copy.deepcopy(linear)(torch.ones(1, 3))
    assert calls == ["refresh"] * 3
    pickle.loads(pickle.dumps(linear))(torch.ones(1, 3))
    assert calls == ["refresh"] * 3


@pytest.fixture(scope="module")
def same(tmp_path_factory):
    """The one-worker job (``MODE same``), shared by the tests that read its result."""
    return _job(tmp_path_factory.mktemp("same"), "same", workers=1)


@pytest.mark.multiprocess
def test_one_worker_in_order_trains_exactly_as_one_process(same):
    result = same
    for name, (got, want) in result["weights"].items():
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
    # BatchNorm statistics: the worker's own, kept from call to call.
    for name, (got, want) in result["buffers"].items():
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
    for got, want in result["losses"]:
        assert got == pytest.approx(want, rel=1e-5)
    assert result["accuracy"][0] == pytest.approx(result["accuracy"][1], rel=1e-6)
    assert result["mean_loss"][0] == pytest.approx(result["mean_loss"][1], rel=1e-5)
    # Model.fit through the coordinator (steps_per_execution 3) == a local fit.
    for got, want in result["fit_weights"]:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    coordinated, local = result["fit_history"]
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(coordinated[key], local[key], rtol=1e-5)
    assert result["fit_iterations"] == 12
    np.testing.assert_allclose(*result["evaluate"], rtol=1e-5)
    # TF's parameter-server tutorial's model: Dense(10), loss="mse", labels of shape (N,).
    np.testing.assert_allclose(*result["tutorial_mse"], rtol=1e-5)
    # The chief's reads are the ps's values (TF's chief reads its variables there): a forward
    # and a state_dict right after functions ended, the parameters after join() and fetch().
    for how, (chief, reference) in result["reads"].items():
        assert len(chief) == len(reference), how
        for got, want in zip(chief, reference):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=how)
    # A metric's totals are merged before its function's value can be fetched.
    assert result["sum_after_fetch"] == 2.0
    assert result["ready_at_merge"] == [0, 1]


@pytest.mark.multiprocess
def test_the_chiefs_batchnorm_predicts_with_the_statistics_the_workers_trained_on_the_ps(same):
    """TF's coordinator keeps a layer's non-trainable variables on the ps: BatchNorm's moving
    statistics, which the workers' train steps update there and the chief's model reads
    (``parameter_server_strategy_v2.py`` places every variable made in its scope on a ps).
    One worker in order: the ps's statistics are those of one process's fit."""
    got = same["batchnorm"]
    for name, (on_ps, local) in got["on_ps"].items():
        np.testing.assert_allclose(on_ps, local, rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(got["chief"][name], on_ps, rtol=1e-5, atol=1e-6)
    assert got["on_ps"]["1.num_batches_tracked"][0] == 6  # every train step's batch
    chief, local, stale = (np.array(p) for p in got["predict"])
    np.testing.assert_allclose(chief, local, rtol=1e-4, atol=1e-5)
    # With the statistics left as built (zeros and ones) the outputs are far from these.
    assert np.abs(stale - local).max() > 0.1, np.abs(stale - local).max()
    np.testing.assert_allclose(*got["evaluate"], rtol=1e-5)


@pytest.mark.multiprocess
def test_a_worker_killed_and_one_stopped_mid_step_lose_no_function_and_training_completes(
    tmp_path,
):
    # A stopped worker sends no note: the chief gives up on it after the operation timeout.
    env = {"STRATAGEM_OP_TIMEOUT": "3"}
    result = _job(tmp_path, "faults", workers=3, tolerate=True, env=env)
    assert result["faulted"] == [5, 5]
    # 90 steps, each completed once; workers 1 and 2 ran 4 each before the fault in their 5th,
    # which ran again on another worker.
    assert result["completed"] == 90 and len(result["ran_on"]) == 90
    assert result["ran_on"].count(1) == 4 and result["ran_on"].count(2) == 4
    assert result["test_count"] == 360 and result["test_accuracy"] >= 0.9


@pytest.mark.multiprocess
def test_a_lost_ps_stops_the_job_and_the_restarted_job_resumes_from_the_chiefs_checkpoint(
    tmp_path,
):
    argv = [sys.executable, "-m", "stratagem.cli", "run", "--chief", "-n", "1", "--ps", "1"]
    argv += ["--max-restarts", "1", str(WORKERS / "coordinator_training.py"), str(tmp_path)]
    process = Process([*argv, "lostps"], child_env(), tmp_path, "launcher", merge_output=True)
    result = process.wait(timeout=300)
    output = result.stdout
    assert result.returncode == 0, output
    first, _, second = output.partition("restarting the job")
    assert "ps 0 (localhost:" in first and "PeerLostError" in first, output
    assert "[chief] restored step 10" in second, output
    # Resumed with the ps's values and momentum from the checkpoint: the weights of 20
    # uninterrupted steps.
    for got, want in json.loads((tmp_path / "result.json").read_text())["weights"]:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _job(
    tmp_path: Path, mode: str, *, workers: int, tolerate: bool = False, env: dict | None = None
) -> dict:
    argv = [sys.executable, "-m", "stratagem.cli", "run", "--chief", "-n", str(workers)]
    argv += ["--ps", "1", *(["--tolerate-worker-loss"] if tolerate else [])]
    argv += [str(WORKERS / "coordinator_training.py"), str(tmp_path), mode]
    result = Process(argv, child_env(env), tmp_path, "launcher", merge_output=True).wait(
        timeout=300
    )
    assert result.returncode == 0, result.stdout
    assert f"coordinator training {mode} done" in result.stdout, result.stdout
    return json.loads((tmp_path / "result.json").read_text())
