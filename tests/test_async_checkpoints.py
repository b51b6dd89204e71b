"""Asynchronous saves (TF's ``CheckpointOptions(enable_async=True)``): the values of the moment
of the save are written while training goes on, ``sync()`` waits, a restore waits for the
saves under way, a failed write is reported by name, and the manager's index and ``max_to_keep``
follow the writes."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import stratagem as sg
from stratagem.train import checkpoint as checkpoint_module

ASYNC = sg.train.CheckpointOptions(enable_async=True)


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    return model, optimizer


def _step(model, optimizer):
    optimizer.zero_grad()
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()


def test_an_async_save_writes_the_values_of_the_moment_it_was_called(tmp_path, monkeypatch):
    # The write starts only once training has gone on: what it writes must be the copy.
    trained_on = threading.Event()
    write = checkpoint_module.write_atomically

    def write_after_training(*args, **kwargs):
        assert trained_on.wait(60), "the test never released the write"
        write(*args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "write_atomically", write_after_training)
    model, optimizer = _model_and_optimizer()
    checkpoint = sg.train.Checkpoint(model=model, optimizer=optimizer)
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    moment = {k: v.clone() for k, v in optimizer.state[model.weight].items()}
    path = checkpoint.save(tmp_path / "ckpt", options=ASYNC)
    for _ in range(3):  # training goes on before the write runs
        _step(model, optimizer)
    trained_on.set()
    checkpoint.sync()
    fresh, fresh_optimizer = _model_and_optimizer()
    _step(fresh, fresh_optimizer)
    sg.train.Checkpoint(model=fresh, optimizer=fresh_optimizer).restore(path).assert_consumed()
    for k, v in at_save.items():
        assert torch.equal(fresh.state_dict()[k], v), k
    for k, v in moment.items():
        assert torch.equal(fresh_optimizer.state[fresh.weight][k], v), k
    assert sg.train.latest_checkpoint(tmp_path) == path


def test_a_restore_waits_for_the_save_under_way(tmp_path):
    model, optimizer = _model_and_optimizer()
    checkpoint = sg.train.Checkpoint(model=model, optimizer=optimizer)
    path = checkpoint.write(tmp_path / "ckpt", options=ASYNC)
    saved = model.weight.detach().clone()
    _step(model, optimizer)
    checkpoint.restore(path).assert_consumed()  # no sync(): the restore waits itself
    assert torch.equal(model.weight, saved)


def test_a_failed_async_write_is_raised_by_the_next_sync_naming_the_path(tmp_path):
    blocker = tmp_path / "not-a-checkpoint"
    blocker.mkdir()
    (blocker / "precious.txt").write_text("keep me")
    checkpoint = sg.train.Checkpoint(step=torch.tensor(3))
    checkpoint.write(blocker, options=ASYNC)
    with pytest.raises(sg.train.CheckpointError, match=r"asynchronous save of .*not-a-checkpoint"):
        checkpoint.sync()
    assert (blocker / "precious.txt").read_text() == "keep me"
    checkpoint.sync()  # reported once


def test_the_manager_keeps_max_to_keep_and_its_index_after_async_saves(tmp_path):
    model, optimizer = _model_and_optimizer()
    step = torch.tensor(0)
    manager = sg.train.CheckpointManager(
        sg.train.Checkpoint(model=model, optimizer=optimizer, step=step), tmp_path, max_to_keep=2
    )
    paths = []
    for _ in range(4):
        _step(model, optimizer)
        step += 1
        paths.append(manager.save(options=ASYNC))
    assert manager.latest_checkpoint == paths[-1]  # known at once
    manager.sync()
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["checkpoint", *(os.path.basename(p) for p in paths[-2:])]
    )
    assert sg.train.latest_checkpoint(tmp_path) == paths[-1]
    restored_step = torch.tensor(0)
    fresh, fresh_optimizer = _model_and_optimizer()
    sg.train.Checkpoint(model=fresh, optimizer=fresh_optimizer, step=restored_step).restore(
        paths[-1]
    ).assert_consumed()
    assert int(restored_step) == 4
    assert torch.equal(fresh.weight, model.weight)


def test_options_must_be_checkpoint_options(tmp_path):
    with pytest.raises(TypeError, match=r"sg\.train\.CheckpointOptions, got dict"):
        sg.train.Checkpoint(step=torch.tensor(0)).save(tmp_path / "c", options={"async": True})
