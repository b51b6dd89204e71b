"""sg.keras.callbacks.ProgbarLogger: Keras 3's progress lines (keras/src/utils/progbar.py)."""

from __future__ import annotations

import io
import re

import stratagem as sg
from keras_utils import compiled as _compiled
from workers.common import keras_data

_TIME = r"\d+(ms|us|s)/step"
_LOGS = r" - accuracy: \d\.\d{4} - loss: \d\.\d{4}"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_verbose_2_prints_one_line_per_epoch_as_keras_3():
    """Progbar(verbose=2): `3/3 - 0s - 12ms/step - accuracy: ... - loss: ...` at each epoch's
    end, after `Epoch i/n` (printed when there are several epochs); the logs sorted by name
    (Keras 3's CallbackList pythonify_logs)."""
    x, y = keras_data(48)
    stream = io.StringIO()
    bar = sg.keras.callbacks.ProgbarLogger(verbose=2, stream=stream)
    _compiled().fit(x, y, batch_size=16, epochs=2, callbacks=[bar], verbose=2)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "Epoch 1/2" and lines[2] == "Epoch 2/2", lines
    assert re.fullmatch(rf"3/3 - \d+s - {_TIME}{_LOGS}", lines[1]), lines
    assert len(lines) == 4


def test_verbose_1_to_a_file_prints_the_finished_bar_without_colours():
    """Progbar(verbose=1): `70/70 ━━━━━━━━━━━━━━━━━━━━ 2s 28ms/step - accuracy: ... - loss:
    ...`, a 20-character bar; one epoch prints no `Epoch 1/1` (Keras 3's ProgbarLogger)."""
    x, y = keras_data(48)
    stream = io.StringIO()
    bar = sg.keras.callbacks.ProgbarLogger(verbose=1, stream=stream)
    _compiled().fit(x, y, batch_size=16, epochs=1, callbacks=[bar], verbose=1)
    (line,) = stream.getvalue().splitlines()
    assert re.fullmatch(rf"3/3 ━{{20}} \d+s {_TIME}{_LOGS}", line), line


def test_verbose_1_in_a_terminal_redraws_the_bar_in_place_with_keras_colours():
    x, y = keras_data(48)
    stream = _Terminal()
    bar = sg.keras.callbacks.ProgbarLogger(verbose=1, stream=stream)
    _compiled().fit(x, y, batch_size=16, epochs=1, callbacks=[bar], verbose=1)
    out = stream.getvalue()
    draws = out.split("\r")[1:]
    assert len(draws) == 4 and out.endswith("\n"), repr(out)  # 3 batches and the final line
    plain = [re.sub(r"\x1b\[[0-9;]*m", "", d).rstrip() for d in draws]
    assert plain[0].startswith("1/3 " + "━" * 20)  # 6 of 20 in green, the rest grey
    assert "\x1b[1m1/3\x1b[0m \x1b[32m━━━━━━\x1b[0m\x1b[37m" + "━" * 14 in draws[0]
    assert re.fullmatch(rf"3/3 ━{{20}} \d+s {_TIME}{_LOGS}", plain[-1]), plain[-1]


def test_evaluate_prints_keras_s_bar(capsys):
    """Keras 3's evaluate with verbose="auto" (1) draws the progress bar over its batches: to a
    file or a pipe, the finished bar alone, as fit's."""
    x, y = keras_data(48)
    model = _compiled()
    model.evaluate(x, y, batch_size=16)
    (line,) = capsys.readouterr().out.splitlines()
    assert re.fullmatch(rf"3/3 ━{{20}} \d+s {_TIME}{_LOGS}", line), line
    model.evaluate(x, y, batch_size=16, verbose=2)
    (line,) = capsys.readouterr().out.splitlines()
    assert re.fullmatch(rf"3/3 - \d+s - {_TIME}{_LOGS}", line), line
    model.evaluate(x, y, batch_size=16, verbose=0)
    assert capsys.readouterr().out == ""


def test_evaluate_in_a_terminal_redraws_its_bar_and_fit_s_validation_draws_none():
    x, y = keras_data(48)
    model = _compiled()
    stream = _Terminal()
    model.evaluate(
        x, y, batch_size=16, callbacks=[sg.keras.callbacks.ProgbarLogger(verbose=1, stream=stream)]
    )
    draws = stream.getvalue().split("\r")[1:]
    plain = [re.sub(r"\x1b\[[0-9;]*m", "", d).rstrip() for d in draws]
    assert [p.split(" ")[0] for p in plain] == ["1/3", "2/3", "3/3", "3/3"], plain
    stream = _Terminal()
    bar = sg.keras.callbacks.ProgbarLogger(verbose=1, stream=stream)
    model.fit(x, y, batch_size=16, epochs=1, callbacks=[bar], validation_data=(x, y))
    draws = stream.getvalue().split("\r")[1:]
    assert len(draws) == 4, draws  # the training bar's 3 batches and its end; no validation bar


def test_a_line_about_the_job_goes_under_the_bar_drawn_in_place():
    """An elastic job's change of workers, said during an epoch (``CallbackList.note``): the
    bar drawn in place ends its line first, the note has a line of its own, and the bar is
    drawn again below it; without a bar nobody says it (the model prints it then)."""
    x, y = keras_data(48)
    stream = _Terminal()
    bar = sg.keras.callbacks.ProgbarLogger(verbose=1, stream=stream)
    said = "continued with 2 of 3 workers; worker 2 lost: killed by signal 9 (SIGKILL)"
    shown = []

    class Change(sg.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                shown.append(callbacks.note(said))

    callbacks = sg.keras.callbacks.CallbackList([bar, Change()], model=None, params={})
    _compiled().fit(x, y, batch_size=16, epochs=1, callbacks=[bar, Change()], verbose=1)
    plain = re.sub(r"\x1b\[[0-9;]*m", "", stream.getvalue())
    lines = plain.split("\n")
    assert shown == [True], shown
    assert lines[0].startswith("\r1/3 ") and lines[1] == said, lines  # the bar's line ended
    assert lines[2].startswith("\r2/3 "), lines  # drawn again below the note
    quiet = sg.keras.callbacks.CallbackList([Change()], model=None, params={})
    assert quiet.note(said) is False
