"""sg.keras.Model with modules that are not Keras-shaped, without Hugging Face (the HF models
are tests/real_models/test_keras_fit.py): dict inputs as keyword arguments (split across
replicas), outputs read by name or position, Keras's ``model(x, training=...)``, and the
named errors for what cannot work."""

from __future__ import annotations

import pytest
import torch

import stratagem as sg
from stratagem.errors import ModelOutputError


class TwoInputs(torch.nn.Module):
    """forward(a, b) -> a dict of two heads, as a question-answering model's."""

    def __init__(self) -> None:
        super().__init__()
        self.left = torch.nn.Linear(4, 3)
        self.right = torch.nn.Linear(2, 3)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.left(a) + self.right(b)
        return {"start_logits": hidden, "end_logits": -hidden}


def _two_input_data(n: int = 10):
    g = torch.Generator().manual_seed(0)
    x = {"a": torch.randn(n, 4, generator=g), "b": torch.randn(n, 2, generator=g)}
    return x, torch.randint(0, 3, (n,), generator=g)


def _fit_two_inputs(strategy) -> dict[str, torch.Tensor]:
    x, y = _two_input_data()
    torch.manual_seed(0)
    with strategy.scope():
        model = sg.keras.Model(TwoInputs())
        model.compile(
            sg.keras.optimizers.SGD(0.5),
            sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            output="start_logits",
        )
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def test_a_dict_x_reaches_forward_as_keywords_and_splits_across_replicas_like_arrays():
    one = _fit_two_inputs(sg.distribute.get_strategy())
    mirrored = _fit_two_inputs(sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"]))
    # The same global batches by hand, reading the named output.
    x, y = _two_input_data()
    torch.manual_seed(0)
    module = TwoInputs()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    for _ in range(2):
        for lo in range(0, 10, 4):
            optimizer.zero_grad()
            out = module(**{k: v[lo : lo + 4] for k, v in x.items()})
            torch.nn.functional.cross_entropy(out["start_logits"], y[lo : lo + 4]).backward()
            optimizer.step()
    for name, value in module.state_dict().items():
        torch.testing.assert_close(one[name], value, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mirrored[name], value, rtol=1e-5, atol=1e-6)


def test_outputs_are_read_by_logits_name_or_position_and_otherwise_refused():
    x, y = _two_input_data(6)

    class Tuple(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return a.sum(1), self.fc(a)

    model = sg.keras.Model(Tuple())
    loss = sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile("sgd", loss, ["accuracy"])
    with pytest.raises(ModelOutputError, match=r"a tuple of 2 .*output=NAME"):
        model.fit(x["a"], y, batch_size=3, verbose=0)
    model.compile("sgd", loss, ["accuracy"], output=1)
    _, accuracy = model.evaluate(x["a"], y, batch_size=3, verbose=0)
    expected = (model.module(x["a"])[1].argmax(-1) == y).float().mean().item()
    assert accuracy == pytest.approx(expected)
    assert model.predict(x["a"], batch_size=4).shape == (6, 3)  # the part named
    # A dict output is read at "logits" without naming it: the loss is the cross-entropy of
    # module(x)["logits"], not of "features" (also a valid input to this loss, and far off).
    logits_dict = sg.keras.Model(_DictHead())
    logits_dict.compile("sgd", loss)
    with torch.no_grad():
        out = logits_dict.module(x["a"])
    expected = torch.nn.functional.cross_entropy(out["logits"], y).item()
    assert abs(torch.nn.functional.cross_entropy(out["features"], y).item() - expected) > 0.1
    assert logits_dict.evaluate(x["a"], y, verbose=0) == pytest.approx(expected, rel=1e-6)
    # Neither a compiled loss nor a .loss of the output's own: the error says what to pass.
    plain = sg.keras.Model(torch.nn.Linear(4, 3))
    plain.compile("sgd")
    with pytest.raises(ModelOutputError, match=r"tensor of shape \[6, 3\].*compile a loss"):
        plain.evaluate(x["a"], None, batch_size=6, verbose=0)
    with pytest.raises(ModelOutputError, match="forward takes no 'labels'"):
        plain.fit(x["a"], y, batch_size=6, verbose=0)
    with pytest.raises(ValueError, match=r"output=\.\.\.\).*got 1.5"):
        plain.compile("sgd", output=1.5)


class _DictHead(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.fc(x), "features": x}


class _NoTraining(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x)


class _TakesTraining(_NoTraining):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool | None] = []

    def forward(self, x: torch.Tensor, training: bool | None = None) -> torch.Tensor:
        self.seen.append(training)
        return self.drop(x)


def test_model_call_with_training_is_keras_s_train_mode_for_that_call():
    x = torch.ones(4, 64)
    model = sg.keras.Model(_NoTraining().eval())
    torch.manual_seed(0)
    dropped = model(x, training=True)  # no TypeError: forward takes no training
    assert (dropped == 0).any() and not model.module.training  # the mode is restored
    model.module.train()
    assert torch.equal(model(x, training=False), x) and model.module.training
    assert torch.equal(model.module.eval()(x), model(x))  # None: the module's own mode
    takes = sg.keras.Model(_TakesTraining())
    takes(x, training=True)
    takes(x)
    assert takes.module.seen == [True, None]


def test_forward_s_signature_is_read_once_per_class_until_forward_changes(monkeypatch):
    # Every step reads how the module's forward is called; inspect.signature was a twentieth
    # of a small model's step. A forward set on the object, or a class's forward replaced,
    # is read again.
    from stratagem.keras import module_calls

    read = []
    real = module_calls.inspect.signature
    monkeypatch.setattr(module_calls.inspect, "signature", lambda f: read.append(f) or real(f))

    class Fresh(TwoInputs):  # a class no earlier test has asked about
        pass

    first, second = Fresh(), Fresh()
    assert module_calls.forward_signature(first).named == {"a", "b"}
    assert module_calls.forward_signature(second).named == {"a", "b"}
    assert len(read) == 1  # one class, one read

    def forward(x, training=False):
        return x

    second.forward = forward  # on the object: read each time, and this one's
    assert module_calls.forward_signature(second).named == {"x", "training"}
    assert module_calls.forward_signature(second).named == {"x", "training"}
    assert len(read) == 3

    class Keyed(TwoInputs):
        def forward(self, a, b, **kwargs):
            return super().forward(a, b)

    assert module_calls.forward_signature(Keyed()).takes_any_keyword
    monkeypatch.setattr(Keyed, "forward", lambda self, c: c)  # the class's, replaced
    replaced = module_calls.forward_signature(Keyed())
    assert replaced.named == {"c"} and not replaced.takes_any_keyword
    assert module_calls.forward_signature(first).named == {"a", "b"} and len(read) == 5
