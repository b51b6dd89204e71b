"""Checkpoints: round trips, strict matching, atomic writes, the manager, chief-only writes."""

from __future__ import annotations

import json
import os
import shutil
from datetime import datetime

import pytest
import torch
from torch import nn

import stratagem as sg
import stratagem.train as sg_train
from stratagem.comm import LocalCommunicator
from stratagem.distribute import StrategyExtended
from stratagem.train import (
    Checkpoint,
    CheckpointError,
    CheckpointManager,
    atomic_dir,
    latest_checkpoint,
)
from stratagem.train.checkpoint import CheckpointMatchError
from stratagem.train.manifest import DamagedSaveError, write_manifest


class FakeWorker(LocalCommunicator):
    """A process that is not the chief: rank 1 of 2, collectives as the identity."""

    def __init__(self, rank: int = 1, world_size: int = 2) -> None:
        super().__init__()
        self.rank = rank
        self.world_size = world_size


class WorkerExtended(StrategyExtended):
    """The core contract with nothing to distribute (one replica): its two required hooks."""

    def adopt(self, tensors):
        pass

    def before_optimizer_step(self, optimizer):
        pass


class WorkerStrategy(sg.distribute.Strategy):
    """A strategy (through the public contract alone) whose process is worker 1 of 2."""

    def __init__(self) -> None:
        super().__init__(WorkerExtended(self, ["cpu:0"], comm=FakeWorker()))


@pytest.fixture
def non_chief():
    """Code in the scope of a strategy whose process is not the chief: objects it builds, and
    checkpoints of objects no strategy owns, are that strategy's."""
    with WorkerStrategy().scope():
        yield


def counter(value: int = 0) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.int64)


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)) for _ in range(n)]


def train(model: nn.Module, opt: torch.optim.Optimizer, data: list) -> None:
    for x, y in data:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def entries(directory) -> list[str]:
    return sorted(os.listdir(directory))


# --- round trips ------------------------------------------------------------------------------


def test_restore_into_fresh_objects_continues_exactly_like_an_uninterrupted_run(tmp_path):
    data = batches(6)
    ref_model, ref_opt = build(0)
    train(ref_model, ref_opt, data)

    model, opt = build(0)
    epoch, step = counter(), counter()
    train(model, opt, data[:3])
    step.fill_(3)
    path = Checkpoint(model=model, optimizer=opt, epoch=epoch, step_in_epoch=step).save(
        tmp_path / "ckpt"
    )

    model2, opt2 = build(123)  # different initial weights and an empty optimizer
    assert not torch.equal(model2[0].weight, ref_model[0].weight)
    epoch2, step2 = counter(), counter()
    ckpt2 = Checkpoint(model=model2, optimizer=opt2, epoch=epoch2, step_in_epoch=step2)
    ckpt2.restore(path).assert_consumed()
    assert int(step2) == 3 and int(ckpt2.save_counter) == 1
    train(model2, opt2, data[int(step2) :])

    for p_ref, p in zip(ref_model.parameters(), model2.parameters()):
        assert torch.equal(p_ref, p)
    ref_state, state = ref_opt.state_dict()["state"], opt2.state_dict()["state"]
    assert ref_state.keys() == state.keys()
    for i in ref_state:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(ref_state[i][key], state[i][key]), (i, key)


def test_counters_are_restored_into_the_same_tensor_objects(tmp_path):
    epoch, step = counter(2), counter(5)
    ckpt = Checkpoint(epoch=epoch, step_in_epoch=step)
    path = ckpt.write(tmp_path / "c")
    epoch.fill_(9)
    step.zero_()
    ckpt.restore(path).assert_consumed()
    assert ckpt.epoch is epoch and ckpt.step_in_epoch is step
    assert (int(epoch), int(step)) == (2, 5)
    assert epoch.dtype == torch.int64 and epoch.dim() == 0

    # A loop that held a parameter tensor sees the restored value too (copied under no_grad).
    w = nn.Parameter(torch.ones(3))
    p = Checkpoint(w=w).write(tmp_path / "w")
    with torch.no_grad():
        w.mul_(5)
    Checkpoint(w=w).restore(p)
    assert torch.equal(w, torch.ones(3)) and w.requires_grad


