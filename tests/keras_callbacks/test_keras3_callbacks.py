"""Keras 3 callback behaviour, translated from keras-team/keras keras/src/callbacks/*_test.py;
each test names the Keras test or behaviour it checks."""

from __future__ import annotations

import warnings

import pytest
import torch

import stratagem as sg
from keras_utils import compiled as _compiled
from workers.common import keras_data

cb = sg.keras.callbacks


class _Feed(sg.keras.callbacks.Callback):
    """Replaces the epoch logs' monitored value by a scripted sequence, as Keras's tests call
    on_epoch_end with chosen logs."""

    def __init__(self, key, values):
        super().__init__()
        self.key, self.values = key, list(values)

    def on_epoch_end(self, epoch, logs=None):
        logs[self.key] = self.values[epoch]


def _fit(callbacks, epochs, model=None, **kwargs):
    x, y = keras_data(32)
    model = model or _compiled()
    history = model.fit(x, y, batch_size=16, epochs=epochs, verbose=0, callbacks=callbacks,
                        **kwargs)  # fmt: skip
    return model, history


def test_early_stopping_with_baseline():
    """early_stopping_test.py test_early_stopping_with_baseline: a model that never beats the
    baseline stops after `patience` epochs (the first epoch counts), with 0 after the second."""
    for patience, expected in ((0, 2), (5, 5)):
        stop = cb.EarlyStopping(monitor="v", baseline=0.1, patience=patience, mode="min")
        _, history = _fit([_Feed("v", [0.5] * 20), stop], epochs=20)
        assert len(history.epoch) == expected, patience


def test_early_stopping_with_start_from_epoch():
    """early_stopping_test.py test_early_stopping_with_start_from_epoch: no stop during the
    warm-up epochs; after it, patience counts as usual."""
    stop = cb.EarlyStopping(monitor="v", patience=1, start_from_epoch=3, mode="min")
    _, history = _fit([_Feed("v", [1.0] * 20), stop], epochs=20)
    # Epochs 0..2 warm up; epoch 3 sets the best; epoch 4 is the first without improvement.
    assert len(history.epoch) == 5 and stop.stopped_epoch == 4


