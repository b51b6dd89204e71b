"""sg.keras.Model.fit / evaluate / predict under PipelineStrategy: on 2 real stage processes
against a hand-written single-process loop, checkpoints of every stage through the Keras
callbacks, the example end to end; and, without processes, the null version and the clear errors."""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg
from cluster_utils import REPO, WORKERS, Process, child_env, run_cluster
from workers.common import build_model, keras_data

PipelineStrategy = sg.distribute.experimental.PipelineStrategy


def _compile(model: sg.keras.Model) -> None:
    model.compile(
        sg.keras.optimizers.Adam(0.01),
        sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        ["accuracy"],
    )


def _reference(epochs: int = 2) -> tuple[dict, dict, list, np.ndarray]:
    """One process by hand, on the data the stage processes train on (fit's shuffle=False: the
    batches of 24 in order, the last of 18): torch's Adam with Keras's defaults (epsilon 1e-7),
    each batch's mean cross-entropy; Keras's epoch logs are the loss and accuracy over the
    epoch's examples, each batch's taken on the logits before its update."""
    x, y = keras_data(90)
    torch.manual_seed(0)
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-7)
    history: dict[str, list[float]] = {"loss": [], "accuracy": []}
    for _ in range(epochs):
        loss_sum = correct = 0.0
        for start in range(0, len(x), 24):
            xb, yb = x[start : start + 24], y[start : start + 24]
            optimizer.zero_grad()
            logits = model(xb)
            loss = F.cross_entropy(logits, yb)
            loss.backward()
            optimizer.step()
            loss_sum += loss.item() * len(yb)
            correct += (logits.argmax(1) == yb).sum().item()
        history["loss"].append(loss_sum / len(x))
        history["accuracy"].append(correct / len(x))
    with torch.no_grad():
        logits = model(x)
    evaluate = [F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()]
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return weights, history, evaluate, logits.numpy()


def _merged(per_rank: list[dict], key: str) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    for saved in per_rank:
        assert not set(got) & set(saved[key])  # each layer lives on one stage only
        got.update(saved[key])
    return got