def test_save_numbers_paths_and_write_does_not(tmp_path):
    ckpt = Checkpoint(step=counter())
    assert int(ckpt.save_counter) == 0 and ckpt.save_counter.dtype == torch.int64
    assert ckpt.save(tmp_path / "p") == f"{tmp_path / 'p'}-1"
    assert ckpt.save(str(tmp_path / "p")) == f"{tmp_path / 'p'}-2"
    assert ckpt.write(tmp_path / "exact") == str(tmp_path / "exact")
    assert int(ckpt.save_counter) == 2
    assert entries(tmp_path) == ["checkpoint", "exact", "p-1", "p-2"]
    assert latest_checkpoint(tmp_path) == f"{tmp_path}{os.sep}p-2"
    # The counter is checkpointed: restoring p-1 brings it back to 1.
    ckpt.restore(f"{tmp_path / 'p'}-1")
    assert int(ckpt.save_counter) == 1


def test_state_objects_and_nested_checkpoints_round_trip(tmp_path):
    model, opt = build(0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=128.0)
    train(model, opt, batches(2))
    sched.step()
    sched.step()
    inner = Checkpoint(model=model, optimizer=opt)
    outer = Checkpoint(inner=inner, scheduler=sched, scaler=scaler, epoch=counter(4))
    path = outer.save(tmp_path / "n")

    model2, opt2 = build(1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    scaler2 = torch.amp.GradScaler("cpu")
    outer2 = Checkpoint(
        inner=Checkpoint(model=model2, optimizer=opt2),
        scheduler=sched2,
        scaler=scaler2,
        epoch=counter(),
    )
    outer2.restore(path).assert_consumed()
    assert sched2.last_epoch == 2 and opt2.param_groups[0]["lr"] == pytest.approx(0.0125)
    assert scaler2.get_scale() == 128.0
    assert int(outer2.epoch) == 4
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_trackables_are_attributes_and_assignment_tracks(tmp_path):
    model, _ = build(0)
    ckpt = Checkpoint(model=model)
    assert ckpt.model is model
    ckpt.epoch = counter(3)
    path = ckpt.write(tmp_path / "a")
    ckpt.epoch.zero_()
    ckpt.restore(path).assert_consumed()
    assert int(ckpt.epoch) == 3
    with pytest.raises(AttributeError, match=r"'optimizer'.*\['epoch', 'model'\]"):
        _ = ckpt.optimizer


# --- bad trackables and mismatches -------------------------------------------------------------


@pytest.mark.parametrize("value", ["a string", 3, None, [torch.zeros(1)], object()])
def test_untrackable_values_are_refused_with_the_key_and_type(value):
    with pytest.raises(TypeError) as info:
        Checkpoint(model=value)
    message = str(info.value)
    assert "'model'" in message and type(value).__qualname__ in message
    assert "torch.nn.Module" in message and "state_dict()" in message


def test_reserved_names_and_cycles_are_refused():
    with pytest.raises(ValueError, match="save_counter"):
        Checkpoint(save_counter=counter())
    with pytest.raises(ValueError, match="reserved"):
        Checkpoint(restore=counter())
    ckpt = Checkpoint(step=counter())
    with pytest.raises(ValueError, match="reserved"):
        ckpt.save_counter = counter()
    outer = Checkpoint(inner=ckpt)
    with pytest.raises(ValueError, match="contain itself"):
        ckpt.outer = outer


def test_missing_and_unexpected_module_keys_are_named_and_nothing_changes(tmp_path):
    small = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    path = Checkpoint(model=small, epoch=counter(7)).write(tmp_path / "s")

    bigger = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.Linear(2, 2))
    epoch = counter(0)
    before = [p.clone() for p in bigger.parameters()]
    with pytest.raises(CheckpointError) as info:
        Checkpoint(epoch=epoch, model=bigger).restore(path)  # epoch alone would match
    message = str(info.value)
    assert "'model'" in message and "missing keys" in message and "'3.weight'" in message
    # Checked before anything was copied: no half-restored state.
    assert int(epoch) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, bigger.parameters()))

    fewer = nn.Sequential(nn.Linear(4, 8))
    with pytest.raises(CheckpointError, match=r"unexpected keys \['2.weight', '2.bias'\]"):
        Checkpoint(model=fewer, epoch=counter()).restore(path)


