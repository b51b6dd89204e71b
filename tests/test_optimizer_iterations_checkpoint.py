"""``optimizer.iterations`` travels in checkpoints, as TF's: a Keras optimizer's ``iter``
variable is saved with its slots by ``tf.train.Checkpoint(model=model)`` (the model tracks its
optimizer), by ``Checkpoint(optimizer=model.optimizer)`` and by ``ModelCheckpoint``, and a
restore sets the count back (Keras: ``optimizer.iterations`` is a variable like the others)."""

from __future__ import annotations

import torch
from torch import nn

import stratagem as sg


def _trained(batches: int, **optimizer: object) -> sg.keras.Model:
    model = _fresh(**optimizer)
    x = torch.randn(8 * batches, 4, generator=torch.Generator().manual_seed(0))
    model.fit(x, x.sum(1, keepdim=True), batch_size=8, epochs=1, shuffle=False, verbose=0)
    return model


def _fresh(**optimizer: object) -> sg.keras.Model:
    torch.manual_seed(0)
    model = sg.keras.Model(nn.Linear(4, 1))
    model.compile(sg.keras.optimizers.SGD(0.01, **optimizer), "mse")
    return model


def test_checkpoint_of_a_keras_model_restores_optimizer_iterations(tmp_path):
    trained = _trained(3)
    assert trained.optimizer.iterations == 3
    path = sg.train.Checkpoint(model=trained).save(str(tmp_path / "ckpt"))
    restored = _fresh()
    assert restored.optimizer.iterations == 0
    sg.train.Checkpoint(model=restored).restore(path)
    assert restored.optimizer.iterations == 3


def test_checkpoint_of_the_optimizer_restores_its_iterations(tmp_path):
    """Also counted in optimizer steps under gradient accumulation (6 batches, k=2: 3)."""
    trained = _trained(6, gradient_accumulation_steps=2)
    assert trained.optimizer.iterations == 3
    path = sg.train.Checkpoint(optimizer=trained.optimizer).save(str(tmp_path / "ckpt"))
    restored = _fresh(gradient_accumulation_steps=2)
    sg.train.Checkpoint(optimizer=restored.optimizer).restore(path)
    assert restored.optimizer.iterations == 3
    assert not restored.optimizer.mid_accumulation


def test_model_checkpoint_saves_optimizer_iterations(tmp_path):
    model = _fresh()
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    save = sg.keras.callbacks.ModelCheckpoint(str(tmp_path / "ckpt-{epoch}"))
    model.fit(x, x.sum(1, keepdim=True), batch_size=8, epochs=2, callbacks=[save], verbose=0)
    assert model.optimizer.iterations == 8
    # At the top of the checkpoint, where a SidecarEvaluator reads the step (SGD keeps none).
    iterations = torch.tensor(0)
    restored = _fresh()
    latest = sg.train.latest_checkpoint(str(tmp_path))
    sg.train.Checkpoint(
        model=restored.module, optimizer=restored.optimizer.torch_optimizer, iterations=iterations
    ).restore(latest)
    assert int(iterations) == 8
    weights_only = sg.keras.callbacks.ModelCheckpoint(
        str(tmp_path / "w-{epoch}"), save_weights_only=True
    )
    model.fit(x, x.sum(1, keepdim=True), batch_size=8, callbacks=[weights_only], verbose=0)
    assert model.optimizer.iterations == 12


def test_a_checkpoint_without_iterations_restores_the_rest(tmp_path):
    """A checkpoint written before the count was saved (the torch optimizer alone) restores
    the optimizer's state and leaves the count as it is."""
    trained = _trained(3)
    old = sg.train.Checkpoint(model=trained.module, optimizer=trained.optimizer.torch_optimizer)
    path = old.save(str(tmp_path / "old"))
    restored = _fresh()
    status = sg.train.Checkpoint(model=restored.module, optimizer=restored.optimizer).restore(path)
    assert restored.optimizer.iterations == 0
    assert "optimizer.iterations" in status.unrestored
    status.expect_partial()
    for a, b in zip(restored.module.parameters(), trained.module.parameters(), strict=True):
        assert torch.equal(a, b)
