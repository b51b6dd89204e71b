"""``sg.saved_model``: TensorFlow's SavedModel entry points, checked against what TF documents and
its tests pin down (``tensorflow/python/saved_model/load_test.py``, ``save_test.py``,
``signature_serialization.py``, and the "Save and load a model using a distribution strategy"
tutorial)."""

from __future__ import annotations

import copy
import io
import json
import os
import pickle
import zipfile

import numpy as np
import pytest
import torch
from torch import nn

import stratagem as sg
from stratagem.keras.exported_program import ProgramError, load_program
from stratagem.train.manifest import write_manifest


def _module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _keras_model(strategy=None) -> sg.keras.Model:
    def build():
        model = sg.keras.Model(_module())
        model.compile(
            sg.keras.optimizers.Adam(0.01),
            sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[sg.metrics.SparseCategoricalAccuracy()],
        )
        return model

    if strategy is None:
        model = build()
    else:
        with strategy.scope():
            model = build()
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    return model


X = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))


def test_top_level_aliases_of_the_keras_modules():
    """TF 2: ``tf.metrics``, ``tf.losses``, ``tf.optimizers`` are ``tf.keras.metrics``,
    ``tf.keras.losses``, ``tf.keras.optimizers`` (the tutorial uses
    ``tf.metrics.SparseCategoricalAccuracy()``)."""
    assert sg.metrics is sg.keras.metrics
    assert sg.losses is sg.keras.losses
    assert sg.optimizers is sg.keras.optimizers
    assert {"metrics", "losses", "optimizers", "saved_model"} <= set(dir(sg))
    assert sg.saved_model.DEFAULT_SERVING_SIGNATURE_DEF_KEY == "serving_default"
    assert sg.saved_model.SERVING == "serve"


def test_a_plain_module_saves_and_loads_callable_with_a_serving_signature(tmp_path):
    """TF: ``tf.saved_model.load`` returns an object that is callable and whose
    ``signatures["serving_default"]`` returns a dict of outputs; a function's single tensor
    output is named ``output_0`` (signature_serialization: ``output_{i}``)."""
    module = _module()
    sg.saved_model.save(module, str(tmp_path / "m"), signatures=X[:2])
    loaded = sg.saved_model.load(str(tmp_path / "m"))
    expected = module(X)
    assert torch.allclose(loaded(X), expected, atol=1e-6)
    result = loaded.signatures["serving_default"](X)
    assert set(result) == {"output_0"} and torch.allclose(result["output_0"], expected, atol=1e-6)
    assert len(loaded.variables) == 4 and len(loaded.trainable_variables) == 4
    assert not isinstance(loaded, sg.keras.Model)  # TF: the low-level API gives no Keras model


def test_a_signature_runs_without_a_tape_but_the_loaded_call_is_differentiable(tmp_path):
    """TF: a signature's outputs are plain tensors, no tape records its run (``.numpy()``
    works on them); the loaded object's own call is a restored function, which carries its
    gradient (``function_deserialization.py``): fine-tuning a loaded model goes through it."""
    module = _module()
    sg.saved_model.save(module, str(tmp_path / "m"), signatures=X[:2])
    loaded = sg.saved_model.load(str(tmp_path / "m"))
    x = X.clone().requires_grad_(True)
    out = loaded.signatures["serving_default"](x)["output_0"]
    assert not out.requires_grad and out.grad_fn is None, out
    np.testing.assert_allclose(out.numpy(), module(X).detach().numpy(), atol=1e-6)
    called = loaded(x)
    assert called.requires_grad
    called.sum().backward()
    assert x.grad is not None and all(v.grad is not None for v in loaded.trainable_variables)


def test_signatures_as_a_dict_and_outputs_of_several_tensors(tmp_path):
    """TF: ``signatures={"serving_default": fn}``; tuple outputs are ``output_0``,
    ``output_1``."""

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 2), nn.Linear(4, 3)

        def forward(self, x):
            return self.a(x), self.b(x)

    module = Two()
    sg.saved_model.save(module, str(tmp_path / "m"), signatures={"serving_default": X[:2]})
    result = sg.saved_model.load(str(tmp_path / "m")).signatures["serving_default"](X)
    assert sorted(result) == ["output_0", "output_1"]
    assert result["output_1"].shape == (6, 3)