def test_shape_mismatches_name_the_trackable_and_both_shapes(tmp_path):
    path = Checkpoint(model=nn.Linear(4, 8), epoch=counter(1)).write(tmp_path / "s")
    with pytest.raises(
        CheckpointError, match=r"'model'.*weight: saved \[8, 4\], module has \[9, 4\]"
    ):
        Checkpoint(model=nn.Linear(4, 9), epoch=counter()).restore(path)
    with pytest.raises(CheckpointError, match=r"'epoch'.*saved shape \[\] .*shape \[2\]"):
        Checkpoint(model=nn.Linear(4, 8), epoch=torch.zeros(2, dtype=torch.int64)).restore(path)
    with pytest.raises(CheckpointError, match=r"'epoch'.*dtype int64.*dtype float32"):
        Checkpoint(model=nn.Linear(4, 8), epoch=torch.tensor(0.0)).restore(path)


def test_kind_and_optimizer_mismatches_are_errors(tmp_path):
    model, opt = build(0)
    path = Checkpoint(model=model, optimizer=opt).write(tmp_path / "k")
    with pytest.raises(CheckpointError, match=r"'model'.*saved as a module.*tracked as a tensor"):
        Checkpoint(model=torch.zeros(1), optimizer=opt).restore(path)
    one_layer = nn.Linear(4, 8)
    other_opt = torch.optim.Adam(one_layer.parameters())
    with pytest.raises(CheckpointError, match=r"'optimizer'.*\[4\].*\[2\]"):
        Checkpoint(model=model, optimizer=other_opt).restore(path)


def test_load_status_reports_what_did_not_match(tmp_path):
    path = Checkpoint(a=counter(1), b=counter(2)).write(tmp_path / "s")

    a = counter()
    status = Checkpoint(a=a).restore(path)  # 'b' saved but not tracked
    assert int(a) == 1 and status.unused == ("b",)
    assert status.assert_existing_objects_matched() is status
    with pytest.raises(CheckpointMatchError, match=r"without a trackable \['b'\]"):
        status.assert_consumed()
    with pytest.raises(AssertionError):  # TF raises AssertionError; so do we
        status.assert_consumed()

    status = Checkpoint(a=counter(), c=counter()).restore(path)  # 'c' tracked, not saved
    with pytest.raises(CheckpointMatchError, match=r"\['c'\]"):
        status.assert_existing_objects_matched()
    assert status.expect_partial() is status
    assert status.assert_nontrivial_match() is status

    with pytest.warns(UserWarning, match="expect_partial"):
        Checkpoint(a=counter(), c=counter()).restore(path)  # status discarded unchecked


def test_restore_none_does_nothing(tmp_path):
    a = counter(5)
    status = Checkpoint(a=a).restore(None)
    assert int(a) == 5
    assert status.expect_partial() is status
    with pytest.raises(AssertionError, match="save_path=None"):
        status.assert_consumed()


# --- what is and is not a checkpoint -----------------------------------------------------------


def test_restoring_something_that_is_not_a_checkpoint_is_a_clear_error(tmp_path):
    ckpt = Checkpoint(a=counter())
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        ckpt.restore(tmp_path / "missing")
    (tmp_path / "file").write_text("hello")
    with pytest.raises(CheckpointError, match="it is a file"):
        ckpt.restore(tmp_path / "file")
    (tmp_path / "dir").mkdir()
    with pytest.raises(CheckpointError, match=r"no meta.json.*latest_checkpoint"):
        ckpt.restore(tmp_path / "dir")
    path = ckpt.write(tmp_path / "c")
    meta_path = os.path.join(path, "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    with open(meta_path, "w") as f:
        json.dump({**meta, "version": 99}, f)
    # An edited meta.json no longer matches the manifest: damage, named as such.
    with pytest.raises(DamagedSaveError, match=r"'meta.json' has .* bytes, expected"):
        ckpt.restore(path)
    write_manifest(path, ["meta.json", "state.pt"])  # as a newer stratagem would have written
    with pytest.raises(CheckpointError, match="version 99"):
        ckpt.restore(path)
    with open(meta_path, "w") as f:
        json.dump({**meta, "format": "something else"}, f)
    write_manifest(path, ["meta.json", "state.pt"])
    with pytest.raises(CheckpointError, match="'something else'"):
        ckpt.restore(path)


def test_writing_over_a_foreign_directory_is_refused(tmp_path):
    foreign = tmp_path / "data"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="refusing to overwrite"):
        Checkpoint(a=counter()).write(foreign)
    assert (foreign / "precious.txt").read_text() == "keep me"
    # An empty directory is fine (someone ran makedirs first).
    (tmp_path / "empty").mkdir()
    Checkpoint(a=counter(3)).write(tmp_path / "empty")
    assert sg_train.storage.is_checkpoint(str(tmp_path / "empty"))


