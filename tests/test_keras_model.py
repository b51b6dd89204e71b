"""sg.keras.Model: compile/fit/evaluate/predict, the callback hooks fit calls, errors; the same fit
under the default strategy, MirroredStrategy (2 replica threads) and MultiWorkerMirroredStrategy
(2 processes). Each callback's own tests are in keras_callbacks/."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import stratagem as sg
from cluster_utils import WORKERS, run_cluster
from keras_utils import compiled as _compiled
from keras_utils import reference as _reference
from workers.common import build_model, keras_data


def test_fit_learns_and_reports_history_evaluate_and_predict():
    torch.manual_seed(0)
    x, y = keras_data(300)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()  # learnable labels
    model = _compiled(lr=0.05)
    history = model.fit(x, y, batch_size=32, epochs=12, validation_data=(x, y), verbose=0)
    assert history.epoch == list(range(12))
    assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert history.history["accuracy"][-1] > 0.9
    loss, accuracy = model.evaluate(x, y, batch_size=50, verbose=0)
    assert loss == pytest.approx(history.history["val_loss"][-1], rel=1e-5)
    assert accuracy == pytest.approx(history.history["val_accuracy"][-1], rel=1e-6)
    # The accuracy is the plain fraction of correct arg-maxes.
    predictions = model.predict(x, batch_size=64)
    assert isinstance(predictions, np.ndarray) and predictions.shape == (300, 3)
    expected = (torch.from_numpy(predictions).argmax(1) == y).float().mean().item()
    assert accuracy == pytest.approx(expected, abs=1e-6)
    with torch.no_grad():
        np.testing.assert_allclose(predictions, model.module(x).numpy(), rtol=1e-5, atol=1e-6)


def test_names_resolve_like_keras_and_evaluate_without_metrics_is_a_scalar():
    model = sg.Model(build_model())
    model.compile("adam", "sparse_categorical_crossentropy")
    assert isinstance(model.optimizer.torch_optimizer, torch.optim.Adam)
    assert model.optimizer.learning_rate == pytest.approx(0.001)
    model.optimizer.learning_rate = 0.01
    assert all(g["lr"] == 0.01 for g in model.optimizer.param_groups)
    x, y = keras_data(40)
    # Without from_logits the loss takes probabilities, as in Keras.
    module = torch.nn.Sequential(build_model(), torch.nn.Softmax(dim=-1))
    probs = sg.keras.Model(module)
    probs.compile("sgd", "sparse_categorical_crossentropy", ["accuracy"])
    # "accuracy" is chosen from the shapes (Keras): integer labels against class scores.
    _, accuracy = probs.evaluate(x, y, verbose=0)
    expected = (probs.module(x).argmax(-1) == y).float().mean()
    assert accuracy == pytest.approx(float(expected))
    value = model.evaluate(x, y, verbose=0)
    assert isinstance(value, float)


def test_a_torch_optimizer_and_the_dataset_inputs_work():
    x, y = keras_data(48)
    module = build_model()
    model = sg.keras.Model(module)
    model.compile(
        torch.optim.SGD(module.parameters(), lr=0.1),
        sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        ["accuracy"],
    )
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    assert model.fit(loader, epochs=1, verbose=0).history["loss"]
    dataset = sg.data.Dataset.from_tensor_slices((x, y)).batch(16)
    assert len(model.fit(dataset, epochs=2, verbose=0).history["loss"]) == 2
    batches = [(x[:24], y[:24]), (x[24:], y[24:])]
    assert len(model.evaluate(batches, verbose=0)) == 2
    # Arrays with a batch_size for training, a dataset of batches for validation.
    history = model.fit(x, y, batch_size=16, validation_data=batches, verbose=0)
    assert "val_loss" in history.history


class _Recorder(sg.keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.calls = []

    def on_train_begin(self, logs=None):
        self.calls.append("train_begin")

    def on_epoch_begin(self, epoch, logs=None):
        self.calls.append(f"epoch_begin {epoch}")

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(f"batch_end {batch} {sorted(logs)}")

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append(f"epoch_end {epoch} {sorted(logs)}")

    def on_train_end(self, logs=None):
        self.calls.append("train_end")


def test_callback_hooks_run_in_keras_order_and_steps_per_epoch_continues_the_data():
    x, y = keras_data(48)
    recorder = _Recorder()
    _compiled().fit(
        x, y, batch_size=16, epochs=3, initial_epoch=1, steps_per_epoch=2,
        callbacks=[recorder], verbose=0,
    )  # fmt: skip
    names = "['accuracy', 'loss']"
    assert recorder.calls == [
        "train_begin",
        "epoch_begin 1",
        f"batch_end 0 {names}",
        f"batch_end 1 {names}",
        f"epoch_end 1 {names}",
        "epoch_begin 2",
        f"batch_end 0 {names}",  # the third batch of the first pass
        f"batch_end 1 {names}",  # the first batch of the next pass
        f"epoch_end 2 {names}",
        "train_end",
    ]


def _sparse(model):
    model.compile("sgd", sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m, x, y: m.compile("adamax9", "mse"), "unknown optimizer 'adamax9'"),
        (lambda m, x, y: m.compile("sgd", "hinge_loss"), "unknown loss 'hinge_loss'"),
        (lambda m, x, y: m.compile("sgd", "mse", ["f7"]), "unknown metric 'f7'"),
        (lambda m, x, y: m.fit(x, y, verbose=0), "call model.compile"),
        (lambda m, x, y: (m.compile("sgd", "mse"), m.fit(x, y[:5], verbose=0)), "100 and 5"),
        (lambda m, x, y: (m.compile("sgd", "mse"), m.fit(x, y, epochs=-1)), "got -1"),
        (
            lambda m, x, y: (m.compile("sgd", "mse"), m.fit([(x, y)], y, verbose=0)),
            "y must be None",
        ),
        (
            lambda m, x, y: (m.compile("sgd", "mse"), m.fit([(x, y)], batch_size=4, verbose=0)),
            "already batched",
        ),
        (lambda m, x, y: (m.compile("sgd", "mse"), m.fit(x, y, verbose=7)), "got 7"),
        (lambda m, x, y: (m.compile("sgd", "mse"), m.fit(x, verbose=0)), "needs targets"),
        (
            lambda m, x, y: (_sparse(m), m.fit(x, torch.nn.functional.one_hot(y), verbose=0)),
            r"one integer label per example \(shape \[32\]\); got labels of shape \[32, 3\]",
        ),
        (lambda m, x, y: (_sparse(m), m.fit(x, y + 0.5, verbose=0)), "integer class labels"),
        (lambda m, x, y: (_sparse(m), m.fit(x, y + 3, verbose=0)), r"classes 0\.\.2"),
        (
            lambda m, x, y: (_sparse(m), m.fit(x, y, validation_data=(x[:, :4], y), verbose=0)),
            r"validation_data examples have shape \[4\], the training examples \[5\]",
        ),
    ],
)
def test_bad_arguments_are_clear_errors(call, message):
    x, y = keras_data(100)
    with pytest.raises((ValueError, RuntimeError, TypeError), match=message):
        call(sg.keras.Model(build_model()), x, y)


def _assert_same_training(got: dict, reference_model, reference_history, x, y) -> None:
    for k, v in reference_model.module.state_dict().items():
        torch.testing.assert_close(got["final"][k], v, rtol=1e-4, atol=1e-5, msg=k)
    for name, values in reference_history.history.items():
        assert got["history"][name] == pytest.approx(values, rel=1e-4, abs=1e-5), name
    expected = reference_model.evaluate(x, y, batch_size=24, verbose=0)
    assert got["evaluate"] == pytest.approx(expected, rel=1e-4, abs=1e-5)
    predicted = torch.from_numpy(reference_model.predict(x, batch_size=24))
    torch.testing.assert_close(got["predict"], predicted, rtol=1e-4, atol=1e-5)


def test_mirrored_fit_equals_one_device_on_the_global_batch():
    x, y = keras_data()
    torch.manual_seed(3)
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = _compiled()
    initial = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    history = model.fit(x, y, batch_size=24, epochs=2, shuffle=False, verbose=0)
    got = {
        "final": {k: v.detach().clone() for k, v in model.module.state_dict().items()},
        "history": history.history,
        "evaluate": model.evaluate(x, y, batch_size=24, verbose=0),
        "predict": torch.from_numpy(model.predict(x, batch_size=24)),
    }
    reference_model, reference_history = _reference(initial, x, y)
    _assert_same_training(got, reference_model, reference_history, x, y)


@pytest.mark.parametrize(
    "strategy",
    [
        lambda: sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"]),
        lambda: sg.distribute.experimental.CentralStorageStrategy(["cpu:0", "cpu:1"]),
    ],
    ids=["mirrored", "central_storage"],
)
def test_compile_refuses_a_module_built_outside_a_multi_replica_scope(strategy):
    """tf.keras's ``Model.compile`` rule (training.py: every variable created in the strategy's
    scope), with its words: a module built outside is one copy that every replica's thread
    would train at once, a race that trained silently wrong (or failed in backward)."""
    strategy = strategy()
    outside = build_model()
    with strategy.scope():
        model = sg.keras.Model(outside)
        with pytest.raises(ValueError) as refused:
            model.compile("sgd", "sparse_categorical_crossentropy")
        inside = sg.keras.Model(build_model())
        inside.compile("sgd", "sparse_categorical_crossentropy")  # built in the scope: fine
    assert str(refused.value).startswith(
        "Variable (0.weight) was not created in the distribution strategy scope of ("
    ), refused.value
    assert "with strategy.scope():\n  model=_create_model()\n  model.compile(...)" in str(
        refused.value
    )


@pytest.mark.multiprocess
def test_multi_worker_fit_equals_one_device_on_the_global_batch(tmp_path):
    results = run_cluster(
        WORKERS / "keras_fit.py",
        2,
        tmp_path,
        per_worker_env=[{"SEED": "7"}, {"SEED": "8"}],
        timeout=240,
    )
    for i, r in enumerate(results):
        r.check(f"worker {i}")
    outs = [torch.load(tmp_path / f"keras-{i}.pt") for i in range(2)]
    assert [o["num_replicas"] for o in outs] == [2, 2]
    # Differently seeded workers start from the chief's values, and report global metrics.
    for k in outs[0]["initial"]:
        torch.testing.assert_close(outs[1]["initial"][k], outs[0]["initial"][k], rtol=0, atol=0)
    assert outs[0]["history"] == outs[1]["history"]
    x, y = keras_data()
    reference_model, reference_history = _reference(outs[0]["initial"], x, y)
    for out in outs:
        _assert_same_training(out, reference_model, reference_history, x, y)
    # Files were written by the chief alone: one CSV with one row per epoch, one set of saves.
    rows = (tmp_path / "log.csv").read_text().splitlines()
    assert len(rows) == 3 and rows[0] == "epoch,accuracy,loss", rows
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["checkpoint", "w-1", "w-2"]
    loaded = sg.keras.Model(build_model())
    loaded.load_weights(str(tmp_path / "ckpt" / "w-2"))
    for k, v in outs[0]["final"].items():
        torch.testing.assert_close(loaded.module.state_dict()[k], v, rtol=0, atol=0)


def test_steps_per_epoch_equal_to_the_batches_in_the_data_trains_every_epoch():
    x, y = keras_data(48)
    model = _compiled()
    seen = []

    class Count(sg.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(batch)

    history = model.fit(
        x, y, batch_size=16, epochs=3, steps_per_epoch=3, verbose=0, callbacks=[Count()]
    )
    assert history.epoch == [0, 1, 2] and seen == [0, 1, 2] * 3


def _trained_and_saved(path):
    x, y = keras_data(48)
    torch.manual_seed(5)
    model = _compiled()
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    model.save(str(path))
    return model, x, y


def test_save_and_load_model_outside_and_inside_a_strategy_scope(tmp_path):
    model, x, y = _trained_and_saved(tmp_path / "saved")
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == [
        "config.json",
        "manifest.json",
        "model.safetensors",
        "program.pt2",
    ]
    expected = model.predict(x)
    loaded = sg.keras.models.load_model(str(tmp_path / "saved"))
    np.testing.assert_allclose(loaded.predict(x), expected, rtol=1e-5, atol=1e-6)
    assert loaded.evaluate(x, y, verbose=0) == pytest.approx(
        model.evaluate(x, y, verbose=0), rel=1e-5
    )
    assert loaded.optimizer.learning_rate == pytest.approx(0.1)
    # The weights load in plain PyTorch, without stratagem.
    from safetensors.torch import load_file

    plain = build_model()
    plain.load_state_dict(load_file(str(tmp_path / "saved" / "model.safetensors")))
    with torch.no_grad():
        np.testing.assert_allclose(plain(x).numpy(), expected, rtol=1e-5, atol=1e-6)
    # Inside a scope the loaded model is distributed: training it on 2 replicas equals
    # training the single-device copy on the global batch.
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        mirrored = sg.keras.models.load_model(str(tmp_path / "saved"))
    assert mirrored.distribute_strategy is strategy
    mirrored.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    loaded.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(mirrored.predict(x), loaded.predict(x), rtol=1e-4, atol=1e-5)


def test_saving_a_model_never_built_raises_as_keras(tmp_path):
    """Keras 3 refuses to save the weights of (saving_lib_test.py
    test_save_weights_only_with_unbuilt_model) or export an unbuilt model, with "You are
    saving a model that has not yet been built"; calling the model or ``build`` builds it."""
    model = _compiled()
    assert not model.built
    with pytest.raises(ValueError, match="You are saving a model that has not yet been built"):
        model.save(str(tmp_path / "unbuilt"))
    assert not (tmp_path / "unbuilt").exists()
    model(torch.zeros(3, 5))
    assert model.built
    built = _compiled()
    built.build((None, 5))
    built.save(str(tmp_path / "built"))
    x, _ = keras_data(8)
    loaded = sg.keras.models.load_model(str(tmp_path / "built"))
    np.testing.assert_allclose(loaded.predict(x), built.predict(x), rtol=1e-5, atol=1e-6)


