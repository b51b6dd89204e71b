"""Keras losses, metrics, regularizers and optimizer names: values from Keras 3's docstring
examples and tests (keras/src/losses/losses_test.py, metrics/*_test.py,
regularizers/regularizers_test.py), Keras's shape handling, and metrics summed over replicas."""

from __future__ import annotations

import pytest
import torch

import stratagem as sg
from workers.common import build_model, keras_data

L, M = sg.keras.losses, sg.keras.metrics
_T = [[0.0, 1.0], [0.0, 0.0]]
_P = [[0.6, 0.4], [0.4, 0.6]]


@pytest.mark.parametrize(
    "loss, y_true, y_pred, expected",
    [
        # Keras docstring examples (keras/src/losses/losses.py).
        (L.MeanSquaredError(), _T, [[1.0, 1.0], [1.0, 0.0]], 0.5),
        (L.MeanAbsoluteError(), _T, [[1.0, 1.0], [1.0, 0.0]], 0.5),
        (L.Huber(), _T, _P, 0.155),
        (L.KLDivergence(), _T, _P, 0.458),
        (
            L.BinaryCrossentropy(from_logits=True),
            [0.0, 1.0, 0.0, 0.0],
            [-18.6, 0.51, 2.94, -12.8],
            0.865,
        ),
        (L.BinaryCrossentropy(), _T, _P, 0.815),
        (
            L.CategoricalCrossentropy(),
            [[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]],
            [[0.05, 0.95, 0.0], [0.1, 0.8, 0.1]],
            1.177,
        ),
    ],
)
def test_losses_match_keras_docstring_values(loss, y_true, y_pred, expected):
    value = loss(torch.tensor(y_true), torch.tensor(y_pred))
    assert float(value) == pytest.approx(expected, abs=1e-3)


def test_losses_by_keras_name():
    """keras.losses.get: names and aliases."""
    for name, cls in [("mse", L.MeanSquaredError), ("mae", L.MeanAbsoluteError),
                      ("binary_crossentropy", L.BinaryCrossentropy), ("huber", L.Huber),
                      ("kld", L.KLDivergence), ("kl_divergence", L.KLDivergence),
                      ("categorical_crossentropy", L.CategoricalCrossentropy)]:  # fmt: skip
        assert isinstance(L.get(name), cls), name
    assert isinstance(L.get(L.Huber), L.Huber)


def test_a_rank_1_target_against_an_n_by_1_output_compares_row_by_row():
    """Keras's squeeze_or_expand_to_same_rank (losses/loss.py): `(N,)` labels against `(N, 1)`
    outputs give N per-example losses, never an (N, N) broadcast."""
    y_true = torch.tensor([0.0, 1.0, 2.0])
    y_pred = torch.tensor([[0.0], [1.0], [4.0]])
    for loss in (L.MeanSquaredError(), L.MeanAbsoluteError(), L.Huber()):
        per_example = loss.call(y_true, y_pred)
        assert per_example.shape == (3,), type(loss).__name__
    assert float(L.MeanSquaredError()(y_true, y_pred)) == pytest.approx(4 / 3)
    assert float(L.BinaryCrossentropy()(torch.tensor([0.0, 1.0]), torch.tensor([[0.1], [0.9]]))) \
        == pytest.approx(-float(torch.log(torch.tensor(0.9))), rel=1e-5)  # fmt: skip
    mse = M.MeanSquaredError()
    mse.update_state(y_true, y_pred)
    assert float(mse.result()) == pytest.approx(4 / 3)