_side_effects: list[str] = []


def _record_side_effect() -> str:
    _side_effects.append("ran")
    return "pwned"


class _Evil:
    def __reduce__(self):
        return (_record_side_effect, ())


def test_state_files_are_loaded_with_weights_only(tmp_path):
    path = Checkpoint(a=counter(1)).write(tmp_path / "c")
    torch.save({"a": _Evil(), "save_counter": counter()}, os.path.join(path, "state.pt"))
    with pytest.raises(DamagedSaveError, match=r"'state.pt' has"):  # the manifest's checksum
        Checkpoint(a=counter()).restore(path)
    write_manifest(path, ["meta.json", "state.pt"])  # a crafted save with a matching manifest
    with pytest.raises(CheckpointError, match="weights_only=True"):
        Checkpoint(a=counter()).restore(path)
    assert _side_effects == []


class _UnsafeState:
    """A metric whose state is not plain data: weights_only could never load it back."""

    def state_dict(self) -> dict:
        return {"thing": _Evil()}

    def load_state_dict(self, state: dict) -> None:
        pass


def test_state_that_could_not_be_loaded_back_is_refused_at_save_time(tmp_path):
    good = Checkpoint(a=counter(1)).write(tmp_path / "c")
    with pytest.raises(CheckpointError, match=r"weights_only.*_Evil|_record_side_effect"):
        Checkpoint(a=counter(2), metric=_UnsafeState()).write(good)
    ckpt = Checkpoint(a=counter())
    ckpt.restore(good).assert_consumed()
    assert int(ckpt.a) == 1
    assert entries(tmp_path) == ["c"]


# --- meta.json ---------------------------------------------------------------------------------


def test_meta_json_describes_the_checkpoint(tmp_path):
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model, opt = build(0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    ckpt = Checkpoint(
        model=model,
        optimizer=opt,
        scheduler=sched,
        epoch=counter(3),
        loss=torch.tensor(0.5),
        weights=torch.zeros(2, 3),
        inner=Checkpoint(step=counter(11)),
    )
    ckpt.save(tmp_path / "ckpt")
    path = ckpt.save(tmp_path / "ckpt")
    with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)  # plain JSON: readable without torch

    assert meta["format"] == "stratagem.checkpoint" and meta["version"] == 1
    assert meta["save_counter"] == 2
    assert datetime.fromisoformat(meta["created"]).tzinfo is not None
    assert meta["torch_version"] == torch.__version__
    assert meta["distribution"] == strategy.extended.describe()
    assert meta["distribution"]["strategy"] == "MirroredStrategy"
    assert meta["distribution"]["num_replicas_in_sync"] == 2
    assert meta["distribution"]["world_size"] == 1
    t = meta["trackables"]
    assert t["model"] == {"kind": "module", "type": "Sequential"}
    assert t["optimizer"] == {"kind": "optimizer", "type": "Adam"}
    assert t["scheduler"] == {"kind": "state", "type": "StepLR"}
    assert t["epoch"] == {
        "kind": "tensor",
        "type": "Tensor",
        "dtype": "int64",
        "shape": [],
        "value": 3,
    }
    assert t["loss"]["value"] == 0.5 and t["loss"]["dtype"] == "float32"
    assert t["weights"]["shape"] == [2, 3] and "value" not in t["weights"]
    assert t["inner"]["kind"] == "checkpoint"
    assert t["inner"]["trackables"]["step"]["value"] == 11
    assert sorted(os.listdir(path)) == ["manifest.json", "meta.json", "state.pt"]
    state = torch.load(os.path.join(path, "state.pt"), weights_only=True)
    assert set(state) == {*t, "save_counter"}


# --- atomic writes -----------------------------------------------------------------------------


def _failing_save(obj, f, *args, **kwargs):
    f.write(b"PK\x03\x04 half a zip file")
    raise OSError("disk full (simulated)")


