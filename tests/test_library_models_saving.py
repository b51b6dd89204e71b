"""Models from a library save and load as they came: ``model.save`` records the module's class
and its own config, ``load_model`` rebuilds it by its class, as Keras rebuilds registered
classes (Keras 3 ``saving/object_registration.py``, ``serialization_lib.py``): only a class
registered by the user, given in ``custom_objects`` or from a package the user allowed; nothing
is imported by a name the file chose, and a refused class is a named error saying how to allow
it. A save that will need such help says so when it is written."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import stratagem as sg
from cluster_utils import WORKERS, run_cluster
from stratagem.train.manifest import write_manifest

transformers = pytest.importorskip("transformers", reason="pip install -c constraints.txt .[test]")
from real_models import hf_models  # noqa: E402  (after the skip: it imports transformers)

saving = sg.keras.saving


class Net(nn.Module):
    """A user's module that describes itself as Keras layers do (``get_config``)."""

    def __init__(self, hidden: int = 8, rate: float = 0.5) -> None:
        super().__init__()
        self.hidden, self.rate = hidden, rate
        self.body = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Dropout(rate))
        self.head = nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def get_config(self) -> dict:
        return {"hidden": self.hidden, "rate": self.rate}


@pytest.fixture
def registered():
    """Registrations made in a test are undone after it (the registry is process-wide)."""
    registry = saving.get_custom_objects()
    before = dict(registry)
    yield saving.register_keras_serializable
    registry.clear()
    registry.update(before)


X = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
Y = torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(1))


def _fitted(module: nn.Module, x, y, **compile_args) -> sg.keras.Model:
    model = sg.keras.Model(module)
    model.compile(optimizer="adamw", **compile_args)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    return model


def test_registered_names_are_kerass():
    """Keras's ``object_registration_test``: ``test_serialize_custom_class_with_default_name``
    and ``..._with_custom_name``: ``"Custom>Class"`` by default, ``"package>name"`` given; a
    class that cannot describe itself is refused at registration."""
    registry = saving.get_custom_objects()
    before = dict(registry)
    try:

        @saving.register_keras_serializable()
        class TestClass(Net):
            pass

        @saving.register_keras_serializable("TestPackage", "CustomName")
        class OtherTestClass(Net):
            pass

        assert saving.get_registered_name(TestClass) == "Custom>TestClass"
        assert saving.get_registered_object("Custom>TestClass") is TestClass
        assert saving.get_registered_name(OtherTestClass) == "TestPackage>CustomName"
        assert saving.get_registered_object("TestPackage>CustomName") is OtherTestClass
        assert saving.get_registered_name(nn.Linear) == "Linear"  # not registered: its name
        with pytest.raises(ValueError, match="get_config"):
            saving.register_keras_serializable()(nn.Linear)
    finally:
        registry.clear()
        registry.update(before)


def test_a_registered_class_is_rebuilt_from_its_config_with_its_training_behaviour(
    tmp_path, registered
):
    registered("MyApp")(Net)
    model = _fitted(Net(hidden=6, rate=0.5), X, Y, loss="sparse_categorical_crossentropy")
    path = model.save(str(tmp_path / "m"))
    loaded = sg.keras.models.load_model(path)
    assert type(loaded.module) is Net and loaded.module.hidden == 6
    np.testing.assert_allclose(loaded.predict(X), model.predict(X), rtol=1e-6, atol=1e-6)
    # The class, not the program: dropout acts in training, which an exported program froze.
    outs = [loaded(X, training=True) for _ in range(2)]
    assert not torch.equal(outs[0], outs[1])
    assert json.loads((Path(path) / "config.json").read_text())["rebuild"]["registered_name"] == (
        "MyApp>Net"
    )


def _planted(tmp_path, monkeypatch, registered) -> tuple[str, Path]:
    """A save whose config names ``h4planted.Net`` (a package that marks its import) and that
    has no program to fall back on, its manifest rewritten to match."""
    package = tmp_path / "lib" / "h4planted"
    package.mkdir(parents=True)
    marker = tmp_path / "imported"
    (package / "__init__.py").write_text(f"import torch\n\nopen({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    registered()(Net)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no example input, no program; registered: no warning
        sg.saved_model.save(Net(), str(tmp_path / "m"))
    saving.get_custom_objects().pop("Custom>Net")
    _rename(str(tmp_path / "m"), "h4planted.Net")
    return str(tmp_path / "m"), marker


def _rename(path: str, name: str) -> None:
    """The save at ``path`` naming the class ``name``, its manifest rewritten to match."""
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text())
    config["rebuild"].update({"class": name, "registered_name": None})
    config_file.write_text(json.dumps(config))
    write_manifest(path, ["config.json", "model.safetensors"])