def test_a_model_without_a_program_loads_into_a_given_module(tmp_path, monkeypatch):
    import stratagem.keras.saving as saving

    model = _compiled()
    model.build((None, 5))
    # A module torch.export cannot trace: the weights are saved without a program.
    monkeypatch.setattr(saving, "_export", lambda *a: (False, "cannot trace it", []))
    with pytest.warns(UserWarning, match="cannot trace it"):
        model.save(str(tmp_path / "saved"))
    with pytest.raises(ValueError, match="pass module="):
        sg.keras.models.load_model(str(tmp_path / "saved"))
    loaded = sg.keras.models.load_model(str(tmp_path / "saved"), module=build_model())
    for k, v in model.module.state_dict().items():
        torch.testing.assert_close(loaded.module.state_dict()[k], v, rtol=0, atol=0)
    with pytest.raises(FileNotFoundError, match="not a saved model"):
        sg.keras.models.load_model(str(tmp_path))


def test_a_truncated_weights_file_is_a_clear_error(tmp_path):
    _trained_and_saved(tmp_path / "saved")
    weights = tmp_path / "saved" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"model\.safetensors.*truncated or altered"):
        sg.keras.models.load_model(str(tmp_path / "saved"))


def test_per_step_logs_are_computed_only_for_callbacks_that_read_them(monkeypatch):
    # Under MultiWorkerMirroredStrategy each computation is an all-reduce: none per step unless
    # a callback reads batch logs (a progress bar in a terminal, a user's batch hook...).
    x, y = keras_data(48)
    model = _compiled()
    calls = []
    original = model._logs
    monkeypatch.setattr(model, "_logs", lambda: calls.append(1) or original())
    model.fit(x, y, batch_size=16, epochs=2, verbose=2)  # 3 steps an epoch
    assert len(calls) == 2  # the epoch ends
    calls.clear()
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[_Recorder()])
    assert len(calls) == 2 + 6


