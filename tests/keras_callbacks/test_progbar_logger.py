"""sg.keras.callbacks.ProgbarLogger: Keras's progress lines."""

from __future__ import annotations

import io

import stratagem as sg
from keras_utils import compiled as _compiled
from workers.common import keras_data


def test_progress_output_one_line_per_epoch():
    x, y = keras_data(48)
    stream = io.StringIO()
    bar = sg.keras.callbacks.ProgbarLogger(verbose=2, stream=stream)
    _compiled().fit(x, y, batch_size=16, epochs=2, callbacks=[bar], verbose=2)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "Epoch 1/2" and lines[2] == "Epoch 2/2", lines
    assert "loss: " in lines[1] and "accuracy: " in lines[1], lines
