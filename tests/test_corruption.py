"""The corruption suite (issue 14): every file of a checkpoint (plain and sharded) and of a
saved model, truncated, with bytes flipped, or removed. Each must give a named error (a
stratagem error class, naming the save) or, through ``latest_checkpoint`` and
``CheckpointManager``, a warned fall-back to the previous intact checkpoint. The figure printed
is "tried / silent" (silent: loaded without an error or a warning); the suite asserts 0 silent.

    pytest tests/test_corruption.py -q -s   # prints the figure
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

import stratagem as sg
from stratagem import dtensor
from stratagem.dtensor import Layout, LayoutMap
from stratagem.errors import StratagemError
from stratagem.keras.exported_program import ProgramError
from stratagem.train import DamagedSaveError, FellBackWarning

pytestmark = pytest.mark.filterwarnings("ignore:DTensor random operators")

DAMAGES = ("truncated", "flipped", "removed")
RESULTS: list[tuple[str, str, str, str]] = []  # (save kind, file, damage, outcome)


def damage(path: str, how: str) -> None:
    if how == "removed":
        os.remove(path)
        return
    with open(path, "rb") as f:
        data = bytearray(f.read())
    if how == "truncated":
        data = data[: len(data) // 2]
    else:  # one byte in the middle, every bit flipped
        data[len(data) // 2] ^= 0xFF
    with open(path, "wb") as f:
        f.write(bytes(data))


def outcome(load: Callable[[], object], save: str) -> str:
    """'named error', 'warned fall-back' or 'silent' for one load of a damaged save."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            load()
        except (StratagemError, ProgramError) as e:
            return "named error" if save in str(e) else f"unnamed: {e}"
        except Exception as e:  # a library's own error: a fault, but not a named one
            return f"unnamed: {type(e).__name__}: {e}"
    if any(issubclass(w.category, FellBackWarning) and save in str(w.message) for w in caught):
        return "warned fall-back"
    return "silent"


@pytest.fixture(scope="module")
def mesh():
    assert not dist.is_initialized()
    mesh = dtensor.create_mesh([("batch", 1), ("model", 1)], devices=["CPU:0"])
    yield mesh
    dist.destroy_process_group()


@pytest.fixture(scope="module", autouse=True)
def figure():
    yield
    tried = len(RESULTS)
    silent = sum(r[3] != "named error" and r[3] != "warned fall-back" for r in RESULTS)
    print(f"\ncorruption suite: {tried} tried / {silent} silent")
    for kind, name, how, result in RESULTS:
        print(f"  {kind:17} {name:18} {how:10} {result}")


def _checkpoint_cases(make: Callable[[str], tuple[sg.train.Checkpoint, str, str]], kind: str):
    """Damage each file of the newest of two checkpoints: a direct restore names the damage;
    latest_checkpoint and CheckpointManager fall back to the older one with a warning."""

    def run(tmp_path) -> None:
        checkpoint, _, newest = make(str(tmp_path / "probe"))
        names = sorted(os.listdir(newest))
        for name in names:
            for how in DAMAGES:
                where = str(tmp_path / f"{name}-{how}")
                checkpoint, older, newest = make(where)
                damage(os.path.join(newest, name), how)
                direct = outcome(lambda c=checkpoint, p=newest: c.restore(p), newest)
                RESULTS.append((kind, name, how, direct))
                assert direct == "named error", (name, how, direct)

                def by_latest(c=checkpoint, d=where, o=older) -> None:
                    found = sg.train.latest_checkpoint(d)
                    assert found == o, found
                    c.restore(found)

                fell_back = outcome(by_latest, newest)
                RESULTS.append((f"{kind} latest", name, how, fell_back))
                assert fell_back == "warned fall-back", (name, how, fell_back)
                manager = sg.train.CheckpointManager(checkpoint, where)
                managed = outcome(manager.restore_or_initialize, newest)
                RESULTS.append((f"{kind} manager", name, how, managed))
                assert managed == "warned fall-back", (name, how, managed)
                # The only checkpoint damaged: a named error, never a silent fresh start.
                shutil.rmtree(older)
                alone = outcome(lambda d=where: sg.train.latest_checkpoint(d), newest)
                RESULTS.append((f"{kind} alone", name, how, alone))
                assert alone == "named error", (name, how, alone)

    return run


def _plain(where: str) -> tuple[sg.train.Checkpoint, str, str]:
    checkpoint = sg.train.Checkpoint(model=torch.nn.Linear(3, 2), step=torch.tensor(1))
    manager = sg.train.CheckpointManager(checkpoint, where, max_to_keep=2)
    older = manager.save()
    return checkpoint, older, manager.save()


def test_each_file_of_a_checkpoint_damaged_is_named_or_warned(tmp_path):
    _checkpoint_cases(_plain, "checkpoint")(tmp_path)


def test_each_file_of_a_sharded_checkpoint_damaged_is_named_or_warned(mesh, tmp_path):
    def sharded(where: str) -> tuple[sg.train.Checkpoint, str, str]:
        layout_map = LayoutMap(mesh)
        layout_map["weight"] = Layout.inner_sharded(mesh, "batch", rank=2)
        model = dtensor.apply_layout_map(torch.nn.Linear(4, 2), layout_map)
        checkpoint = sg.train.Checkpoint(model=model, step=torch.tensor(1))
        manager = sg.train.CheckpointManager(checkpoint, where, max_to_keep=2)
        older = manager.save()
        return checkpoint, older, manager.save()

    _checkpoint_cases(sharded, "sharded")(tmp_path)


def test_each_file_of_a_saved_model_damaged_is_a_named_error(tmp_path):
    module = torch.nn.Sequential(torch.nn.Linear(3, 2))
    probe = str(tmp_path / "probe")
    sg.saved_model.save(module, probe, signatures=torch.ones(2, 3))
    for name in sorted(os.listdir(probe)):
        for how in DAMAGES:
            path = str(tmp_path / f"{name}-{how}")
            shutil.copytree(probe, path)
            damage(os.path.join(path, name), how)
            result = outcome(lambda p=path: sg.keras.models.load_model(p), path)
            RESULTS.append(("saved model", name, how, result))
            assert result == "named error", (name, how, result)
            result = outcome(lambda p=path: sg.saved_model.load(p), path)
            RESULTS.append(("saved_model.load", name, how, result))
            assert result == "named error", (name, how, result)


def test_a_damaged_file_names_the_file_and_what_was_expected(tmp_path):
    path = sg.train.Checkpoint(a=torch.ones(4)).write(tmp_path / "c")
    damage(os.path.join(path, "state.pt"), "flipped")
    with pytest.raises(DamagedSaveError, match=r"'state.pt' has sha256 [0-9a-f]+, expected"):
        sg.train.Checkpoint(a=torch.zeros(4)).restore(path)