def test_auc_matches_scikit_learn_and_sums_over_replicas():
    from sklearn.metrics import roc_auc_score

    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 2, (400,), generator=g)
    scores = (labels.float() * 0.3 + torch.rand(400, generator=g) * 0.7).clamp(0, 1)
    auc = sg.keras.metrics.AUC()
    auc.update_state(labels[:150], scores[:150])
    auc.update_state(labels[150:], scores[150:])
    assert float(auc.result()) == pytest.approx(roc_auc_score(labels, scores), abs=5e-3)
    # Under MirroredStrategy each replica counts its half; the result is over both.
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        mirrored = sg.keras.metrics.AUC()
    data = strategy.experimental_distribute_dataset([(labels, scores)])
    for batch in data:
        strategy.run(lambda b: mirrored.update_state(*b), args=(batch,))
    assert float(mirrored.result()) == pytest.approx(float(auc.result()), abs=1e-6)
    with pytest.raises(ValueError, match="num_thresholds must be an integer > 1; got 1"):
        sg.keras.metrics.AUC(num_thresholds=1)


def test_a_global_batch_smaller_than_the_replicas_fits_as_one_device():
    # TF allows it: the rebatch gives some replicas empty batches, and the loss share of each
    # replica is over the global batch, so the step is one device's.
    torch.manual_seed(1)
    x, y = torch.randn(7, 4), torch.randint(0, 3, (7,))
    runs = []
    for strategy in (None, sg.distribute.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])):
        torch.manual_seed(0)
        with (strategy or sg.distribute.get_strategy()).scope():
            model = sg.keras.Model(torch.nn.Linear(4, 3))
            model.compile("sgd", "sparse_categorical_crossentropy")
        history = model.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0)
        runs.append((history.history["loss"], [p.detach().clone() for p in model.parameters()]))
    (one_loss, one_weights), (three_loss, three_weights) = runs
    assert three_loss == pytest.approx(one_loss, rel=1e-6)
    for a, b in zip(three_weights, one_weights):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