def test_a_crash_mid_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    epoch = counter(1)
    ckpt = Checkpoint(epoch=epoch)
    manager = CheckpointManager(ckpt, tmp_path, max_to_keep=1)
    first = manager.save()
    epoch.fill_(2)

    seen = []

    def failing_save(obj, f, *args, **kwargs):
        # What a reader would see at the moment of the crash.
        seen.append((os.path.basename(os.path.dirname(f.name)), entries(tmp_path)))
        _failing_save(obj, f)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        manager.save()
    monkeypatch.undo()
    [(writing_into, visible)] = seen
    assert writing_into.startswith(f".ckpt-2.tmp-{os.getpid()}-")  # hidden, names the pid
    assert visible == sorted(["checkpoint", "ckpt-1", writing_into])

    assert entries(tmp_path) == ["checkpoint", "ckpt-1"]  # no ckpt-2, no hidden leftovers
    assert latest_checkpoint(tmp_path) == first == manager.latest_checkpoint
    assert int(ckpt.save_counter) == 1  # the failed save did not consume a number
    fresh = counter()
    Checkpoint(epoch=fresh).restore(first).assert_consumed()
    assert int(fresh) == 1
    assert manager.save() == os.path.join(tmp_path, "ckpt-2")


def test_a_crash_while_overwriting_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    epoch = counter(1)
    ckpt = Checkpoint(epoch=epoch)
    path = ckpt.write(tmp_path / "same")
    epoch.fill_(2)
    monkeypatch.setattr(torch, "save", _failing_save)
    with pytest.raises(OSError):
        ckpt.write(tmp_path / "same")
    monkeypatch.undo()
    assert entries(tmp_path) == ["same"]
    ckpt.restore(path)
    assert int(epoch) == 1

    # Failing on the one-step exchange: the old checkpoint was never moved.
    epoch.fill_(3)

    def exchange(a, b):
        raise OSError("exchange failed (simulated)")

    monkeypatch.setattr(atomic_dir, "_exchange", exchange)
    with pytest.raises(OSError, match="exchange failed"):
        ckpt.write(tmp_path / "same")
    monkeypatch.undo()
    assert entries(tmp_path) == ["same"]
    ckpt.restore(path)
    assert int(epoch) == 1

    # Where the system cannot exchange (two renames), failing on the final rename, after the
    # old one was moved aside: it is moved back.
    real_rename = os.rename

    def rename(src, dst):
        if os.path.basename(src).startswith(".same.tmp-"):
            raise OSError("rename failed (simulated)")
        real_rename(src, dst)

    monkeypatch.setattr(atomic_dir, "_exchange", lambda a, b: False)
    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="rename failed"):
        ckpt.write(tmp_path / "same")
    monkeypatch.undo()
    assert entries(tmp_path) == ["same"]
    ckpt.restore(path)
    assert int(epoch) == 1

    # And a successful overwrite replaces it completely.
    epoch.fill_(4)
    ckpt.write(tmp_path / "same")
    epoch.zero_()
    ckpt.restore(path)
    assert int(epoch) == 4 and entries(tmp_path) == ["same"]


def test_leftovers_of_a_killed_process_are_ignored_then_cleaned(tmp_path):
    ckpt = Checkpoint(epoch=counter(1))
    manager = CheckpointManager(ckpt, tmp_path)
    manager.save()
    ckpt.epoch.fill_(2)
    manager.save()
    # A process killed after writing a complete temporary copy, one killed while deleting, and
    # one killed between moving ckpt-1 aside and moving its replacement in.
    shutil.copytree(tmp_path / "ckpt-2", tmp_path / ".ckpt-3.tmp-999999-0123abcd")
    shutil.copytree(tmp_path / "ckpt-2", tmp_path / ".ckpt-0.del-999999-0123abcd")
    os.rename(tmp_path / "ckpt-1", tmp_path / ".ckpt-1.old-999999-89abcdef")
    os.remove(tmp_path / "checkpoint")  # and no index, to force a scan

    assert latest_checkpoint(tmp_path) == os.path.join(tmp_path, "ckpt-2")

    manager2 = CheckpointManager(Checkpoint(epoch=counter()), tmp_path)
    assert entries(tmp_path) == ["ckpt-1", "ckpt-2"]  # leftovers gone, ckpt-1 recovered
    assert manager2.checkpoints == [os.path.join(tmp_path, n) for n in ("ckpt-1", "ckpt-2")]
    assert manager2.restore_or_initialize() == os.path.join(tmp_path, "ckpt-2")
    assert int(manager2.checkpoint.epoch) == 2


# --- CheckpointManager -------------------------------------------------------------------------


