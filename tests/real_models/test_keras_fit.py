"""Keras-style fit for Hugging Face models, as HF's own Keras models train: GPT-2 on its own
loss (no compiled loss, y reaching forward as labels=), equal to a hand-written loop, also on
two Mirrored replicas; BERT on dict inputs with a compiled Keras loss and metric reading the
output's .logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import stratagem as sg
from real_models import hf_models
from stratagem.errors import ModelOutputError


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _assert_same_weights(got: torch.nn.Module, expected: torch.nn.Module) -> None:
    want = expected.state_dict()
    for name, value in got.state_dict().items():
        torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-5, msg=name)


def _batches(x: torch.Tensor, size: int, epochs: int) -> list[torch.Tensor]:
    """fit's global batches with shuffle=False: consecutive slices, epoch after epoch."""
    return [x[i : i + size] for _ in range(epochs) for i in range(0, len(x), size)]


def _hand_trained_gpt2(initial, batches, make_optimizer) -> tuple[torch.nn.Module, list[float]]:
    """One process, the loop anyone writes for an HF model: its own loss from labels."""
    module = hf_models.gpt2()
    module.load_state_dict(initial)
    module.train()
    optimizer = make_optimizer(module.parameters())
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = module(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return module, losses


def _keras_adamw(params):
    # What compile(optimizer="adamw") means: Keras's defaults.
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.004, eps=1e-7)