def test_squeeze_or_expand_to_same_rank_shapes_as_keras():
    """Keras 3's ``LossTest.test_squeeze_or_expand`` (keras/src/losses/loss_test.py), both
    argument orders; then tf.keras's ``compile_utils.match_dtype_and_rank``: a rank-1 target
    against rank-2 predictions gains a last axis whatever the predictions' width."""
    for shorter, longer, both in (((3,), (3, 1), (3, 1)), ((3, 2), (3, 2, 1), (3, 2))):
        a, b = L.match_rank(torch.ones(shorter), torch.ones(longer))
        assert a.shape == b.shape == both
        b, a = L.match_rank(torch.ones(longer), torch.ones(shorter))
        assert a.shape == b.shape == both
    y_true, y_pred = L.match_rank(torch.ones(4), torch.ones(4, 10))
    assert (y_true.shape, y_pred.shape) == ((4, 1), (4, 10))
    y_true, y_pred = L.match_rank(torch.ones(4, 10), torch.ones(4, 10, 3))  # rank 2: untouched
    assert (y_true.shape, y_pred.shape) == ((4, 10), (4, 10, 3))


_LABELS = torch.tensor([0.0, 1.0, 0.5, 0.25])  # (N,): one target per example
_OUTPUTS = torch.tensor(  # (N, 3): a Dense(3) head, as TF's parameter-server tutorial's Dense(10)
    [[0.1, 0.9, 0.3], [0.7, 0.2, 0.6], [0.5, 0.4, 0.8], [0.05, 0.35, 0.95]]
)


@pytest.mark.parametrize(
    "loss, per_element",
    [
        (L.MeanSquaredError(), lambda t, p: (p - t) ** 2),
        (L.MeanAbsoluteError(), lambda t, p: (p - t).abs()),
        (L.Huber(), lambda t, p: torch.where((p - t).abs() <= 1, 0.5 * (p - t) ** 2,
                                             (p - t).abs() - 0.5)),
        (L.KLDivergence(), lambda t, p: t.clamp(1e-7, 1) * torch.log(t.clamp(1e-7, 1) / p)),
        (L.BinaryCrossentropy(), lambda t, p: -(t * p.log() + (1 - t) * (1 - p).log())),
    ],
)  # fmt: skip
def test_a_rank_1_target_is_compared_with_every_column_of_a_wider_output(loss, per_element):
    """tf.keras's compiled loss (``compile_utils.match_dtype_and_rank``): ``(N,)`` labels
    against ``(N, C)`` outputs become ``(N, 1)`` and meet each of the C columns; one value per
    example, never an (N, C)-against-(N,) broadcast (an error, or a wrong table when N == C).
    Reference: the per-element formula on the hand-expanded target (Keras's docstrings)."""
    expected = per_element(_LABELS[:, None], _OUTPUTS)
    expected = expected.sum(-1) if isinstance(loss, L.KLDivergence) else expected.mean(-1)
    per_example = loss.call(_LABELS, _OUTPUTS)
    assert per_example.shape == (4,)
    torch.testing.assert_close(per_example, expected, rtol=1e-5, atol=1e-6)
    assert float(loss(_LABELS, _OUTPUTS)) == pytest.approx(float(expected.mean()), rel=1e-5)
    # A square batch (N == C) is no special case: the same rule, not a batch-by-batch table.
    square = _OUTPUTS[:3]
    torch.testing.assert_close(loss.call(_LABELS[:3], square), per_example[:3])


def test_metrics_reconcile_ranks_as_their_losses():
    """tf.keras's ``MeanMetricWrapper.update_state`` and the compiled metrics reconcile ranks
    as the loss does: a metric of ``(N,)`` labels against ``(N, C)`` (or ``(N, 1)``) outputs is
    the loss's mean; ``Accuracy`` of ``(N,)`` against ``(N, 1)`` compares row by row."""
    mse = M.MeanSquaredError()
    mse.update_state(_LABELS, _OUTPUTS)
    assert float(mse.result()) == pytest.approx(float(L.MeanSquaredError()(_LABELS, _OUTPUTS)))
    custom = M.get(lambda y_true, y_pred: (y_pred - y_true).abs().mean(-1))
    custom.update_state(_LABELS, _OUTPUTS)
    assert float(custom.result()) == pytest.approx(float(L.MeanAbsoluteError()(_LABELS, _OUTPUTS)))
    accuracy = M.Accuracy()
    accuracy.update_state(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([[1.0], [2.0], [0.0]]))
    assert float(accuracy.result()) == pytest.approx(2 / 3)  # not 3 matches of 9 pairs
    binary = M.BinaryAccuracy()
    binary.update_state(torch.tensor([1.0, 0.0]), torch.tensor([[0.9, 0.2], [0.1, 0.7]]))
    assert float(binary.result()) == pytest.approx(0.5)  # each label against both columns