def test_early_stopping_restores_best_weights_at_train_end_whoever_stopped():
    """early_stopping_test.py test_early_stopping_final_weights_when_restoring_model_weights /
    Keras 3's on_train_end: the best epoch's weights come back at the end of training even when
    the training ran out of epochs before patience stopped it."""
    snapshots = []

    class Snap(sg.keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            snapshots.append({k: v.clone() for k, v in self.model.module.state_dict().items()})

    values = [0.9, 0.2, 0.5, 0.6]  # best at epoch 1; patience 10 never stops
    stop = cb.EarlyStopping(monitor="v", patience=10, restore_best_weights=True, mode="min")
    model, history = _fit([_Feed("v", values), Snap(), stop], epochs=4)
    assert len(history.epoch) == 4 and stop.best_epoch == 1
    for k, v in model.module.state_dict().items():
        torch.testing.assert_close(v, snapshots[1][k], rtol=0, atol=0)


def test_missing_monitor_warns_and_training_goes_on(tmp_path):
    """early_stopping_test.py test_early_stopping_no_val / model_checkpoint: the default
    `val_loss` without validation data warns ("conditioned on metric `val_loss` which is not
    available") and fit completes."""
    with pytest.warns(UserWarning, match="`val_loss` which is not available"):
        _, history = _fit([cb.EarlyStopping(patience=0)], epochs=3)
    assert len(history.epoch) == 3
    with pytest.warns(UserWarning, match="Can save best model only with val_loss"):
        _fit([cb.ModelCheckpoint(str(tmp_path / "ckpt-{epoch}"), save_best_only=True)], epochs=1)
    # TF's tf.keras skips the save when the monitored value is missing (Keras 3 saves).
    assert not (tmp_path / "ckpt-1").exists()


def test_unknown_mode_warns_and_falls_back_to_auto():
    """monitor_callback.py: "mode 'x' is unknown, fallback to auto mode"."""
    with pytest.warns(UserWarning, match="EarlyStopping mode 'upwards' is unknown"):
        stop = cb.EarlyStopping(monitor="loss", mode="upwards")
    assert stop.mode == "auto"
    with pytest.warns(UserWarning, match="ModelCheckpoint mode 'x' is unknown"):
        cb.ModelCheckpoint("p", mode="x")


def test_auto_mode_reads_the_metric_direction():
    """monitor_callback_test.py: loss is minimised, accuracy maximised; a name with no
    direction asks for mode."""
    stop = cb.EarlyStopping(monitor="val_accuracy")
    stop.set_model(_compiled())
    assert stop._is_improvement(0.9, 0.8) and not stop._is_improvement(0.7, 0.8)
    odd = cb.EarlyStopping(monitor="something")
    odd.set_model(_compiled())
    with pytest.raises(ValueError, match="Pass `mode='max'`"):
        odd._is_improvement(1.0, 2.0)


def test_model_checkpoint_initial_value_threshold_and_batch_from_one(tmp_path):
    """model_checkpoint_test.py test_model_checkpoint_options (initial_value_threshold: no save
    until the monitored value beats it) and `{batch}` filled from 1."""
    path = str(tmp_path / "ck-{epoch}")
    save = cb.ModelCheckpoint(path, monitor="v", mode="min", save_best_only=True,
                              initial_value_threshold=0.3)  # fmt: skip
    _fit([_Feed("v", [0.5, 0.4, 0.2, 0.25]), save], epochs=4)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ck-")) == ["ck-3"]
    batches = cb.ModelCheckpoint(str(tmp_path / "b-{epoch}-{batch}"), save_freq=1)
    _fit([batches], epochs=1)
    assert {p.name for p in tmp_path.iterdir() if p.name.startswith("b-")} == {"b-1-1", "b-1-2"}


def test_on_batch_hooks_alias_the_train_batch_hooks():
    """callback.py: Callback.on_train_batch_begin/end call on_batch_begin/end (Keras 3)."""
    seen = []

    class Old(sg.keras.callbacks.Callback):
        def on_batch_begin(self, batch, logs=None):
            seen.append(("begin", batch))

        def on_batch_end(self, batch, logs=None):
            seen.append(("end", batch, "loss" in logs))

    _fit([Old()], epochs=1)
    assert seen == [("begin", 0), ("end", 0, True), ("begin", 1), ("end", 1, True)]


def test_steps_per_execution_calls_the_batch_hooks_every_n_batches():
    """trainer.py compile(steps_per_execution=N): on_batch_begin/end once per N batches, with
    the first and last batch index of the group (epoch_iterator's begin_step/end_step)."""
    seen = []

    class Hooks(sg.keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(("begin", batch))

        def on_train_batch_end(self, batch, logs=None):
            seen.append(("end", batch))

    x, y = keras_data(80)
    model = _compiled()
    model.compile(sg.keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy",
                  steps_per_execution=2)  # fmt: skip
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[Hooks()])
    assert seen == [("begin", 0), ("end", 1), ("begin", 2), ("end", 3), ("begin", 4), ("end", 4)]
    with pytest.raises(ValueError, match="steps_per_execution must be an integer >= 1"):
        model.compile("sgd", "mse", steps_per_execution=0)


def test_backup_and_restore_validates_its_arguments_as_keras():
    """backup_and_restore.py: an empty backup_dir raises ValueError("Empty `backup_dir`
    argument passed"); save_freq is 'epoch' or an integer."""
    for empty in (None, ""):
        with pytest.raises(ValueError, match="Empty `backup_dir` argument passed"):
            cb.BackupAndRestore(empty)
    with pytest.raises(ValueError, match="save_freq must be 'epoch'"):
        cb.BackupAndRestore("d", save_freq="batch")
    with pytest.raises(ValueError, match="preemption"):
        cb.BackupAndRestore("d", save_freq=False)


def test_backup_and_restore_double_checkpoint_falls_back_to_the_previous(tmp_path):
    """backup_and_restore_test.py test_backup_restore_on_train_end / double_checkpoint: when
    the latest backup cannot be read, the previous one is restored."""

    class Crash(sg.keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 3:
                raise KeyboardInterrupt

    backup = tmp_path / "backup"
    with pytest.raises(KeyboardInterrupt):
        _fit([Crash(), cb.BackupAndRestore(str(backup), double_checkpoint=True)], epochs=5)
    newest = sg.train.latest_checkpoint(str(backup))
    for f in (p for p in __import__("pathlib").Path(newest).rglob("*") if p.is_file()):
        f.write_bytes(b"damaged")
    _, history = _fit([cb.BackupAndRestore(str(backup), double_checkpoint=True)], epochs=5)
    assert history.epoch == [2, 3, 4]  # from the backup of epoch 1, the one before the newest


def test_terminate_on_nan_stops_at_the_first_nan_batch():
    """terminate_on_nan_test.py test_TerminateOnNaN: a NaN loss stops training gracefully
    (one epoch, on_train_end runs); raise_error=True raises RuntimeError instead."""
    x, y = keras_data(64)
    x[20] = float("nan")  # the second batch of 16
    ended = []

    class End(sg.keras.callbacks.Callback):
        def on_train_end(self, logs=None):
            ended.append(True)

    model = _compiled()
    history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                        callbacks=[cb.TerminateOnNaN(), End()])  # fmt: skip
    assert history.epoch == [0] and ended == [True]
    with pytest.raises(RuntimeError, match="NaN or Inf loss encountered at batch 1"):
        _compiled().fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
                        callbacks=[cb.TerminateOnNaN(raise_error=True)])  # fmt: skip