def test_max_to_keep_deletes_the_oldest_and_a_new_manager_continues(tmp_path):
    epoch = counter()
    ckpt = Checkpoint(epoch=epoch)
    manager = CheckpointManager(ckpt, tmp_path / "run", max_to_keep=2)
    assert manager.latest_checkpoint is None and manager.checkpoints == []
    assert manager.directory == str(tmp_path / "run") and manager.checkpoint is ckpt
    paths = []
    for i in range(4):
        epoch.fill_(i)
        paths.append(manager.save())
    run = tmp_path / "run"
    assert paths == [os.path.join(run, f"ckpt-{n}") for n in (1, 2, 3, 4)]
    assert entries(run) == ["checkpoint", "ckpt-3", "ckpt-4"]
    assert manager.checkpoints == paths[2:] and manager.latest_checkpoint == paths[3]
    index = json.loads((run / "checkpoint").read_text())
    assert index["latest"] == "ckpt-4"
    assert [e["name"] for e in index["checkpoints"]] == ["ckpt-3", "ckpt-4"]

    # After a restart: new objects, new manager on the same directory.
    epoch2 = counter()
    ckpt2 = Checkpoint(epoch=epoch2)
    manager2 = CheckpointManager(ckpt2, run, max_to_keep=2)
    assert manager2.checkpoints == paths[2:]
    assert manager2.restore_or_initialize() == paths[3]
    assert int(epoch2) == 3 and int(ckpt2.save_counter) == 4
    assert manager2.save() == os.path.join(run, "ckpt-5")
    assert entries(run) == ["checkpoint", "ckpt-4", "ckpt-5"]


def test_max_to_keep_none_keeps_all_and_checkpoint_number_names(tmp_path):
    ckpt = Checkpoint(step=counter())
    manager = CheckpointManager(ckpt, tmp_path, max_to_keep=None, checkpoint_name="model")
    manager.save()
    manager.save(checkpoint_number=100)
    manager.save(checkpoint_number=torch.tensor(200))
    assert entries(tmp_path) == ["checkpoint", "model-1", "model-100", "model-200"]
    assert int(ckpt.save_counter) == 3  # incremented either way, as in TF
    with pytest.raises(TypeError, match="checkpoint_number"):
        manager.save(checkpoint_number=1.5)