def test_a_class_neither_registered_nor_allowed_is_a_named_error_and_nothing_is_imported(
    tmp_path, monkeypatch, registered
):
    path, marker = _planted(tmp_path, monkeypatch, registered)
    with pytest.raises(saving.UnregisteredClassError, match=r"allow_packages=\('h4planted',\)"):
        sg.keras.models.load_model(path)
    assert not marker.exists()
    # custom_objects (Keras's argument) names the class: rebuilt, still nothing imported.
    loaded = sg.keras.models.load_model(path, custom_objects={"Net": Net})
    assert type(loaded.module) is Net and not marker.exists()
    # Allowed, the package is imported (and holds no such module class: a named error).
    with pytest.raises(saving.UnregisteredClassError, match="defined in the package"):
        sg.keras.models.load_model(path, allow_packages=("h4planted",))
    assert marker.exists()
    # Allowed packages bound what a file may name: not a class another package defines and
    # the allowed one merely reaches (here torch's, through ``h4planted.torch``).
    _rename(path, "h4planted.torch.nn.Linear")
    with pytest.raises(saving.UnregisteredClassError, match="defined in the package"):
        sg.keras.models.load_model(path, allow_packages=("h4planted",))
    with pytest.raises(ValueError, match="top-level package names"):
        sg.keras.models.load_model(path, allow_packages=("h4planted.sub",))


def test_a_save_that_needs_help_to_load_says_so_when_written(tmp_path):
    """GPT-2's default config returns a cache object, which torch.export cannot carry: the
    program leaves that output out and records it; unregistered, the save warns what loading
    it as it came will need. Without that help load_model gives the program (as TF revives a
    model from its functions when its class is unknown), logits and no cache; with it, the
    class and its whole output. A module with neither program nor config: only module=."""
    gpt2 = sg.keras.Model(hf_models.gpt2())
    ids = hf_models.tokens(2)
    expected = gpt2(ids)
    assert not isinstance(expected["cache"], torch.Tensor)
    with pytest.warns(UserWarning, match=r"leaves out the outputs \['cache'\].*allow_packages"):
        path = gpt2.save(str(tmp_path / "gpt2"))
    config = json.loads((Path(path) / "config.json").read_text())
    assert config["program"] and config["program_outputs_left_out"] == ["cache"]
    program = sg.keras.models.load_model(path)(ids)
    assert list(program) == ["logits"]
    torch.testing.assert_close(program["logits"], expected["logits"])
    signature = sg.saved_model.load(path).signatures["serving_default"]
    torch.testing.assert_close(signature(ids)["logits"], expected["logits"])
    loaded = sg.keras.models.load_model(path, allow_packages=("transformers",))
    assert type(loaded.module) is transformers.GPT2LMHeadModel
    assert list(loaded(ids)) == list(expected)
    plain = nn.Sequential(nn.Linear(4, 2))  # never called: no program, and no config
    with pytest.warns(UserWarning, match=r"no torch.export program.*no config.*module="):
        sg.saved_model.save(plain, str(tmp_path / "plain"))
    with pytest.warns(UserWarning, match=r"no torch.export program.*allow_packages"):
        sg.saved_model.save(Net(), str(tmp_path / "net"))  # unregistered, never called
    with pytest.raises(saving.UnregisteredClassError, match=r"custom_objects=\{'Net': Net\}"):
        sg.keras.models.load_model(str(tmp_path / "net"))


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_a_hugging_face_model_fits_saves_and_loads_as_it_came(tmp_path, registered, name):
    """GPT-2 (default config: tied embeddings, a cache in its output), BERT and a Llama-style
    decoder: fit, save, ``load_model(path)`` with no other argument (the user registered the
    class), equal predictions, on the saved sequence length and another, and the loaded model
    trains on."""
    build = getattr(hf_models, name)
    registered("transformers")(type(build()))
    x = hf_models.tokens(8)
    y = hf_models.labels(8, 3) if name == "bert" else x
    model = _fitted(build(), x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # registered: loads without help, nothing to say
        path = model.save(str(tmp_path / name))
    loaded = sg.keras.models.load_model(path)
    assert type(loaded.module) is type(model.module)
    for inputs in (x, hf_models.tokens(3, seed=9, seq=11)):
        np.testing.assert_allclose(
            loaded.predict(inputs), model.predict(inputs), rtol=1e-5, atol=1e-6
        )
    if name == "gpt2":
        assert loaded.module.lm_head.weight is loaded.module.transformer.wte.weight
    before = [p.detach().clone() for p in loaded.module.parameters()]
    loaded.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert all(not torch.equal(b, p) for b, p in zip(before, loaded.module.parameters()))


@pytest.mark.multiprocess
def test_gpt2_trained_under_multi_worker_mirrored_saves_and_loads_as_it_came(tmp_path):
    """Two processes fit GPT-2 (default config) under MultiWorkerMirroredStrategy, save it,
    and each loads it back by its class; here, one process loads the same save: every load
    predicts as the trained model."""
    results = run_cluster(WORKERS / "library_saving_checks.py", 2, tmp_path, args=[str(tmp_path)])
    for i, result in enumerate(results):
        result.check(f"worker {i}")
    chief, worker = (torch.load(tmp_path / f"worker{i}.pt", weights_only=True) for i in (0, 1))
    here = sg.keras.models.load_model(str(tmp_path / "gpt2"), allow_packages=("transformers",))
    assert type(here.module) is transformers.GPT2LMHeadModel
    predicted = torch.from_numpy(here.predict(hf_models.tokens(8, seed=30)))
    for got in (chief["loaded"], worker["loaded"], predicted):
        torch.testing.assert_close(got, chief["trained"], rtol=1e-5, atol=1e-6)