def test_a_keras_model_through_both_apis(tmp_path):
    """The tutorial: ``tf.saved_model.save(model, path)`` of a trained Keras model, and mixing
    APIs: ``model.save`` then ``tf.saved_model.load``; the loaded function predicts as the
    model."""
    model = _keras_model()
    expected = model.module(X)
    sg.saved_model.save(model, str(tmp_path / "low"))
    model.save(str(tmp_path / "high"))
    for path in ("low", "high"):
        loaded = sg.saved_model.load(str(tmp_path / path))
        out = loaded.signatures["serving_default"](X)["output_0"]
        assert torch.allclose(out, expected, atol=1e-6)
    # One directory format: the Keras loader reads what the low-level API wrote.
    again = sg.keras.models.load_model(str(tmp_path / "low"))
    np.testing.assert_allclose(again.predict(X.numpy()), expected.detach().numpy(), atol=1e-6)


def test_load_inside_a_strategy_scope_distributes_and_runs_per_replica(tmp_path):
    """The tutorial: ``with another_strategy.scope(): loaded = tf.saved_model.load(path)``, then
    ``another_strategy.run(inference_func, args=(batch,))`` over a distributed dataset gives
    each replica's dict of outputs."""
    model = _keras_model()
    sg.saved_model.save(model, str(tmp_path / "m"))
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        loaded = sg.saved_model.load(str(tmp_path / "m"))
        inference_func = loaded.signatures[sg.saved_model.DEFAULT_SERVING_SIGNATURE_DEF_KEY]
        assert all(strategy.extended.variable_created_in_scope(v) for v in loaded.variables)
        dataset = sg.data.Dataset.from_tensor_slices(X[:4]).batch(4)
        for batch in strategy.experimental_distribute_dataset(dataset):
            result = strategy.run(inference_func, args=(batch,))
            break
    parts = strategy.experimental_local_results(result["output_0"])
    assert len(parts) == 2
    assert torch.allclose(torch.cat(parts), model.module(X[:4]), atol=1e-6)


def test_save_a_distributed_model_inside_and_outside_its_scope(tmp_path):
    """TF: saving a model built under ``MirroredStrategy`` works in or out of the scope; the
    save is a single copy of the weights, loadable with no strategy."""
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    model = _keras_model(strategy)
    expected = model.module(X)
    with strategy.scope():
        sg.saved_model.save(model, str(tmp_path / "inside"))
        sg.saved_model.save(model.module, str(tmp_path / "module"), signatures=X[:2])
    sg.saved_model.save(model, str(tmp_path / "outside"))
    for path in ("inside", "module", "outside"):
        loaded = sg.saved_model.load(str(tmp_path / path))
        assert torch.allclose(loaded(X), expected, atol=1e-6), path


def test_a_model_whose_function_was_never_traced_has_no_signatures(tmp_path):
    """The tutorial's caveat: ``tf.saved_model.save`` of a model that was never called writes
    a SavedModel without signatures (``x.signatures`` is empty); its variables are saved."""
    module = _module()
    with pytest.warns(UserWarning, match="no torch.export program"):
        sg.saved_model.save(module, str(tmp_path / "m"))
    loaded = sg.saved_model.load(str(tmp_path / "m"))
    assert loaded.signatures == {}
    with pytest.raises(ValueError, match="no function to call"):
        loaded(X)
    saved = loaded.variables
    assert len(saved) == 4
    assert all(any(torch.equal(v, t) for v in saved) for t in module.state_dict().values())


def test_options_take_experimental_io_device_as_tf_does(tmp_path):
    """TF's load_test ``test_load_options``: ``LoadOptions()`` has ``experimental_io_device``
    None, ``LoadOptions(experimental_io_device="/job:localhost")`` keeps it; the tutorial
    passes them to ``model.save``, ``tf.saved_model.save/load`` and ``load_model``."""
    assert sg.saved_model.LoadOptions().experimental_io_device is None
    assert sg.saved_model.SaveOptions().experimental_io_device is None
    save_options = sg.saved_model.SaveOptions(experimental_io_device="/job:localhost")
    load_options = sg.saved_model.LoadOptions(experimental_io_device="/job:localhost")
    assert load_options.experimental_io_device == "/job:localhost"
    model = _keras_model()
    model.save(str(tmp_path / "a"), options=save_options)
    sg.saved_model.save(model, str(tmp_path / "b"), options=save_options)
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        keras_loaded = sg.keras.models.load_model(str(tmp_path / "a"), options=load_options)
        loaded = sg.saved_model.load(str(tmp_path / "b"), options=load_options)
    assert torch.allclose(keras_loaded.module(X), loaded(X), atol=1e-6)
    for device in ("/job:localhost/replica:0/task:0/device:CPU:0", "/cpu:0", "cpu"):
        assert sg.saved_model.LoadOptions(experimental_io_device=device)


