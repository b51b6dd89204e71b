"""sg.keras.callbacks.BackupAndRestore: an interrupted fit resumes and ends as an uninterrupted
one, from a backup per epoch or every N batches (mid-epoch); bad save_freq values. A killed and
restarted 2-worker fit is in tests/test_examples.py."""

from __future__ import annotations

import pytest
import torch

import stratagem as sg
from keras_utils import compiled as _compiled
from keras_utils import reference as _reference
from workers.common import build_model, keras_data


class _Crash(sg.keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise KeyboardInterrupt("simulated interruption")


def test_backup_and_restore_resumes_an_interrupted_fit_exactly(tmp_path):
    x, y = keras_data(48)
    torch.manual_seed(11)
    initial = build_model().state_dict()
    reference, _ = _reference(initial, x, y, epochs=4)
    backup = str(tmp_path / "backup")

    module = build_model()
    module.load_state_dict(initial)
    interrupted = _compiled(module)
    with pytest.raises(KeyboardInterrupt):
        interrupted.fit(
            x, y, batch_size=24, epochs=4, shuffle=False, verbose=0,
            callbacks=[_Crash(), sg.keras.callbacks.BackupAndRestore(backup)],
        )  # fmt: skip
    assert sg.train.latest_checkpoint(backup) is not None
    # A new run (another initialisation, as a restarted script would have) resumes at epoch 2.
    torch.manual_seed(12)
    resumed = _compiled()
    history = resumed.fit(
        x, y, batch_size=24, epochs=4, shuffle=False, verbose=0,
        callbacks=[sg.keras.callbacks.BackupAndRestore(backup)],
    )  # fmt: skip
    assert history.epoch == [2, 3]
    # The optimizer's step count goes on from the backup's, as Keras's iterations variable
    # does (a learning-rate schedule and TensorBoard's steps read it).
    assert resumed.optimizer.iterations == reference.optimizer.iterations == 8
    for k, v in reference.module.state_dict().items():
        torch.testing.assert_close(resumed.module.state_dict()[k], v, rtol=1e-5, atol=1e-6)
    assert not (tmp_path / "backup").exists()  # deleted once fit finished


class _CrashAt(sg.keras.callbacks.Callback):
    def __init__(self, epoch: int, batch: int) -> None:
        super().__init__()
        self.at = (epoch, batch)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise KeyboardInterrupt("simulated interruption")


def _loader(x, y):
    """A user's DataLoader, in a fixed order, whose batches are the global batches."""
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


@pytest.mark.parametrize(
    "data, steps_per_epoch, crash_at",
    [
        ("arrays", None, (1, 2)),  # shuffled arrays, epochs of 4 batches (the last partial)
        ("arrays", 3, (2, 1)),  # epochs of 3 batches straddle passes of 4
        ("loader", None, (2, 3)),  # a DataLoader: the resumed pass skips what was done
    ],
)
def test_backup_and_restore_with_save_freq_resumes_mid_epoch_exactly(
    tmp_path, data, steps_per_epoch, crash_at
):
    x, y = keras_data(60)
    torch.manual_seed(5)
    initial = build_model().state_dict()

    def fit(callbacks, seed):
        module = build_model()
        module.load_state_dict(initial)
        model = _compiled(module)
        torch.manual_seed(seed)  # draws fit's shuffle seed
        inputs = dict(x=x, y=y, batch_size=16) if data == "arrays" else dict(x=_loader(x, y))
        history = model.fit(
            **inputs, epochs=4, steps_per_epoch=steps_per_epoch, verbose=0, callbacks=callbacks
        )
        return model, history

    reference, expected = fit([], seed=1)
    backup = str(tmp_path / "backup")
    with pytest.raises(KeyboardInterrupt):
        fit([_CrashAt(*crash_at), sg.keras.callbacks.BackupAndRestore(backup, save_freq=2)], 1)
    # A restarted script draws another shuffle seed; the backup's seed and position win.
    resumed, history = fit([sg.keras.callbacks.BackupAndRestore(backup, save_freq=2)], seed=2)
    assert history.epoch == list(range(crash_at[0], 4))
    assert resumed.optimizer.iterations == reference.optimizer.iterations
    for name, values in history.history.items():  # the resumed epoch's metrics too
        assert values == pytest.approx(expected.history[name][crash_at[0] :], rel=1e-5), name
    for k, v in reference.module.state_dict().items():
        torch.testing.assert_close(resumed.module.state_dict()[k], v, rtol=1e-5, atol=1e-6)
    assert not (tmp_path / "backup").exists()


@pytest.mark.parametrize(
    "save_freq, steps_per_epoch, crash_at",
    [
        (3, None, (2, 1)),  # due after batch 3 of 4: inside a step of 2, taken after batch 4
        ("epoch", 3, (3, 1)),  # epochs of 3 batches: the 2nd ends inside a step of 2
    ],
)
def test_a_backup_due_inside_an_accumulated_step_waits_for_its_end(
    tmp_path, save_freq, steps_per_epoch, crash_at
):
    x, y = keras_data(64)
    torch.manual_seed(6)
    initial = build_model().state_dict()

    def fit(callbacks):
        module = build_model()
        module.load_state_dict(initial)
        model = sg.keras.Model(module)
        model.compile(
            sg.keras.optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=2),
            sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        history = model.fit(
            x, y, batch_size=16, epochs=4, steps_per_epoch=steps_per_epoch, shuffle=False,
            verbose=0, callbacks=callbacks,
        )  # fmt: skip
        return model, history

    reference, _ = fit([])
    backup = str(tmp_path / "backup")
    with pytest.raises(KeyboardInterrupt):
        fit([_CrashAt(*crash_at), sg.keras.callbacks.BackupAndRestore(backup, save_freq)])
    resumed, _ = fit([sg.keras.callbacks.BackupAndRestore(backup, save_freq)])
    # Resumed at the end of an accumulated step: no micro-batch's gradient was lost.
    for k, v in reference.module.state_dict().items():
        torch.testing.assert_close(resumed.module.state_dict()[k], v, rtol=1e-5, atol=1e-6)


def test_backup_and_restore_rejects_a_save_freq_that_is_neither_epoch_nor_a_count():
    for bad in (0, -3, "batch", 2.5, True):
        with pytest.raises(ValueError, match=r"save_freq must be 'epoch' or a positive number"):
            sg.keras.callbacks.BackupAndRestore("unused", save_freq=bad)
