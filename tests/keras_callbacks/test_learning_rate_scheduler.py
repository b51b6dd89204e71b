"""sg.keras.callbacks.LearningRateScheduler, and EarlyStopping, which the same test covers:
the learning rate each epoch gets and logs, and the epoch a loss that never improves stops at."""

from __future__ import annotations

import pytest

import stratagem as sg
from keras_utils import compiled as _compiled
from workers.common import keras_data


def test_learning_rate_scheduler_and_early_stopping():
    x, y = keras_data(48)
    model = _compiled(lr=0.1)
    seen = []

    def schedule(epoch, lr):
        seen.append(lr)
        return 0.1 * 0.5**epoch

    history = model.fit(
        x, y, batch_size=16, epochs=3, verbose=0,
        callbacks=[sg.keras.callbacks.LearningRateScheduler(schedule)],
    )  # fmt: skip
    assert seen == pytest.approx([0.1, 0.1, 0.05])
    assert history.history["learning_rate"] == pytest.approx([0.1, 0.05, 0.025])

    frozen = _compiled(lr=0.0)  # the loss can never improve
    stopper = sg.keras.callbacks.EarlyStopping(monitor="loss", patience=1)
    # Unshuffled, so every epoch's mean loss is bit-identical (a reordered sum may not be).
    history = frozen.fit(
        x, y, batch_size=16, epochs=10, shuffle=False, verbose=0, callbacks=[stopper]
    )
    assert history.epoch == [0, 1] and stopper.stopped_epoch == 1