@pytest.mark.parametrize(
    ("device", "why"),
    [
        ("/job:worker/task:1", "job 'worker'"),
        ("/job:localhost/device:GPU:0", "a GPU device"),
        ("/job:localhost/task:3", "another replica or task"),
        ("localhost", "cannot parse"),
        ("", "names no device"),
    ],
)
def test_an_io_device_stratagem_cannot_use_is_refused_not_ignored(device, why):
    """Never drop an argument silently: a device elsewhere asks for I/O this process cannot
    route (stratagem reads and writes on the host of the process that saves or loads)."""
    with pytest.raises(ValueError, match=why):
        sg.saved_model.SaveOptions(experimental_io_device=device)
    with pytest.raises(ValueError, match=why):
        sg.saved_model.LoadOptions(experimental_io_device=device)


def test_bad_arguments_are_refused_with_what_was_expected(tmp_path):
    module = _module()
    with pytest.raises(TypeError, match=r"options must be an sg\.saved_model\.SaveOptions"):
        sg.saved_model.save(module, str(tmp_path / "m"), X[:2], options={"io": "x"})
    with pytest.raises(TypeError, match=r"options must be an sg\.saved_model\.SaveOptions"):
        sg.saved_model.save(
            module, str(tmp_path / "m"), X[:2], options=sg.saved_model.LoadOptions()
        )
    with pytest.raises(ValueError, match="one signature"):
        sg.saved_model.save(module, str(tmp_path / "m"), signatures={"predict": X[:2]})
    with pytest.raises(TypeError, match=r"not a tf\.function"):
        sg.saved_model.save(module, str(tmp_path / "m"), signatures=module.forward)
    with pytest.raises(TypeError, match=r"got builtins\.dict"):
        sg.saved_model.save({"w": X}, str(tmp_path / "m"))
    sg.saved_model.save(module, str(tmp_path / "m"), signatures=X[:2])
    for tags in (None, "serve", ["serve"], {"serve"}):
        sg.saved_model.load(str(tmp_path / "m"), tags=tags)
    with pytest.raises(ValueError, match=r"tagged \['serve'\]"):  # TF: no MetaGraph for tags
        sg.saved_model.load(str(tmp_path / "m"), tags=["train"])
    with pytest.raises(TypeError, match="LoadOptions"):
        sg.saved_model.load(str(tmp_path / "m"), options=sg.saved_model.SaveOptions())
    with pytest.raises(FileNotFoundError, match="not a saved model"):  # TF: an OSError
        sg.saved_model.load(str(tmp_path / "nothing"))


# --- loading never unpickles ---------------------------------------------------------------


