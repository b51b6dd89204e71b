"""``sg.keras.utils.SidecarEvaluator`` and ``sg.train.checkpoints_iterator``.

Single-process tests publish checkpoints themselves (from a callback of the evaluator, where a
test needs them to appear while it runs: no timing is involved); one real job
(``stratagem run -n 2 --evaluator``) shows an evaluator task following a MultiWorkerMirrored
training's checkpoints to the end.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

import stratagem as sg
from cluster_utils import WORKERS, Process, child_env

TRAIN, TEST = 192, 96  # digits examples: small, and several batches of 32
BATCH = 32


@pytest.fixture(scope="module")
def digits():
    (x, y), (x_test, y_test) = sg.data.datasets.load_digits(image_size=8)

    def prepare(a):
        return torch.from_numpy(a).reshape(len(a), -1).float() / 255

    return (prepare(x[:TRAIN]), torch.from_numpy(y[:TRAIN])), (
        prepare(x_test[:TEST]),
        torch.from_numpy(y_test[:TEST]),
    )


def make_model(hidden: int = 16, seed: int = 0) -> sg.keras.Model:
    torch.manual_seed(seed)
    module = torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10)
    )
    model = sg.keras.Model(module)
    model.compile(
        sg.keras.optimizers.Adam(0.01),
        sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        ["accuracy"],
    )
    return model


def evaluate_checkpoint(path: str, test) -> dict[str, float]:
    """What a checkpoint scores, evaluated here from scratch."""
    model = make_model(seed=99)
    model.load_weights(path)
    return model.evaluate(*test, batch_size=BATCH, verbose=0, return_dict=True)


@pytest.fixture(scope="module")
def staged(digits, tmp_path_factory) -> Path:
    """Three checkpoints of a custom loop's CheckpointManager (ckpt-1..3, one per epoch of 6
    Adam steps), staged in a directory of their own for tests to publish."""
    train, _ = digits
    root = tmp_path_factory.mktemp("staged")
    model = make_model()
    manager = sg.train.CheckpointManager(sg.train.Checkpoint(model=model), root, max_to_keep=None)
    for _ in range(3):
        model.fit(*train, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        manager.save()
    return root


def publish(staged: Path, directory: Path, number: int) -> str:
    """Copy staged ckpt-<number> in as the training would: built aside, renamed in whole."""
    directory.mkdir(exist_ok=True)
    aside = directory / f".ckpt-{number}.tmp-1-0000abcd"
    shutil.copytree(staged / f"ckpt-{number}", aside)
    os.rename(aside, directory / f"ckpt-{number}")
    return str(directory / f"ckpt-{number}")


class Recorder(sg.keras.callbacks.Callback):
    """Records the test hooks (and the step the evaluator set); publishes the next staged
    checkpoint at each on_test_end, as a training running beside the evaluator would."""

    def __init__(self, publish_next=None) -> None:
        super().__init__()
        self.events: list[str] = []
        self.ends: list[dict[str, float]] = []
        self.publish_next = publish_next

    def on_test_begin(self, logs=None):
        self.events.append(f"begin@{self.model.optimizer.iterations}")

    def on_test_batch_begin(self, batch, logs=None):
        self.events.append(f"batch{batch}")

    def on_test_end(self, logs=None):
        self.events.append("end")
        self.ends.append(dict(logs))
        if self.publish_next is not None:
            self.publish_next()


def test_evaluates_each_new_checkpoint_once_in_order_and_stops_at_the_last(
    digits, staged, tmp_path, capsys
):
    _, test = digits
    directory = tmp_path / "ckpts"
    publish(staged, directory, 1)
    pending = [2, 3]
    recorder = Recorder(lambda: publish(staged, directory, pending.pop(0)) if pending else None)
    # data: an (x, y) pair of arrays, as model.evaluate takes it. Were the evaluator to wait
    # on after ckpt-3 (the last, by max_evaluations), its timeout would fail the test.
    export = sg.keras.callbacks.SidecarEvaluatorModelExport(
        export_filepath=str(tmp_path / "best" / "best-{epoch:02d}"),
        checkpoint_filepath=str(directory / "ckpt-{epoch}"),
        monitor="loss",
        mode="min",
        save_weights_only=True,
    )
    evaluator = sg.keras.utils.SidecarEvaluator(
        make_model(seed=7),
        test,
        directory,
        max_evaluations=3,
        callbacks=[recorder, export],
        timeout=60,
    )
    evaluator.start()

    assert [e.number for e in evaluator.evaluations] == [1, 2, 3]
    assert [e.step for e in evaluator.evaluations] == [6, 12, 18]  # Adam's step count
    # The callbacks saw each evaluation whole, with the checkpoint's step set (TF:
    # optimizer.iterations), and the same metrics the evaluator recorded.
    batches = [f"batch{i}" for i in range(TEST // BATCH)]
    assert recorder.events == [
        x for step in (6, 12, 18) for x in [f"begin@{step}", *batches, "end"]
    ]
    assert recorder.ends == [e.logs for e in evaluator.evaluations]
    for e in evaluator.evaluations:
        assert e.logs == pytest.approx(evaluate_checkpoint(e.path, test), abs=1e-6)
    assert len({e.logs["loss"] for e in evaluator.evaluations}) == 3  # they did differ
    # SidecarEvaluatorModelExport kept each evaluation that lowered the loss, under its epoch.
    best, improved = float("inf"), []
    for e in evaluator.evaluations:
        if e.logs["loss"] < best:
            best = e.logs["loss"]
            improved.append(e)
    assert sorted(os.listdir(tmp_path / "best")) == sorted(
        ["checkpoint"] + [f"best-{e.number:02d}" for e in improved]
    )
    kept = evaluate_checkpoint(str(tmp_path / "best" / f"best-{improved[-1].number:02d}"), test)
    assert kept == pytest.approx(improved[-1].logs, abs=1e-6)
    out = capsys.readouterr().out
    assert "ckpt-3 step 18: loss: " in out and "last checkpoint evaluated; stopping" in out


def test_takes_the_latest_checkpoint_and_max_evaluations_is_a_checkpoint_number(
    digits, staged, tmp_path
):
    # TF's rule: the evaluator skips to the latest checkpoint, and max_evaluations=n stops it
    # after a checkpoint numbered n or more, however few it evaluated.
    _, test = digits
    for number in (1, 2, 3):
        publish(staged, tmp_path / "ckpts", number)
    evaluator = sg.keras.utils.SidecarEvaluator(
        make_model(seed=3), test, tmp_path / "ckpts", steps=1, max_evaluations=2, timeout=60
    )
    evaluator.start()
    assert [(e.number, e.step) for e in evaluator.evaluations] == [(3, 18)]
    # steps=1: one batch of the test data.
    model = make_model(seed=3)
    model.load_weights(str(tmp_path / "ckpts" / "ckpt-3"))
    first = model.evaluate(test[0][:BATCH], test[1][:BATCH], batch_size=BATCH, verbose=0)
    assert evaluator.evaluations[0].logs["loss"] == pytest.approx(first[0], abs=1e-6)


def test_timeout_stops_or_names_the_missing_last_checkpoint(digits, staged, tmp_path, capsys):
    _, test = digits
    publish(staged, tmp_path / "ckpts", 1)
    directory = str(tmp_path / "ckpts")

    endless = sg.keras.utils.SidecarEvaluator(make_model(), test, directory, timeout=0.3)
    endless.poll_secs = 0.05
    endless.start()  # no max_evaluations: the timeout ends it
    assert [e.number for e in endless.evaluations] == [1]
    out = capsys.readouterr().out
    assert f"waiting for a new checkpoint in {directory} (0s)" in out
    assert f"no new checkpoint in {directory} for 0.3s (last evaluated: {directory}" in out

    bounded = sg.keras.utils.SidecarEvaluator(
        make_model(), test, directory, max_evaluations=5, timeout=0.2
    )
    bounded.poll_secs = 0.05
    with pytest.raises(TimeoutError, match=r"the last one \(numbered 5, max_evaluations\) never"):
        bounded.start()
    assert [e.number for e in bounded.evaluations] == [1]


def test_half_written_and_damaged_checkpoints_are_never_read(digits, staged, tmp_path, capsys):
    _, test = digits
    directory = tmp_path / "ckpts"
    publish(staged, directory, 1)
    # A save in progress: staged under its hidden name, its state.pt half written.
    partial = directory / ".ckpt-2.tmp-4242-0123abcd"
    shutil.copytree(staged / "ckpt-2", partial)
    data = (partial / "state.pt").read_bytes()
    (partial / "state.pt").write_bytes(data[: len(data) // 2])
    # A damaged save, newer than ckpt-1: its state.pt altered after it was written.
    damaged = Path(publish(staged, directory, 3))
    raw = bytearray((damaged / "state.pt").read_bytes())
    raw[-20] ^= 0xFF
    (damaged / "state.pt").write_bytes(bytes(raw))

    evaluator = sg.keras.utils.SidecarEvaluator(make_model(), test, directory, timeout=0.3)
    evaluator.poll_secs = 0.05
    evaluator.start()
    assert [e.number for e in evaluator.evaluations] == [1]
    assert evaluator.evaluations[0].logs == pytest.approx(
        evaluate_checkpoint(str(directory / "ckpt-1"), test), abs=1e-6
    )
    out = capsys.readouterr().out
    assert f"{str(damaged)!r} is damaged" in out
    assert out.count("is damaged") == 1  # reported once, not at every look
    assert ".ckpt-2.tmp" not in out


def test_a_checkpoint_deleted_before_it_is_read_is_skipped(
    digits, staged, tmp_path, capsys, monkeypatch
):
    # The training's max_to_keep=1 deletes ckpt-2 (saving ckpt-3) between the evaluator
    # finding it and reading it: skipped with a message, as TF retries on read errors.
    from stratagem.keras import sidecar_evaluator

    _, test = digits
    directory = tmp_path / "ckpts"
    publish(staged, directory, 2)
    real = sidecar_evaluator.read_checkpoint

    def read_after_the_training_moved_on(path):
        if path.endswith("ckpt-2"):
            publish(staged, directory, 3)
            shutil.rmtree(path)
        return real(path)

    monkeypatch.setattr(sidecar_evaluator, "read_checkpoint", read_after_the_training_moved_on)
    evaluator = sg.keras.utils.SidecarEvaluator(
        make_model(), test, directory, max_evaluations=3, timeout=60
    )
    evaluator.start()
    assert [e.number for e in evaluator.evaluations] == [3]
    out = capsys.readouterr().out
    assert f"cannot load the checkpoint at {directory / 'ckpt-2'} (no checkpoint at" in out


def test_checkpoints_of_another_model_or_without_one_are_named_errors(digits, staged, tmp_path):
    _, test = digits
    publish(staged, tmp_path / "ckpts", 1)
    wider = sg.keras.utils.SidecarEvaluator(make_model(hidden=32), test, tmp_path / "ckpts")
    with pytest.raises(sg.train.CheckpointError, match=r"cannot restore the model from .*ckpt-1"):
        wider.start()

    other = tmp_path / "other"
    sg.train.Checkpoint(net=make_model().module).write(str(other / "ckpt-1"))
    evaluator = sg.keras.utils.SidecarEvaluator(make_model(), test, other)
    with pytest.raises(
        sg.train.CheckpointError, match=r"holds \['net', 'save_counter'\], expected"
    ):
        evaluator.start()
    with pytest.raises(ValueError, match="max_evaluations must be a positive integer"):
        sg.keras.utils.SidecarEvaluator(make_model(), test, other, max_evaluations=0)
    with pytest.raises(TypeError, match=r"needs an sg\.keras\.Model"):
        # As TF, the evaluator takes what it is given and finds out when it starts.
        sg.keras.utils.SidecarEvaluator(torch.nn.Linear(2, 2), test, other).start()


def test_model_checkpoint_saves_are_followed_and_the_old_name_warns(digits, tmp_path):
    # Model.fit's way (TF's docstring): ModelCheckpoint(filepath=".../ckpt-{epoch}").
    train, test = digits
    trainer = make_model()
    save = sg.keras.callbacks.ModelCheckpoint(str(tmp_path / "ckpt-{epoch}"))
    trainer.fit(*train, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[save])
    expected = trainer.evaluate(*test, batch_size=BATCH, verbose=0, return_dict=True)
    with pytest.warns(DeprecationWarning, match="sg.keras.utils.SidecarEvaluator"):
        evaluator = sg.keras.experimental.SidecarEvaluator(
            make_model(seed=5), test, tmp_path, max_evaluations=2
        )
    evaluator.start()
    assert [(e.number, e.step) for e in evaluator.evaluations] == [(2, 12)]
    assert evaluator.evaluations[0].logs == pytest.approx(expected, abs=1e-6)


def test_evaluate_takes_steps_and_callbacks(digits):
    _, (x, y) = digits

    class BatchLogs(Recorder):
        def on_test_batch_end(self, batch, logs=None):
            self.events.append(f"batch{batch} {sorted(logs)}")
            self.last = dict(logs)

    model = make_model()
    recorder = BatchLogs()
    logs = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True, steps=2,
                          callbacks=[recorder])  # fmt: skip
    names = "['accuracy', 'loss']"
    assert recorder.events == ["begin@0", "batch0", f"batch0 {names}", "batch1",
                               f"batch1 {names}", "end"]  # fmt: skip
    assert recorder.ends == [logs] and recorder.last == logs  # running metrics, then final
    first_two = model.evaluate(x[: 2 * BATCH], y[: 2 * BATCH], batch_size=BATCH, verbose=0)
    assert logs["loss"] == pytest.approx(first_two[0], abs=1e-6)
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        model.evaluate(x, y, steps=0)


def test_checkpoints_iterator_follows_saves_by_time_not_name(tmp_path):
    directory = tmp_path / "ckpts"
    tensor = torch.zeros(())
    checkpoint = sg.train.Checkpoint(value=tensor)
    path = checkpoint.write(str(directory / "only"))
    found = sg.train.checkpoints_iterator(directory, timeout=0.2, poll_secs=0.02)
    assert next(found) == path
    tensor.fill_(1.0)
    checkpoint.write(path)  # saved again under the same name: new, so yielded again
    assert next(found) == path
    assert sg.train.wait_for_new_checkpoint(directory, path, 0.02, timeout=0.1) is None
    assert sg.train.wait_for_new_checkpoint(directory, None, 0.02, timeout=0.1) == path
    assert list(found) == []  # the timeout ends the iteration (no timeout_fn, as TF)
    with pytest.raises(ValueError, match="timeout must be >= 0"):
        next(sg.train.checkpoints_iterator(directory, timeout=-1))


def test_evaluator_task_follows_a_multi_worker_training(tmp_path):
    """``stratagem run -n 2 --evaluator``: the workers fit under MultiWorkerMirroredStrategy
    and the chief saves each epoch; the evaluator task (the default strategy) evaluates the
    checkpoints as they come, each once, in order, stops after the last one by itself, and
    reports the metrics this process finds for them."""
    argv = [sys.executable, "-m", "stratagem.cli", "run", "-n", "2", "--evaluator",
            "--grace-period", "60", str(WORKERS / "sidecar_job.py")]  # fmt: skip
    launcher = Process(argv, child_env(), tmp_path, "launcher", merge_output=True)
    result = launcher.wait(timeout=240)
    assert result.returncode == 0, result.stdout
    assert "[evaluator]" in result.stdout and "last checkpoint evaluated" in result.stdout

    report = json.loads((tmp_path / "evaluations.json").read_text())
    # The chief waited for each evaluation before training on (see the script): all three.
    assert [e["number"] for e in report["evaluations"]] == [1, 2, 3] == [1, 2, report["epochs"]]
    (_, _), test = _job_digits()
    for e in report["evaluations"]:
        assert e["step"] == e["number"] * report["steps_per_epoch"]
        assert e["replicas"] == 1  # the evaluator runs with no strategy of the training's
        here = evaluate_checkpoint(str(tmp_path / e["path"]), test)
        assert e["logs"] == pytest.approx(here, abs=1e-5)
    # The chief wrote every epoch's checkpoint; the evaluator read none half-written.
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["checkpoint", "ckpt-1", "ckpt-2", "ckpt-3"]
    assert len({e["logs"]["loss"] for e in report["evaluations"]}) == 3


def _job_digits():
    from workers.sidecar_job import digits as job_digits

    return job_digits()


def test_the_deprecated_experimental_name_only_warns_and_start_checks_what_it_was_given():
    """sidecar_evaluator_test.testExperimentalDeprecatedMessage: SidecarEvaluator(None, None,
    None) under its experimental name warns that the endpoint is deprecated, and nothing else
    until it starts; starting then names what is missing."""
    with pytest.warns(DeprecationWarning, match="`sg.keras.experimental.SidecarEvaluator`"):
        evaluator = sg.keras.experimental.SidecarEvaluator(None, None, None)
    with pytest.raises(TypeError, match=r"needs an sg\.keras\.Model"):
        evaluator.start()


def _summary_model(seed: int) -> sg.keras.Model:
    """TF's ``_test_model_builder``: ``Dense(10)`` on 32 features, SGD, ``loss="mse"``,
    categorical accuracy and mean squared error (TF's ``DictMetric`` is an mse too)."""
    torch.manual_seed(seed)
    model = sg.keras.Model(torch.nn.Linear(32, 10))
    model.compile(
        sg.keras.optimizers.SGD(),
        loss="mse",
        metrics=[sg.keras.metrics.CategoricalAccuracy(), sg.keras.metrics.MeanSquaredError()],
    )
    return model


@pytest.mark.parametrize("saver", ["ModelCheckpoint", "BackupAndRestore"])
def test_summaries_are_written_at_the_checkpoints_training_step(saver, tmp_path):
    """TF's ``testSidecarEvaluatorOutputsSummarySavedWithCallback`` (keras/distribute/
    sidecar_evaluator_test.py): one epoch of 1000 examples in batches of 32 saved by a callback
    (``ModelCheckpoint(save_weights_only=True)``, or a ``BackupAndRestore`` backup), evaluated
    once with a ``TensorBoard`` callback. The evaluator restores the weights and the step, 32
    (= ceil(1000 / 32)), and ``validation/`` holds ``evaluation_<name>_vs_iterations`` for the
    loss and each metric at that step, with the values the trained model itself evaluates to."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data = torch.rand(1000, 32, generator=torch.Generator().manual_seed(0))
    labels = torch.rand(1000, 10, generator=torch.Generator().manual_seed(1))
    checkpoint_dir, log_dir = tmp_path / "checkpoints", tmp_path / "summary"
    if saver == "ModelCheckpoint":
        save = sg.keras.callbacks.ModelCheckpoint(
            str(checkpoint_dir / "ckpt-{epoch}"), save_weights_only=True
        )
    else:
        save = sg.keras.callbacks.BackupAndRestore(str(checkpoint_dir), delete_checkpoint=False)
    model = _summary_model(seed=0)
    model.fit(data, labels, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[save])
    expected = model.evaluate(data, labels, batch_size=BATCH, verbose=0, return_dict=True)

    eval_model = _summary_model(seed=1)
    evaluator = sg.keras.utils.SidecarEvaluator(
        eval_model,
        data=(data, labels),
        checkpoint_dir=checkpoint_dir,
        max_evaluations=1,
        callbacks=[sg.keras.callbacks.TensorBoard(log_dir=str(log_dir))],
    )
    evaluator.start()
    for a, b in zip(model.module.parameters(), eval_model.module.parameters(), strict=True):
        assert torch.equal(a, b)
    assert evaluator.evaluations[0].step == eval_model.optimizer.iterations == 32

    events = EventAccumulator(str(log_dir / "validation"))
    events.Reload()
    written = {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}
    assert sorted(written) == [f"evaluation_{name}_vs_iterations" for name in sorted(expected)]
    for name, value in expected.items():
        (scalar,) = written[f"evaluation_{name}_vs_iterations"]
        assert scalar.step == 32
        assert scalar.value == pytest.approx(value, rel=1e-5)
