"""A parameter shared by two modules (GPT-2's ``lm_head.weight is transformer.wte.weight``) is
one parameter under every strategy, in every checkpoint and in every export.

Each strategy trains the tiny GPT-2 a few SGD steps (SGD: a tie counted twice would double its
gradient, which Adam would hide) on the same global batches as one process, and must end where
that process ends, with the tie intact. One job per family of strategies: Mirrored and
CentralStorage in this process; MWMS and FSDP in one 2-process job; sync parameter servers;
the coordinator (``tests/workers/tied_checks.py``).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from typing_extensions import override

import stratagem as sg
from cluster_utils import ONE_WORKER_COORDINATOR, WORKERS, launch_checks, run_cluster
from in_turn_strategy import InTurnExtended
from real_models import hf_models
from stratagem.train.dcp_reader import read_dcp_metadata

# As tests/workers/tied_checks.py: the global batches, the learning rate.
STEPS, GLOBAL_BATCH, LR = 3, 8, 0.5
CHIEF_SEED = 100
TIED = "lm_head.weight"
FIRST = "transformer.wte.weight"
CHECKS = WORKERS / "tied_checks.py"


def batches() -> list[torch.Tensor]:
    return [hf_models.tokens(GLOBAL_BATCH, seed=10 + i) for i in range(STEPS)]


def tied(model: torch.nn.Module) -> bool:
    return model.lm_head.weight is model.transformer.wte.weight


def assert_same(actual: dict, expected: dict, what: str, *, rtol=1e-4, atol=1e-5) -> None:
    assert actual.keys() == expected.keys(), what
    for k in expected:
        torch.testing.assert_close(actual[k], expected[k], rtol=rtol, atol=atol, msg=f"{what}: {k}")


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """GPT-2 seeded as the chief, trained in one process on the whole global batches."""
    model = hf_models.gpt2(seed=CHIEF_SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for ids in batches():
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    assert tied(model)
    return weights(model)


def gpt2_from(state: dict[str, torch.Tensor], **overrides) -> torch.nn.Module:
    model = hf_models.gpt2(seed=3, **overrides)  # other values, overwritten
    model.load_state_dict(state)
    return model


# ---------------------------------------------------------------- one process, threads


def _train_threaded(
    strategy, model: torch.nn.Module | None = None
) -> tuple[torch.nn.Module, list[bool]]:
    """The chief's GPT-2 (built in the scope unless ``model`` is given) trained on the global
    batches through ``strategy.run``."""
    with strategy.scope():
        if model is None:
            model = hf_models.gpt2(seed=CHIEF_SEED)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    data = sg.data.Dataset.from_tensor_slices(torch.cat(batches())).batch(GLOBAL_BATCH)
    one_gradient: list[bool] = []  # per replica and step: both names' .grad one tensor

    def step(ids):
        optimizer.zero_grad()
        (model(input_ids=ids, labels=ids).loss / strategy.num_replicas_in_sync).backward()
        # A replica sees its own copies: both names must be the same copy, so one gradient.
        one_gradient.append(model.lm_head.weight.grad is model.transformer.wte.weight.grad)
        optimizer.step()

    for ids in strategy.experimental_distribute_dataset(data):
        strategy.run(step, args=(ids,))
    return model, one_gradient


@pytest.mark.parametrize(
    "make",
    [
        lambda: sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"]),
        lambda: sg.distribute.experimental.CentralStorageStrategy(["cpu:0", "cpu:1"]),
    ],
    ids=["mirrored", "central-storage"],
)
def test_replica_threads_train_the_tie_as_one_process_and_keep_it(make, reference):
    model, one_gradient = _train_threaded(make())
    assert tied(model)
    assert one_gradient == [True] * (2 * STEPS)
    assert_same(weights(model), reference, type(make()).__name__, rtol=1e-5, atol=1e-6)


class MovingStrategy(sg.distribute.Strategy):
    """The toy strategy of the contract tests, placing every tensor it captures anew, as a
    strategy moving parameters to its device (a GPU) does."""

    def __init__(self) -> None:
        super().__init__(MovingExtended(self, 2, "cpu:0"))


class MovingExtended(InTurnExtended):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        # The memory of what it moved: in place already (as on the device), Parameter or not.
        self.moved: set[int] = set()

    @override
    def _place(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.data_ptr() in self.moved:
            return tensor
        moved = tensor.detach().clone()
        self.moved.add(moved.data_ptr())
        return moved


@pytest.mark.parametrize("how", ["built in scope", "distribute_module"])
def test_a_strategy_that_moves_parameters_moves_a_tied_one_once_and_trains_it(how, reference):
    strategy = MovingStrategy()
    if how == "built in scope":
        model, one_gradient = _train_threaded(strategy)
    else:
        model = hf_models.gpt2(seed=CHIEF_SEED)
        before = model.transformer.wte.weight
        strategy.distribute_module(model)
        assert model.transformer.wte.weight is not before  # moved
        model, one_gradient = _train_threaded(strategy, model)
    assert tied(model)
    # Moved (a tensor the strategy made), and then trained as one parameter: the weights of
    # one process on the same global batches.
    assert model.transformer.wte.weight.data_ptr() in strategy.extended.moved
    assert one_gradient == [True] * (2 * STEPS)
    assert_same(weights(model), reference, how, rtol=1e-5, atol=1e-6)


def test_a_checkpoint_writes_the_tie_once_and_restores_it(tmp_path, reference):
    with sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
        model = gpt2_from(reference)
    path = sg.train.Checkpoint(model=model).save(tmp_path / "ckpt")
    state = torch.load(Path(path) / "state.pt", weights_only=True)["model"]
    # torch.save writes a storage once: the two names read one tensor's bytes.
    assert state[TIED].untyped_storage().data_ptr() == state[FIRST].untyped_storage().data_ptr()
    meta = json.loads((Path(path) / "meta.json").read_text())
    assert meta["trackables"]["model"]["tied"] == {TIED: FIRST}
    fresh = hf_models.gpt2(seed=5)
    sg.train.Checkpoint(model=fresh).restore(path).assert_consumed()
    assert tied(fresh)
    assert_same(weights(fresh), reference, "restored", rtol=0, atol=0)


def test_model_save_writes_the_tie_once_and_load_model_ties_it_again(tmp_path, reference):
    # use_cache=False: GPT-2's cache object is no output torch.export can trace.
    model = sg.keras.Model(gpt2_from(reference, use_cache=False))
    ids = hf_models.tokens(2, seed=42)
    expected = model(ids).logits.detach()  # calling it builds it (the program's example)
    path = model.save(str(tmp_path / "saved"))
    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        names, metadata = set(f.keys()), f.metadata()
    assert FIRST in names and TIED not in names  # once, as Hugging Face writes it
    assert json.loads(metadata["stratagem.tied"]) == {TIED: FIRST}
    assert json.loads((Path(path) / "config.json").read_text())["tied"] == {TIED: FIRST}
    # From the program (which holds a copy per name) and into a fresh instance of the class.
    for module in (None, hf_models.gpt2(seed=5, use_cache=False)):
        loaded = sg.keras.models.load_model(path, module=module).module
        assert tied(loaded)
        assert len(list(loaded.parameters())) == len(reference) - 1  # 29 names, 28 parameters
        torch.testing.assert_close(loaded(ids).logits, expected)


# ---------------------------------------------------------------- MWMS and FSDP, 2 processes


@pytest.fixture(scope="module")
def collective(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("collective")
    results = run_cluster(CHECKS, 2, out, args=["collective", str(out)], timeout=300)
    for i, r in enumerate(results):
        r.check(f"worker {i}")
    return out


def _facts(out: Path, mode: str) -> dict:
    return json.loads((out / f"{mode}.json").read_text())


def _tensors(out: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{name}.pt", weights_only=True)


@pytest.mark.multiprocess
def test_multi_worker_mirrored_trains_the_tie_as_one_process(collective, reference):
    assert _facts(collective, "collective")["mwms_tied"]
    assert_same(_tensors(collective, "mwms"), reference, "MWMS")


@pytest.mark.multiprocess
def test_fully_sharded_default_units_keep_the_tie_in_the_root(collective, reference):
    facts = _facts(collective, "collective")
    assert facts["fsdp_tied"]
    # transformer would split the tie (its wte is lm_head's weight): its children are units.
    assert facts["fsdp_units"] == [
        "",
        "transformer.wpe",
        "transformer.h.0",
        "transformer.h.1",
        "transformer.ln_f",
    ]
    assert_same(_tensors(collective, "fsdp"), reference, "FSDP")


@pytest.mark.multiprocess
def test_an_explicit_wrap_that_splits_the_tie_is_a_named_error(collective):
    message = _facts(collective, "collective")["split_wrap"]
    assert message.startswith("SharedParameterError: FullyShardedStrategy(wrap=['transformer'])")
    assert f"splits the tied parameter {FIRST!r}: it is one tensor with {TIED!r}" in message
    assert "in the FSDP unit 'transformer' and 'lm_head.weight' in '(the root)'" in message
    assert "leave ['transformer'] out of wrap=" in message


@pytest.mark.multiprocess
def test_a_sharded_checkpoint_writes_the_tie_once_and_restores_it(collective):
    facts = _facts(collective, "collective")
    path = facts["sharded_path"]
    keys = read_dcp_metadata(path).state_dict_metadata
    assert f"model.{FIRST}" in keys and f"model.{TIED}" not in keys
    trained = _tensors(collective, "fsdp")
    # Into a fresh sharded model on the same job, and into a plain model in this process.
    assert facts["restored_tied"]
    assert_same(_tensors(collective, "restored"), trained, "restored sharded", rtol=0, atol=0)
    plain = hf_models.gpt2(seed=5)
    sg.train.Checkpoint(model=plain).restore(path).expect_partial()  # (not its optimizer)
    assert tied(plain)
    assert_same(weights(plain), trained, "restored in one process", rtol=0, atol=0)


@pytest.mark.multiprocess
def test_a_sharded_model_saves_its_tie_once(collective):
    path = collective / "saved_fsdp"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert TIED not in set(f.keys())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = sg.keras.models.load_model(str(path), module=hf_models.gpt2(seed=5)).module
    assert tied(loaded)
    assert_same(weights(loaded), _tensors(collective, "fsdp"), "saved", rtol=0, atol=0)


# ---------------------------------------------------------------- parameter servers


@pytest.mark.multiprocess
def test_sync_parameter_servers_hold_one_variable_and_train_the_tie_as_one_process(
    tmp_path, reference
):
    launch_checks(CHECKS, tmp_path, "ps", "-n", "2", "--ps", "1", done="tied checks ps done")
    facts = _facts(tmp_path, "ps")
    assert facts["ps_tied"]
    assert facts["ps_variables"] == len(reference) - 1  # 28 tensors for GPT-2's 29 names
    trained = _tensors(tmp_path, "ps")
    assert_same(trained, reference, "sync ps")
    # The chief's checkpoint: the ps's values, the tie restored.
    path = sg.train.latest_checkpoint(tmp_path / "ps_ckpt")
    plain = hf_models.gpt2(seed=5)
    sg.train.Checkpoint(model=plain).restore(path).assert_consumed()
    assert tied(plain)
    assert_same(weights(plain), trained, "ps checkpoint", rtol=0, atol=0)


@pytest.mark.multiprocess
def test_the_coordinators_worker_keeps_the_tie_and_trains_as_one_process(tmp_path, reference):
    # GPT-2 itself: its worker rebuilds the model each call, config and generation_config
    # included (a library's plain objects travel by their attributes).
    launch_checks(
        CHECKS,
        tmp_path,
        "coordinator",
        *ONE_WORKER_COORDINATOR,
        done="tied checks coordinator done",
    )
    facts = _facts(tmp_path, "coordinator")
    assert facts["worker_tied"] == [True] * STEPS  # the worker's copies, in every function
    assert facts["chief_tied"]
    assert facts["ps_variables"] == len(reference) - 1  # 28 tensors for GPT-2's 29 names
    assert_same(_tensors(tmp_path, "coordinator"), reference, "coordinator")
    # Model.fit through the coordinator on GPT-2's own loss: the same steps, and its logged
    # loss the epoch's mean of the steps' losses.
    assert facts["fit_tied"]
    assert_same(_tensors(tmp_path, "coordinator_fit"), reference, "coordinator fit")
    model = hf_models.gpt2(seed=CHIEF_SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for ids in batches():
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert facts["fit_loss"] == pytest.approx([sum(losses) / STEPS], rel=1e-5)