class _PerToken(torch.nn.Module):
    """Logits for every token: (batch, tokens, classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(7, 5)
        self.out = torch.nn.Linear(5, 7)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(tokens))


@pytest.mark.parametrize("weighted", [False, True])
def test_a_loss_per_token_trains_on_keras_mean_over_every_element(weighted):
    # Keras's "sum_over_batch_size" divides by every element of the loss (batch x tokens),
    # not by the batch alone: the gradient of one fit step must be that mean's (Mirrored's two
    # replicas each carry half of it, and their sum is the same).
    torch.manual_seed(0)
    tokens = torch.randint(0, 7, (8, 5))
    labels = torch.randint(0, 7, (8, 5))
    weights = torch.linspace(0.5, 2.0, 8) if weighted else None
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = sg.keras.Model(_PerToken())
        model.compile(
            optimizer=sg.keras.optimizers.SGD(learning_rate=1.0),
            loss=sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    reference = _PerToken()
    reference.load_state_dict(model.module.state_dict())
    parts = (tokens, labels) if weights is None else (tokens, labels, weights)
    model.fit(sg.data.Dataset.from_tensor_slices(parts).batch(8), epochs=1, verbose=0)
    losses = torch.nn.functional.cross_entropy(
        reference(tokens).reshape(-1, 7), labels.reshape(-1), reduction="none"
    ).reshape(8, 5)
    if weighted:
        losses = losses * weights[:, None]
    losses.mean().backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= p.grad
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.module.state_dict()[name], value, rtol=1e-5, atol=1e-6)


def test_a_model_wraps_its_module_under_the_strategy_its_parameters_were_made_in():
    # Built in the scope and wrapped outside it, the model still trains under that strategy
    # (under the default one its gradients would be combined by the other all the same).
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        module = torch.nn.Linear(3, 2)
    model = sg.keras.Model(module)
    assert model.distribute_strategy is strategy
    other = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    with other.scope(), pytest.raises(ValueError, match="created under MirroredStrategy"):
        sg.keras.Model(module)
    assert sg.keras.Model(torch.nn.Linear(3, 2)).distribute_strategy is sg.distribute.get_strategy()