SCHEDULES = ["1F1B", "GPipe", "Interleaved1F1B", "PipeDream"]


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory):
    """One run of 2 stage processes: fit under each schedule, then the checkpoint round trip
    (under 1F1B)."""
    out = tmp_path_factory.mktemp("pipeline_fit")
    results = run_cluster(
        WORKERS / "pipeline_fit.py", 2, out, args=[str(out), *SCHEDULES], timeout=240
    )
    for i, r in enumerate(results):
        r.check(f"stage process {i}")
    return [torch.load(out / f"fit-rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def reference():
    return _reference()


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["1F1B", "GPipe", "Interleaved1F1B"])
def test_fit_on_two_stages_equals_a_single_process_loop(two_stages, reference, schedule):
    ref_weights, ref_history, ref_evaluate, ref_predict = reference
    fits = [s["fit"][schedule] for s in two_stages]
    got = _merged(fits, "weights")
    assert got.keys() == ref_weights.keys()
    for name, value in ref_weights.items():
        torch.testing.assert_close(got[name], value, atol=1e-5, rtol=1e-4, msg=name)
    for rank, fit in enumerate(fits):  # every process logs the same, the reference's values
        assert fit["history"].keys() == ref_history.keys(), rank
        for key, values in ref_history.items():
            assert fit["history"][key] == pytest.approx(values, abs=1e-5), (rank, key)
        assert fit["evaluate"] == pytest.approx(ref_evaluate, abs=1e-5), rank
        np.testing.assert_allclose(fit["predict"].numpy(), ref_predict, atol=1e-5)


@pytest.mark.multiprocess
def test_pipedream_fit_trains_and_every_process_logs_the_same(two_stages, reference):
    ref_weights, ref_history, _, _ = reference
    fits = [s["fit"]["PipeDream"] for s in two_stages]
    history = fits[0]["history"]
    assert fits[1]["history"] == history  # the same logs on both processes
    assert fits[0]["evaluate"] == fits[1]["evaluate"]
    assert history["loss"][1] < history["loss"][0]
    # Asynchronous: updates after every micro-batch, so not the synchronous result.
    got = _merged(fits, "weights")
    assert not torch.allclose(got["0.weight"], ref_weights["0.weight"], atol=1e-4)
    # What it logged is the model's own accuracy on the outputs its forwards computed.
    assert 0 < history["accuracy"][1] <= 1 and history["loss"][1] == pytest.approx(
        ref_history["loss"][1], abs=0.2
    )


@pytest.mark.multiprocess
def test_checkpoints_and_early_stopping_act_on_every_stage(two_stages):
    # A fresh model (other weights, no optimizer state) resumed from the backup trains its 3rd
    # epoch to exactly where the original, continued, got: every stage's layers and Adam state
    # came back.
    resumes = [s["resume"] for s in two_stages]
    for resume in resumes:  # EarlyStopping read the same val_loss on both processes
        assert resume["early_stopped_epochs"] == [0, 1]
    for rank, resume in enumerate(resumes):
        assert resume["resumed_epochs"] == [2], rank
        for name, value in resume["continued"].items():
            torch.testing.assert_close(resume["resumed"][name], value, atol=0, rtol=0, msg=name)
    # The chief wrote the whole model: each stage's layers as they were at the backup.
    path = resumes[0]["checkpoint"]
    assert path is not None and path.endswith("ckpt-2"), path
    whole = sg.keras.Model(build_model())
    whole.load_weights(path)
    at_backup = _merged(resumes, "at_backup")
    assert {n for n, _ in whole.module.named_parameters()} == at_backup.keys()
    for name, p in whole.module.named_parameters():
        torch.testing.assert_close(p.detach(), at_backup[name], atol=0, rtol=0, msg=name)


@pytest.mark.e2e
def test_example_fit_on_two_stages_reaches_90_percent(tmp_path):
    argv = [sys.executable, "-m", "stratagem.cli", "run", "-n", "2"]
    argv += [str(REPO / "examples" / "pipeline.py"), "--fit", "--schedule", "1F1B"]
    result = Process(argv, child_env(), tmp_path, "launcher").wait(timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    accuracies = [float(a) for a in re.findall(r"Test accuracy: ([0-9.]+)", output)]
    assert len(accuracies) == 2 and len(set(accuracies)) == 1, output  # the same on both
    assert accuracies[0] >= 0.90, output
    assert "val_accuracy" in output, output  # validation ran every epoch


# ---------------------------------------------------------------------- one process


def _strategy(**kwargs: object) -> PipelineStrategy:
    return PipelineStrategy(num_stages=1, num_microbatches=4, **kwargs)  # type: ignore[arg-type]


def test_the_null_version_fits_as_the_default_strategy_with_a_padded_last_batch():
    # 90 examples in batches of 24: the last (18) is padded to 20 rows, 2 of them not counted.
    x, y = keras_data(90)
    w = torch.linspace(0.5, 1.5, 90)
    results = []
    for strategy in (None, _strategy()):
        torch.manual_seed(0)
        if strategy is None:
            model = sg.keras.Model(build_model())
        else:
            with strategy.scope():
                model = sg.keras.Model(build_model())
        _compile(model)
        data = sg.data.Dataset.from_tensor_slices((x, y, w)).batch(24)
        history = model.fit(data, epochs=2, verbose=0)
        weights = [p.detach().clone() for p in model.module.parameters()]
        results.append((weights, history.history))
    (ref_w, ref_h), (got_w, got_h) = results
    for a, b in zip(got_w, ref_w):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    for key in ref_h:
        assert got_h[key] == pytest.approx(ref_h[key], abs=1e-6), key


def _model(strategy: PipelineStrategy, cls: type = sg.keras.Model) -> sg.keras.Model:
    with strategy.scope():
        model = cls(nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)))
    _compile(model)
    return model


def test_a_batch_the_micro_batches_do_not_divide_is_refused():
    model = _model(_strategy())
    x, y = keras_data(90)
    with pytest.raises(ValueError, match=r"a global batch of 22 examples does not split into 1 "):
        model.fit(x, y, batch_size=22, epochs=1, verbose=0)


def test_a_custom_train_step_cannot_run_on_a_pipeline():
    class Custom(sg.keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    model = _model(_strategy(), Custom)
    x, y = keras_data(24)
    with pytest.raises(TypeError, match=r"Custom overrides \['train_step'\]"):
        model.fit(x, y, batch_size=24, epochs=1, verbose=0)


def test_strategy_run_is_refused_naming_the_ways_to_train():
    with pytest.raises(NotImplementedError, match=r"PipelineStrategy.run: .*Model.fit"):
        _strategy().run(lambda: None)