def test_reduce_lr_on_plateau():
    """reduce_lr_on_plateau_test.py test_reduces_lr_with_model_fit and
    test_throws_when_optimizer_has_schedule's factor check: a plateau longer than patience
    multiplies the rate by factor, not below min_lr, then waits cooldown epochs."""
    model = _compiled(lr=1.0)
    reduce = cb.ReduceLROnPlateau(monitor="v", factor=0.1, patience=1, cooldown=1, min_lr=0.005,
                                  mode="min")  # fmt: skip
    _, history = _fit([_Feed("v", [1.0] * 6), reduce], epochs=6, model=model)
    # The logs show the rate the epoch trained with. Epoch 0 sets the best; 1 reduces to 0.1
    # and starts a cooldown of 1, which epoch 2 spends before counting (Keras decrements the
    # cooldown first), so 2 reduces to 0.01; 3 to 0.001, below min_lr: 0.005; then no more.
    expected = [1.0, 1.0, 0.1, 0.01, 0.005, 0.005]
    assert history.history["learning_rate"] == pytest.approx(expected)
    assert model.optimizer.learning_rate == pytest.approx(0.005)
    with pytest.raises(ValueError, match=r"does not support a factor >= 1\.0"):
        cb.ReduceLROnPlateau(factor=1.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # val_loss missing: a warning, not an error
        with pytest.raises(UserWarning, match="Learning rate reduction is conditioned"):
            _fit([cb.ReduceLROnPlateau()], epochs=1)


def test_early_stopping_settles_monitor_op_first_and_an_unknown_monitor_raises_in_auto():
    """early_stopping.py on_epoch_end: _set_monitor_op() runs first, so in mode "auto" a monitor
    whose direction cannot be told raises even when the logs lack it; monitor_op is np.less for
    a loss, np.greater for a compiled accuracy, and a user's own monitor_op is kept."""
    import numpy as np

    stop = cb.EarlyStopping(monitor="val_loss")
    assert stop.monitor_op is None
    with pytest.warns(UserWarning, match="not available"):
        _fit([stop], epochs=1)
    assert stop.monitor_op is np.less
    accuracy = cb.EarlyStopping(monitor="accuracy")
    _fit([accuracy], epochs=1)
    assert accuracy.monitor_op is np.greater
    with pytest.raises(ValueError, match=r"monitor=unheard_of.*Pass `mode='max'`"):
        _fit([cb.EarlyStopping(monitor="unheard_of")], epochs=1)
    own = cb.EarlyStopping(monitor="loss", patience=0)
    own.monitor_op = np.greater  # the loss must rise to count as better: it falls, so it stops
    _, history = _fit([own], epochs=4)
    assert own.monitor_op is np.greater and len(history.epoch) == 2