def test_gpt2_trains_on_its_own_loss_with_no_compiled_loss_as_a_hand_written_loop():
    tokens = hf_models.tokens(12)
    module = hf_models.gpt2()
    initial = _state(module)
    model = sg.keras.Model(module)
    model.compile(optimizer="adamw")  # no loss: the model's own
    history = model.fit(x=tokens, y=tokens, batch_size=4, epochs=2, shuffle=False, verbose=0)
    expected, losses = _hand_trained_gpt2(initial, _batches(tokens, 4, 2), _keras_adamw)
    _assert_same_weights(module, expected)
    # The logged loss is the epoch's mean over examples (equal batches: of the batch losses).
    assert history.history["loss"] == pytest.approx([sum(losses[:3]) / 3, sum(losses[3:]) / 3])
    # evaluate is the model's own loss too; predict gives the logits.
    module.eval()
    with torch.no_grad():
        reference = expected.eval()(input_ids=tokens, labels=tokens)
    assert model.evaluate(tokens, tokens, batch_size=12, verbose=0) == pytest.approx(
        reference.loss.item(), rel=1e-5
    )
    predicted = torch.from_numpy(model.predict(tokens, batch_size=5))
    torch.testing.assert_close(predicted, reference.logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_gpt2_on_two_mirrored_replicas_equals_one_device_on_the_global_batch(optimizer):
    # 11 examples in batches of 4: the last batch (3) splits 2 + 1, so each replica's share
    # must weigh its examples (a plain mean of the replicas' means would not); plain SGD sees
    # any factor on the gradient, which Adam's normalisation would hide.
    tokens = hf_models.tokens(11)
    initial = _state(hf_models.gpt2())
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        module = hf_models.gpt2()
        module.load_state_dict(initial)
        model = sg.keras.Model(module)
        recipe = "adamw" if optimizer == "adamw" else sg.keras.optimizers.SGD(0.5)
        model.compile(optimizer=recipe)
    model.fit(tokens, tokens, batch_size=4, epochs=2, shuffle=False, verbose=0)
    if optimizer == "adamw":
        make = _keras_adamw
    else:

        def make(params):
            return torch.optim.SGD(params, lr=0.5)

    expected, _ = _hand_trained_gpt2(initial, _batches(tokens, 4, 2), make)
    assert module.lm_head.weight is module.transformer.wte.weight  # still one parameter
    _assert_same_weights(module, expected)


def _bert_inputs(n: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    ids = hf_models.tokens(n)
    mask = torch.ones_like(ids)
    mask[::2, -5:] = 0  # padding that changes the logits: the mask must reach forward
    return {"input_ids": ids, "attention_mask": mask}, hf_models.labels(n, 3)


def test_bert_with_dict_inputs_a_keras_loss_and_accuracy_reading_logits():
    x, labels = _bert_inputs(8)
    module = hf_models.bert()
    initial = _state(module)
    model = sg.keras.Model(module)
    model.compile(
        "adam",
        sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model.fit(x, labels, batch_size=4, epochs=1, shuffle=False, verbose=0)
    expected = hf_models.bert()
    expected.load_state_dict(initial)
    expected.train()
    optimizer = torch.optim.Adam(expected.parameters(), lr=1e-3, eps=1e-7)
    for lo in (0, 4):
        part = {k: v[lo : lo + 4] for k, v in x.items()}
        optimizer.zero_grad()
        F.cross_entropy(expected(**part).logits, labels[lo : lo + 4]).backward()
        optimizer.step()
    _assert_same_weights(module, expected)
    with torch.no_grad():
        logits = expected.eval()(**x).logits
    loss, accuracy = model.evaluate(x, labels, batch_size=3, verbose=0)
    assert loss == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-5)
    assert accuracy == pytest.approx((logits.argmax(-1) == labels).float().mean().item())
    predicted = torch.from_numpy(model.predict(x, batch_size=3))  # the logits, in order
    torch.testing.assert_close(predicted, logits, rtol=1e-4, atol=1e-5)


def test_bert_on_its_own_loss_reads_labels_from_the_input_dict_for_the_metrics():
    x, labels = _bert_inputs(6)
    module = hf_models.bert()
    initial = _state(module)
    model = sg.keras.Model(module)
    model.compile("adamw", metrics=["accuracy"])
    history = model.fit({**x, "labels": labels}, batch_size=3, shuffle=False, verbose=0)
    # One process by hand: BERT's own loss from labels=, the accuracy of each step's logits
    # (before its update, as Keras's metrics see them) against those labels.
    expected = hf_models.bert()
    expected.load_state_dict(initial)
    expected.train()
    optimizer = _keras_adamw(expected.parameters())
    losses, correct = [], 0
    for lo in (0, 3):
        part = {k: v[lo : lo + 3] for k, v in x.items()}
        optimizer.zero_grad()
        out = expected(**part, labels=labels[lo : lo + 3])
        correct += int((out.logits.argmax(-1) == labels[lo : lo + 3]).sum())
        out.loss.backward()
        optimizer.step()
        losses.append(out.loss.item())
    assert set(history.history) == {"loss", "accuracy"}
    # The accuracy a count over 6 examples (float32's rounding of it at most); the loss a
    # float32 mean of two batches, to a few ulps.
    assert history.history["accuracy"] == pytest.approx([correct / 6], abs=1e-7)
    assert history.history["loss"] == pytest.approx([sum(losses) / 2], rel=1e-5)
    _assert_same_weights(module, expected)
    with torch.no_grad():
        out = expected.eval()(**x, labels=labels)
    loss, accuracy = model.evaluate(x, labels, batch_size=6, verbose=0)
    assert loss == pytest.approx(out.loss.item(), rel=1e-5)
    assert accuracy == pytest.approx((out.logits.argmax(-1) == labels).float().mean().item())


def test_what_cannot_work_says_what_to_pass():
    tokens = hf_models.tokens(4)
    model = sg.keras.Model(hf_models.gpt2())
    model.compile(optimizer="adamw")
    with pytest.raises(ModelOutputError, match=r"loss=None.*labels="):
        model.fit(tokens, batch_size=2, verbose=0)  # no y: GPT-2 computes no loss
    with pytest.raises(ValueError, match="sample weights need a compiled loss"):
        model.fit([(tokens, tokens, torch.ones(4))], verbose=0)
    x, labels = _bert_inputs(4)
    bert = sg.keras.Model(hf_models.bert())
    bert.compile("adam", "sparse_categorical_crossentropy", output="start_logits")
    with pytest.raises(ModelOutputError, match=r"output='start_logits'.*keys \['logits'\]"):
        bert.fit(x, labels, batch_size=2, verbose=0)
