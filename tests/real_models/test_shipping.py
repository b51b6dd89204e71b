"""Hugging Face models travel to a coordinator's worker by state (in one process, through the
wire's encoding): the modules, their ``config`` and ``generation_config`` (a library's plain
objects, by their attributes, one object however many modules hold it) and every other
attribute; the rebuilt model computes what the original does. The real job is
test_tied.py's coordinator test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from real_models import hf_models
from stratagem import shipping
from stratagem.comm import plain_data

HERE = Path(__file__).resolve().parent


def _send(value: Any) -> tuple[Any, shipping.Describer]:
    describer = shipping.Describer(root=HERE)
    entry = describer.value(value, owner="test", name="model")
    frame = plain_data.encode({"table": describer.functions, "entry": entry}, what="test")
    sent = plain_data.decode(frame, sender="chief", what="test")
    return shipping.Rebuilder(sent["table"], root=HERE).value(sent["entry"]), describer


def _inputs(name: str) -> dict[str, torch.Tensor]:
    if name == "resnet":
        return {"pixel_values": hf_models.images(2), "labels": hf_models.labels(2, 4)}
    ids = hf_models.tokens(2)
    if name == "bert":
        return {"input_ids": ids, "labels": hf_models.labels(2, 3)}
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "resnet"])
def test_a_hugging_face_model_travels_by_state_with_its_config(name):
    model = getattr(hf_models, name)()
    rebuilt, describer = _send(model)
    assert type(rebuilt) is type(model) and rebuilt is not model
    kinds = {desc.get("kind") for desc in describer.functions.values()}
    assert "data" in kinds  # its config, by its attributes
    # Every attribute of every module: equal values, the config one object for all of them.
    originals, copies = dict(model.named_modules()), dict(rebuilt.named_modules())
    assert originals.keys() == copies.keys()
    for path, module in originals.items():
        copy = copies[path]
        assert type(copy) is type(module), path
        assert vars(copy).keys() == vars(module).keys(), path
        for key, value in vars(module).items():
            if key in ("_parameters", "_buffers", "_modules") or isinstance(value, torch.Tensor):
                continue
            assert vars(copy)[key] == value, f"{path}.{key}"
        if hasattr(module, "config"):
            assert copy.config is rebuilt.config and type(copy.config) is type(model.config)
    assert vars(rebuilt.config) == vars(model.config)
    assert rebuilt.config._attn_implementation == model.config._attn_implementation
    generation = getattr(model, "generation_config", None)  # a generative model's
    if generation is not None:
        assert type(rebuilt.generation_config) is type(generation)
        assert vars(rebuilt.generation_config) == vars(generation)
    assert rebuilt.all_tied_weights_keys == model.all_tied_weights_keys
    rebuilt.load_state_dict(model.state_dict())  # the values: the wire's copies
    with torch.no_grad():
        expected, got = model(**_inputs(name)), rebuilt(**_inputs(name))
    torch.testing.assert_close(got.loss, expected.loss)
    torch.testing.assert_close(got.logits, expected.logits)
