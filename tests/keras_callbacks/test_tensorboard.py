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


def test_histogram_freq_writes_weight_histograms_every_n_epochs(tmp_path):
    """Keras 3 TensorBoard._log_weights: at epochs where epoch % histogram_freq == 0, a
    `<weight>/histogram` summary per weight in the train writer, at step `epoch`
    (tensorboard_test.py test_TensorBoard_weight_histograms)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    x, y = keras_data(48)
    model = _compiled()
    board = sg.keras.callbacks.TensorBoard(str(tmp_path / "logs"), histogram_freq=2)
    model.fit(x, y, batch_size=16, epochs=3, callbacks=[board], verbose=0)
    train = EventAccumulator(str(tmp_path / "logs" / "train"), size_guidance={"histograms": 0})
    train.Reload()
    names = {f"{n}/histogram" for n, _ in model.module.named_parameters()}
    assert set(train.Tags()["histograms"]) == names
    for tag in names:
        events = train.Histograms(tag)
        assert [e.step for e in events] == [0, 2]  # epochs 0 and 2 of 0..2
    last = train.Histograms("4.bias/histogram")[-1].histogram_value
    assert last.num == 3 and last.min == pytest.approx(float(model.module[4].bias.detach().min()))


def test_profile_batch_writes_a_torch_profiler_trace_in_the_log_dir(tmp_path):
    """Keras's profile_batch=(start, stop): global training batches start..stop (from 1) are
    profiled and the trace lands under <log_dir>/train/plugins/profile/<run>/."""
    import json

    x, y = keras_data(48)
    board = sg.keras.callbacks.TensorBoard(str(tmp_path / "logs"), profile_batch=(2, 3))
    _compiled().fit(x, y, batch_size=16, epochs=2, callbacks=[board], verbose=0)
    (run,) = (tmp_path / "logs" / "train" / "plugins" / "profile").iterdir()
    (trace,) = run.glob("*.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("linear" in str(e.get("name", "")).lower() for e in events)


def test_profile_batch_values_are_checked_as_keras_does():
    """Keras's _init_profile_batch: a non-negative int, a pair (start <= stop), or "a,b"."""
    for good in (0, 3, (1, 2), "2,4", [5, 5]):
        sg.keras.callbacks.TensorBoard(profile_batch=good)
    for bad in (-1, (3, 1), (1, 2, 3), "x", 1.5):
        with pytest.raises(ValueError, match="profile_batch must be a non-negative integer"):
            sg.keras.callbacks.TensorBoard(profile_batch=bad)
    with pytest.raises(NotImplementedError, match="embeddings_freq"):
        sg.keras.callbacks.TensorBoard(embeddings_freq=1)


def test_evaluate_writes_its_logs_against_the_optimizers_iterations(tmp_path):
    """tensorboard.py on_test_end: evaluation_<name>_vs_iterations under validation/, at the
    optimizer's iterations, for fit's validation and for evaluate alike."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    x, y = keras_data(48)
    board = sg.keras.callbacks.TensorBoard(str(tmp_path / "logs"))
    model = _compiled()
    model.fit(x, y, batch_size=16, epochs=2, validation_data=(x, y), callbacks=[board], verbose=0)
    loss, accuracy = model.evaluate(x, y, batch_size=16, callbacks=[board], verbose=0)
    validation = EventAccumulator(str(tmp_path / "logs" / "validation"))
    validation.Reload()
    events = validation.Scalars("evaluation_loss_vs_iterations")
    assert [e.step for e in events] == [3, 6, 6]  # after each epoch's 3 steps, then evaluate
    assert events[-1].value == pytest.approx(loss, rel=1e-6)
    last = validation.Scalars("evaluation_accuracy_vs_iterations")[-1]
    assert last.value == pytest.approx(accuracy, rel=1e-6)
