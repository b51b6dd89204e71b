"""sg.keras.callbacks.TensorBoard: event files in Keras's layout that TensorBoard reads."""

from __future__ import annotations

import pytest

import stratagem as sg
from keras_utils import compiled as _compiled
from workers.common import keras_data


def test_tensorboard_writes_event_files_tensorboard_reads(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    x, y = keras_data(48)
    board = sg.keras.callbacks.TensorBoard(str(tmp_path / "logs"), update_freq="batch")
    history = _compiled().fit(
        x, y, batch_size=16, epochs=2, validation_data=(x, y), callbacks=[board], verbose=0
    )
    train = EventAccumulator(str(tmp_path / "logs" / "train"))
    validation = EventAccumulator(str(tmp_path / "logs" / "validation"))
    train.Reload()
    validation.Reload()
    tags = set(train.Tags()["scalars"])
    assert {"epoch_loss", "epoch_accuracy", "epoch_learning_rate", "batch_loss"} <= tags
    assert [e.step for e in train.Scalars("epoch_loss")] == [0, 1]
    for tag, key, events in [
        ("epoch_loss", "loss", train),
        ("epoch_accuracy", "accuracy", train),
        ("epoch_loss", "val_loss", validation),
    ]:
        values = [e.value for e in events.Scalars(tag)]
        assert values == pytest.approx(history.history[key], rel=1e-6), tag
    assert [e.step for e in train.Scalars("batch_loss")] == list(range(1, 7))  # 3 per epoch