def test_keep_checkpoint_every_n_hours_preserves_one_per_period(tmp_path, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("stratagem.train.checkpoint_manager.time.time", lambda: clock[0])
    manager = CheckpointManager(
        Checkpoint(step=counter()), tmp_path, max_to_keep=1, keep_checkpoint_every_n_hours=1
    )
    for at in (1000.0, 2000.0, 4000.0, 8000.0):
        clock[0] = at
        manager.save()
    # ckpt-3 (saved 4000 s after the manager started, past one hour) is kept, unmanaged.
    assert entries(tmp_path) == ["checkpoint", "ckpt-3", "ckpt-4"]
    assert manager.checkpoints == [os.path.join(tmp_path, "ckpt-4")]


def test_checkpoint_interval_follows_the_step_counter(tmp_path):
    step = counter()
    manager = CheckpointManager(
        Checkpoint(step=step), tmp_path, step_counter=step, checkpoint_interval=2
    )
    saved = []
    for s, check in [(0, True), (1, True), (2, True), (2, False), (3, False), (4, True)]:
        step.fill_(s)
        saved.append(manager.save(check_interval=check) is not None)
    assert saved == [True, False, True, False, True, False]
    assert manager.checkpoint_interval == 2


def test_restore_or_initialize_calls_init_fn_without_checkpoints(tmp_path):
    calls = []
    manager = CheckpointManager(
        Checkpoint(step=counter()), tmp_path / "none", init_fn=lambda: calls.append(1)
    )
    assert manager.restore_or_initialize() is None and calls == [1]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_to_keep": 0}, ValueError, "max_to_keep must be a positive int or None, got 0"),
        ({"checkpoint_interval": 5}, ValueError, "needs a step_counter"),
        ({"keep_checkpoint_every_n_hours": -1}, ValueError, "got -1"),
        ({"checkpoint_name": "a/b"}, ValueError, "'a/b'"),
        ({"step_counter": 3}, TypeError, "one-element tensor"),
    ],
)
def test_manager_arguments_are_validated(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        CheckpointManager(Checkpoint(step=counter()), tmp_path, **kwargs)
    with pytest.raises(TypeError, match=r"needs a stratagem\.train\.Checkpoint"):
        CheckpointManager(nn.Linear(1, 1), tmp_path)


# --- latest_checkpoint -------------------------------------------------------------------------


def test_latest_checkpoint_of_missing_or_empty_directories_is_none(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "workertemp_1").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    assert latest_checkpoint(tmp_path) is None


def test_latest_checkpoint_scans_by_save_time_and_ignores_temporaries(tmp_path):
    ckpt = Checkpoint(step=counter())
    ckpt.write(tmp_path / "z_first")  # name order would pick this one
    newest = ckpt.write(tmp_path / "ckpt_2")  # as a ModelCheckpoint callback might name it
    shutil.copytree(newest, tmp_path / ".ckpt_3.tmp-1-0123abcd")  # newer, but a temporary
    os.utime(tmp_path / ".ckpt_3.tmp-1-0123abcd")
    (tmp_path / "workertemp_1").mkdir()
    assert latest_checkpoint(tmp_path) == os.path.join(tmp_path, "ckpt_2")
    assert latest_checkpoint(str(tmp_path)) == os.path.join(str(tmp_path), "ckpt_2")


def test_latest_checkpoint_prefers_the_index_and_falls_back_when_stale(tmp_path):
    ckpt = Checkpoint(step=counter())
    manager = CheckpointManager(ckpt, tmp_path, max_to_keep=None)
    manager.save()
    ckpt.write(tmp_path / "later_written")  # no index entry: the index still rules
    assert latest_checkpoint(tmp_path) == os.path.join(tmp_path, "ckpt-1")
    shutil.rmtree(tmp_path / "ckpt-1")  # the index's latest is gone: scan
    assert latest_checkpoint(tmp_path) == os.path.join(tmp_path, "later_written")
    # A TensorFlow text index (or any foreign file) is ignored rather than trusted.
    (tmp_path / "checkpoint").write_text('model_checkpoint_path: "ckpt-1"\n')
    assert latest_checkpoint(tmp_path) == os.path.join(tmp_path, "later_written")


def test_latest_checkpoint_with_a_custom_index_name(tmp_path):
    ckpt = Checkpoint(step=counter())
    a = ckpt.write(tmp_path / "a")
    ckpt.write(tmp_path / "b")
    sg_train.storage.write_index(str(tmp_path), [("a", 1.0)], "a", filename="state")
    assert latest_checkpoint(tmp_path, latest_filename="state") == a
    assert latest_checkpoint(tmp_path) == os.path.join(tmp_path, "b")


# --- chief-only writes -------------------------------------------------------------------------


def test_non_chief_save_and_write_return_paths_but_write_nothing(tmp_path, non_chief):
    ckpt = Checkpoint(step=counter())
    assert ckpt.save(tmp_path / "a" / "ckpt") == f"{tmp_path / 'a' / 'ckpt'}-1"
    assert ckpt.save(tmp_path / "a" / "ckpt") == f"{tmp_path / 'a' / 'ckpt'}-2"
    assert int(ckpt.save_counter) == 2
    assert ckpt.write(tmp_path / "b" / "x") == str(tmp_path / "b" / "x")
    assert entries(tmp_path) == ["a", "b"]
    assert entries(tmp_path / "a") == [] and entries(tmp_path / "b") == []


def test_non_chief_manager_tracks_numbers_without_writing(tmp_path, non_chief):
    ckpt = Checkpoint(step=counter())
    manager = CheckpointManager(ckpt, tmp_path / "m", max_to_keep=2)
    paths = [manager.save() for _ in range(3)]
    assert paths == [os.path.join(tmp_path, "m", f"ckpt-{n}") for n in (1, 2, 3)]
    assert entries(tmp_path / "m") == []
    assert manager.checkpoints == paths[1:] and manager.latest_checkpoint == paths[2]
    assert int(ckpt.save_counter) == 3


def test_non_chief_reads_the_chiefs_checkpoint_and_leaves_its_leftovers(tmp_path):
    epoch = counter(6)
    CheckpointManager(Checkpoint(epoch=epoch), tmp_path).save()
    (tmp_path / ".ckpt-9.tmp-999999-0123abcd").mkdir()
    with WorkerStrategy().scope():
        mine = counter()
        manager = CheckpointManager(Checkpoint(epoch=mine), tmp_path)
        assert manager.restore_or_initialize() == os.path.join(tmp_path, "ckpt-1")
        assert int(mine) == 6
        # Cleaning up is the chief's job; it may be writing that very directory now.
        assert ".ckpt-9.tmp-999999-0123abcd" in os.listdir(tmp_path)
        # Simple pattern: every worker saves into the same directory; only the chief writes.
        assert manager.save() == os.path.join(tmp_path, "ckpt-2")
        assert not os.path.exists(tmp_path / "ckpt-2")


# --- the seed tutorial's pattern, end to end ---------------------------------------------------


class SeedClusterSpec:
    def __init__(self, spec: dict) -> None:
        self._spec = spec

    def as_dict(self) -> dict:
        return self._spec


def _is_chief(task_type, task_id, cluster_spec):
    return (
        task_type is None
        or task_type == "chief"
        or (task_type == "worker" and task_id == 0 and "chief" not in cluster_spec.as_dict())
    )


def _get_temp_dir(dirpath, task_id):
    temp_dir = os.path.join(dirpath, "workertemp_" + str(task_id))
    os.makedirs(temp_dir, exist_ok=True)
    return temp_dir


def write_filepath(filepath, task_type, task_id, cluster_spec):
    dirpath = os.path.dirname(filepath)
    base = os.path.basename(filepath)
    if not _is_chief(task_type, task_id, cluster_spec):
        dirpath = _get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)