class _Marker:
    """Unpickling this writes a file: proof that a loader ran code from the archive."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').close()",))


def _program_bytes(tmp_path) -> bytes:
    module = _module()
    sg.saved_model.save(module, str(tmp_path / "good"), signatures=X[:2])
    return (tmp_path / "good" / "program.pt2").read_bytes()


def _rewrite(data: bytes, change) -> bytes:
    """The archive ``data`` with ``change(name, bytes) -> bytes | None`` applied to each file
    (None drops it); ``change("", b"")`` may return extra files as a dict."""
    source = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as target:
        for name in source.namelist():
            content = change(name, source.read(name))
            if content is not None:
                target.writestr(name, content)
        for name, content in (change("", b"") or {}).items():
            target.writestr(name, content)
    return out.getvalue()


def test_a_pickled_weight_in_the_program_is_refused_before_anything_is_unpickled(tmp_path):
    """torch.export.load would ``torch.load(weights_only=False)`` a weight stored with
    ``use_pickle``; stratagem refuses the archive first, and nothing runs."""
    marker = str(tmp_path / "ran")
    evil = pickle.dumps(_Marker(marker))

    def change(name, content):
        if name.endswith("model_weights_config.json"):
            config = json.loads(content)
            first = next(iter(config["config"].values()))
            first["use_pickle"] = True
            return json.dumps(config).encode()
        if name.endswith("data/weights/weight_0"):
            return evil
        return content if name else None

    data = _rewrite(_program_bytes(tmp_path), change)
    with pytest.raises(ProgramError, match="pickled; refusing"):
        load_program(io.BytesIO(data), "program.pt2")
    assert not os.path.exists(marker)
    # Through sg.saved_model.load, from a save directory holding that program.
    (tmp_path / "good" / "program.pt2").write_bytes(data)
    with pytest.raises(sg.train.DamagedSaveError, match=r"program\.pt2"):  # the manifest's check
        sg.saved_model.load(str(tmp_path / "good"))
    # A crafted save whose manifest matches: the program's own check refuses it.
    write_manifest(str(tmp_path / "good"), ["config.json", "model.safetensors", "program.pt2"])
    with pytest.raises(ProgramError):
        sg.saved_model.load(str(tmp_path / "good"))
    assert not os.path.exists(marker)


def test_example_inputs_that_need_unpickling_and_unknown_files_are_refused(tmp_path):
    """torch.export.load retries refused example inputs with ``weights_only=False``, unpickles
    opaque constants, and may load AOTInductor libraries: all refused, naming the file."""
    marker = str(tmp_path / "ran")
    evil = pickle.dumps(_Marker(marker))
    good = _program_bytes(tmp_path)

    def bad_inputs(name, content):
        if "data/sample_inputs/" in name:
            return evil
        return content if name else None

    with pytest.raises(ProgramError, match="weights_only=True"):
        load_program(io.BytesIO(_rewrite(good, bad_inputs)), "program.pt2")
    root = zipfile.ZipFile(io.BytesIO(good)).namelist()[0].split("/")[0]
    for extra in ("data/constants/opaque_obj_0", "data/aotinductor/model/model.so"):

        def add(name, content, extra=extra):
            return {f"{root}/{extra}": evil} if not name else content

        with pytest.raises(ProgramError, match=extra.split("/")[-1]):
            load_program(io.BytesIO(_rewrite(good, add)), "program.pt2")
    assert not os.path.exists(marker)
    # The untouched archive loads.
    assert isinstance(load_program(io.BytesIO(good), "program.pt2"), nn.Module)


# --- a loaded saved model as a trainable layer ----------------------------------------------


def test_a_loaded_saved_model_trains_in_a_new_model_under_another_strategy(tmp_path):
    """The tutorial's ``hub.KerasLayer(loaded, trainable=True)`` inside a ``tf.keras.Model``,
    loaded and built under another strategy's scope, then ``fit``: ``sg.keras.Model(loaded)``. It
    evaluates as the model did before the save; two Mirrored replicas train the loaded
    weights as one process trains the original on the global batches (SGD by hand)."""
    model = _keras_model()
    x = np.random.default_rng(3).normal(size=(16, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    before_save = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    reference = copy.deepcopy(model.module)
    sg.saved_model.save(model, str(tmp_path / "m"))
    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():  # as the tutorial: loaded in the scope, so its weights are mirrored
        loaded = sg.saved_model.load(str(tmp_path / "m"))
        assert isinstance(loaded, nn.Module) and loaded.trainable
        assert all(strategy.extended.variable_created_in_scope(v) for v in loaded.variables)
        wrapped = sg.keras.Model(loaded)
        wrapped.compile(
            sg.keras.optimizers.SGD(0.1),
            sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[sg.metrics.SparseCategoricalAccuracy()],
        )
    again = wrapped.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    assert again == pytest.approx(before_save, rel=1e-6)
    wrapped.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for i in range(0, 16, 8):
        optimizer.zero_grad()
        logits = reference(torch.from_numpy(x[i : i + 8]))
        nn.functional.cross_entropy(logits, torch.from_numpy(y[i : i + 8])).backward()
        optimizer.step()
    trained = dict(loaded.module.named_parameters())
    for name, want in reference.named_parameters():
        torch.testing.assert_close(trained[name], want, rtol=1e-5, atol=1e-6, msg=name)
        assert not torch.equal(want, dict(model.module.named_parameters())[name])  # it moved


def test_trainable_false_freezes_the_loaded_weights(tmp_path):
    """``hub.KerasLayer(loaded, trainable=False)``: the loaded weights are not trained."""
    module = _module()
    sg.saved_model.save(module, str(tmp_path / "m"), signatures=X[:2])
    loaded = sg.saved_model.load(str(tmp_path / "m"))
    loaded.trainable = False
    assert not loaded.trainable and loaded.trainable_variables == []
    assert len(loaded.variables) == 4
    loaded.trainable = True
    assert len(loaded.trainable_variables) == 4