def test_fit_trains_a_dense_10_head_on_rank_1_labels_with_mse():
    """TF's parameter-server tutorial compiles ``Dense(10)`` with ``loss="mse"`` on labels of
    shape ``(N,)``: fit's logged loss is the mean over examples of each row's mean squared
    error against its one label, computed here by hand on the same weights."""
    torch.manual_seed(0)
    x, y = torch.rand(40, 10), torch.rand(40)
    module = torch.nn.Linear(10, 10)
    with torch.no_grad():
        expected = ((module(x) - y[:, None]) ** 2).mean()
    model = sg.keras.Model(module)
    model.compile(sg.keras.optimizers.SGD(0.0), loss="mse", metrics=["mse"])
    history = model.fit(x, y, batch_size=40, epochs=1, shuffle=False, verbose=0)
    assert history.history["loss"][0] == pytest.approx(float(expected), rel=1e-5)
    assert history.history["mse"][0] == pytest.approx(float(expected), rel=1e-5)


def test_metrics_match_keras_test_values():
    """metrics/regression_metrics_test.py, probabilistic_metrics_test.py, accuracy_metrics_test:
    the weighted means Keras computes."""
    mse = M.MeanSquaredError()
    mse.update_state(torch.tensor(_T), torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    assert float(mse.result()) == pytest.approx(0.5)
    mae = M.get("mae")
    assert mae.name == "mae" and isinstance(mae, M.MeanAbsoluteError)
    mae.update_state(torch.tensor(_T), torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
                     sample_weight=torch.tensor([1.0, 0.0]))  # fmt: skip
    assert float(mae.result()) == pytest.approx(0.5)
    kld = M.KLDivergence()
    kld.update_state(torch.tensor(_T), torch.tensor(_P))
    assert float(kld.result()) == pytest.approx(0.458, abs=1e-3)
    acc = M.BinaryAccuracy()
    acc.update_state(torch.tensor([[1.0], [1.0], [0.0], [0.0]]),
                     torch.tensor([[0.98], [1.0], [0.0], [0.6]]))  # fmt: skip
    assert float(acc.result()) == pytest.approx(0.75)  # Keras BinaryAccuracy docstring
    bce = M.BinaryCrossentropy()
    bce.update_state(torch.tensor(_T), torch.tensor(_P))
    assert float(bce.result()) == pytest.approx(0.815, abs=1e-3)
    assert M.MeanSquaredError.direction == "down" and M.BinaryAccuracy.direction == "up"


def test_regression_metrics_over_two_replicas_equal_one_device():
    """Metrics are sync-on-read (TF): under MirroredStrategy the logged mse and mae are over the
    global batch, as on one device."""
    x, y = keras_data(48)
    target = torch.nn.functional.one_hot(y, 3).float()
    torch.manual_seed(0)
    initial = build_model().state_dict()

    def fit(strategy):
        with strategy.scope():
            module = build_model()
            module.load_state_dict(initial)
            model = sg.keras.Model(module)
            model.compile(sg.keras.optimizers.SGD(0.1), "mse", ["mae", "mse"])
        return model.fit(x, target, batch_size=16, epochs=2, shuffle=False, verbose=0)

    one = fit(sg.distribute.OneDeviceStrategy("cpu"))
    two = fit(sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"]))
    for key in ("loss", "mae", "mse"):
        assert two.history[key] == pytest.approx(one.history[key], rel=1e-5), key
    assert one.history["mse"] == pytest.approx(one.history["loss"], rel=1e-6)


def test_regularizers_match_keras_values():
    """regularizers_test.py test_l1 / test_l2 / test_l1_l2: l1 * sum|x|, l2 * sum x**2."""
    x = torch.tensor([[1.0, -2.0], [3.0, -4.0]])
    R = sg.keras.regularizers
    assert float(R.L1(0.1)(x)) == pytest.approx(1.0)
    assert float(R.L2(0.1)(x)) == pytest.approx(3.0)
    assert float(R.L1L2(l1=0.1, l2=0.1)(x)) == pytest.approx(4.0)
    assert isinstance(R.get("l2"), R.L2) and R.get("l2").l2 == pytest.approx(0.01)
    with pytest.raises(ValueError, match="must be >= 0"):
        R.L2(-1.0)


def test_add_loss_regularizes_training_once_per_global_batch_on_any_replica_count():
    """Keras's add_loss with a zero-argument callable (TF 2 variable regularization): the
    penalty's gradient is added once per step, also on 2 replicas (scale_regularization_loss);
    the logged loss is the total, data loss plus penalty (Keras 3's Trainer.compute_loss)."""
    x, y = keras_data(48)
    torch.manual_seed(1)
    initial = build_model().state_dict()

    def fit(strategy, penalty):
        with strategy.scope():
            module = build_model()
            module.load_state_dict(initial)
            model = sg.keras.Model(module)
            model.compile(sg.keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
        if penalty:
            model.add_loss(sg.keras.regularizers.penalty(sg.keras.regularizers.L2(0.05),
                                                         module[0].weight))  # fmt: skip
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        return model

    plain = fit(sg.distribute.OneDeviceStrategy("cpu"), False)
    one = fit(sg.distribute.OneDeviceStrategy("cpu"), True)
    two = fit(sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"]), True)
    assert one.module[0].weight.norm() < plain.module[0].weight.norm()
    for k, v in one.module.state_dict().items():
        torch.testing.assert_close(two.module.state_dict()[k], v, rtol=1e-5, atol=1e-6)
    assert len(one.losses) == 1 and float(one.losses[0].detach()) > 0
    for model in (one, two):
        with torch.no_grad():
            data_loss = model.loss(y, model.module(x))  # the compiled loss, a batch mean
        total = float(data_loss + model.losses[0])
        assert abs(model.evaluate(x, y, batch_size=16, verbose=0) - total) < 1e-5
    with pytest.raises(TypeError, match="zero-argument callable"):
        one.add_loss(torch.tensor(1.0))


def test_legacy_optimizer_names():
    """tf.keras.optimizers.legacy.Adam/SGD/RMSprop/Adagrad (TF 2.11+) are accepted."""
    legacy = sg.keras.optimizers.legacy
    for cls in (legacy.Adam, legacy.SGD, legacy.RMSprop, legacy.Adagrad):
        model = sg.keras.Model(build_model())
        model.compile(cls(learning_rate=0.01), "sparse_categorical_crossentropy")
        assert model.optimizer.learning_rate == pytest.approx(0.01)


def test_compiled_accuracy_is_chosen_from_the_shapes():
    """tf.keras compile_utils.MetricsContainer._get_metric_object / Keras 3 CompileMetrics:
    "accuracy" is binary for a last dimension of 1, sparse categorical for integer labels of a
    lower rank, categorical for one-hot labels; whatever the loss."""
    accuracy = sg.keras.metrics.get("accuracy")
    accuracy.update_state(torch.tensor([[1.0], [0.0]]), torch.tensor([[0.7], [0.6]]))
    assert float(accuracy.result()) == 0.5  # binary at 0.5: 0.7 → 1 right, 0.6 → 1 wrong
    sparse = sg.keras.metrics.get("accuracy")
    sparse.update_state(torch.tensor([2, 0]), torch.tensor([[0.1, 0.2, 0.7], [0.2, 0.5, 0.3]]))
    assert float(sparse.result()) == 0.5
    one_hot = sg.keras.metrics.get("acc")
    one_hot.update_state(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), torch.tensor([[0.2, 0.8]] * 2))
    assert float(one_hot.result()) == 0.5 and one_hot.name == "acc"