def seed_worker(root, task_id: int, num_epochs: int, steps_per_epoch: int = 3) -> list[int]:
    """The tutorial's checkpointing code with ``tf.`` → ``sg.``; returns the epochs it ran."""
    cluster_spec = SeedClusterSpec({"worker": ["localhost:1", "localhost:2"]})
    task_type = "worker"
    checkpoint_dir = os.path.join(root, "ckpt")
    model, _ = build(0)
    epoch = counter()
    step_in_epoch = counter()
    checkpoint = sg_train.Checkpoint(model=model, epoch=epoch, step_in_epoch=step_in_epoch)
    write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id, cluster_spec)
    checkpoint_manager = sg_train.CheckpointManager(
        checkpoint, directory=write_checkpoint_dir, max_to_keep=1
    )
    latest = sg_train.latest_checkpoint(checkpoint_dir)
    if latest:
        checkpoint.restore(latest)
    ran = []
    while epoch.item() < num_epochs:
        while step_in_epoch.item() < steps_per_epoch:
            step_in_epoch.add_(1)
        ran.append(int(epoch))
        checkpoint_manager.save()
        if not _is_chief(task_type, task_id, cluster_spec):
            shutil.rmtree(write_checkpoint_dir)
        epoch.add_(1)
        step_in_epoch.fill_(0)
    return ran


def test_seed_pattern_chief_writes_the_real_directory_workers_clean_temp_dirs(tmp_path):
    assert seed_worker(tmp_path, task_id=0, num_epochs=2) == [0, 1]
    with WorkerStrategy().scope():
        # The worker restores the chief's checkpoint (shared storage) and resumes from it.
        assert seed_worker(tmp_path, task_id=1, num_epochs=3) == [1, 2]
    assert entries(tmp_path) == ["ckpt", "workertemp_1"]
    assert entries(tmp_path / "workertemp_1") == []  # the worker's rmtree found its directory
    assert entries(tmp_path / "ckpt") == ["checkpoint", "ckpt-2"]  # max_to_keep=1

    # A restarted chief resumes from the last checkpoint: the tutorial saves at the end of an
    # epoch before incrementing `epoch`, so the saved epoch is re-entered with its steps done.
    assert seed_worker(tmp_path, task_id=0, num_epochs=4) == [1, 2, 3]
    assert entries(tmp_path / "ckpt") == ["checkpoint", "ckpt-5"]
    final, steps = counter(), counter()
    status = Checkpoint(epoch=final, step_in_epoch=steps).restore(
        latest_checkpoint(tmp_path / "ckpt")
    )
    status.expect_partial()
    assert (int(final), int(steps)) == (3, 3)


def test_seed_pattern_on_a_worker_alone_writes_nothing_anywhere(tmp_path, non_chief):
    assert seed_worker(tmp_path, task_id=1, num_epochs=2) == [0, 1]
    assert entries(tmp_path) == ["workertemp_1"]
    assert entries(tmp_path / "workertemp_1") == []
