"""Keras 3's distribution API (``sg.keras.distribution``): its own tests translated, then the
same names running on stratagem's meshes in one process, and no silent replication.

The Keras tests come from ``keras/src/distribution/distribution_lib_test.py`` (Keras 3.15);
each docstring names its source. Keras mocks its backend's process count; here the module's
``num_processes`` and ``list_devices`` are patched the same way. Keras's ``backend.Variable``
is a stand-in with ``path`` and ``shape`` (what ``get_variable_layout`` reads), and an explicit
layout is its ``layout`` attribute (Keras's private ``_layout``).
"""

from __future__ import annotations

import collections
import functools
import re
import types
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist

import stratagem as sg
from cluster_utils import REPO, run_cluster
from stratagem import dtensor
from stratagem.dtensor import UNSHARDED, Layout, LayoutError, MeshError
from stratagem.keras import distribution as distribution_lib
from stratagem.keras.distribution import device_mesh as backend_dlib

pytestmark = pytest.mark.filterwarnings("ignore:DTensor random operators")

EIGHT_CPUS = [f"cpu:{i}" for i in range(8)]


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    """A one-process group (what create_mesh starts alone), ended for the next module."""
    assert not dist.is_initialized()
    yield
    distribution_lib.set_distribution(None)
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def no_distribution_left():
    yield
    distribution_lib.set_distribution(None)


def variable(path: str, value: list) -> types.SimpleNamespace:
    """Keras's ``backend.Variable(initializer=value, name=path)``: what layouts read of it."""
    return types.SimpleNamespace(path=path, shape=tuple(np.shape(value)))


def one_device_mesh(axis_names=("batch", "model")) -> distribution_lib.DeviceMesh:
    return distribution_lib.DeviceMesh((1,) * len(axis_names), list(axis_names), ["cpu:0"])


# --- Keras 3's tests, translated ------------------------------------------------------------


def test_mesh_creation():
    """Keras: DeviceMeshTest.test_mesh_creation."""
    mesh = distribution_lib.DeviceMesh((4, 2), ["batch", "model"], EIGHT_CPUS)
    assert mesh.shape == (4, 2)
    assert mesh.axis_names == ["batch", "model"]
    assert mesh.devices.shape == (4, 2)


def test_mesh_input_validation():
    """Keras: DeviceMeshTest.test_input_validation."""
    devices = [f"cpu:{i}" for i in range(4)]
    with pytest.raises(ValueError, match="Shape and axis_names cannot be empty"):
        distribution_lib.DeviceMesh((4,), "", devices)
    with pytest.raises(ValueError, match="Shape and axis_names should have same size"):
        distribution_lib.DeviceMesh((4, 2), ["batch"], devices)
    with pytest.raises(ValueError, match="Shape does not match the number of devices"):
        distribution_lib.DeviceMesh((4, 2), ["batch", "model"], devices)


@pytest.fixture()
def data_model_mesh():
    return distribution_lib.DeviceMesh((4, 2), ["data", "model"], EIGHT_CPUS)


def test_tensor_layout_creation(data_model_mesh):
    """Keras: TensorLayoutTest.test_tensor_layout_creation."""
    layout = distribution_lib.TensorLayout(("data", None), data_model_mesh)
    assert layout.device_mesh is data_model_mesh
    assert layout.axes == ("data", None)


def test_tensor_layout_validation(data_model_mesh):
    """Keras: TensorLayoutTest.test_tensor_layout_validation."""
    with pytest.raises(ValueError, match="Invalid axis names for Layout"):
        distribution_lib.TensorLayout(("data", "unknown", None), data_model_mesh)


def test_lazy_device_mesh_injection(data_model_mesh):
    """Keras: TensorLayoutTest.test_lazy_device_mesh_injection."""
    layout = distribution_lib.TensorLayout(("data", None), None)
    assert layout.device_mesh is None and layout.axes == ("data", None)
    layout.device_mesh = data_model_mesh
    assert layout.device_mesh is data_model_mesh and layout.axes == ("data", None)
    with pytest.raises(ValueError, match="Cannot override device mesh value"):
        layout.device_mesh = data_model_mesh


def test_lazy_device_mesh_validation(data_model_mesh):
    """Keras: TensorLayoutTest.test_lazy_device_mesh_validation."""
    layout = distribution_lib.TensorLayout(("data", "unknown", None), None)
    assert layout.device_mesh is None and layout.axes == ("data", "unknown", None)
    with pytest.raises(ValueError, match="Invalid axis names for Layout"):
        layout.device_mesh = data_model_mesh


@pytest.fixture()
def batch_model_mesh():
    return distribution_lib.DeviceMesh((4, 2), ["batch", "model"], EIGHT_CPUS)


def test_distribution_init_with_device_mesh(batch_model_mesh):
    """Keras: DistributionTest.test_init_with_device_mesh."""
    distribution = distribution_lib.Distribution(batch_model_mesh)
    assert distribution.device_mesh is batch_model_mesh


def test_distribution_scope_nests_and_restores(batch_model_mesh):
    """Keras: DistributionTest.test_scope."""
    distribution_1 = distribution_lib.Distribution(batch_model_mesh)
    distribution_2 = distribution_lib.Distribution(batch_model_mesh)
    assert distribution_lib.distribution() is None
    with distribution_1.scope():
        assert distribution_lib.distribution() is distribution_1
        with distribution_2.scope():
            assert distribution_lib.distribution() is distribution_2
        assert distribution_lib.distribution() is distribution_1
    assert distribution_lib.distribution() is None


def test_data_shard_id(batch_model_mesh, monkeypatch):
    """Keras: DistributionTest.test_data_shard_id."""
    distribution = distribution_lib.Distribution(batch_model_mesh)
    cls = type(distribution)
    monkeypatch.setattr(cls, "num_processes", property(lambda self: 4))
    monkeypatch.setattr(cls, "num_model_replicas", property(lambda self: 8))
    for process_id in range(4):  # replicas >= processes: the shard is the process
        monkeypatch.setattr(distribution, "_process_id", process_id)
        assert distribution.data_shard_id == process_id
    monkeypatch.setattr(cls, "num_model_replicas", property(lambda self: 2))
    for process_id, expected in enumerate([0, 0, 1, 1]):  # two processes per replica
        monkeypatch.setattr(distribution, "_process_id", process_id)
        assert distribution.data_shard_id == expected


@pytest.fixture()
def data_mesh():
    return distribution_lib.DeviceMesh((8,), ["data"], EIGHT_CPUS)


def test_data_parallel_create_with_device_mesh(data_mesh):
    """Keras: DataParallelDistributionTest.test_create_with_device_mesh."""
    distribution = distribution_lib.DataParallel(device_mesh=data_mesh)
    assert len(distribution.device_mesh.devices) == 8
    assert distribution.device_mesh.axis_names == ["data"]
    assert distribution.batch_dim_name == "data"
    assert not distribution._is_multi_process
    assert distribution._process_id == 0 and distribution.num_processes == 1


def test_data_parallel_create_with_devices():
    """Keras: DataParallelDistributionTest.test_create_with_devices."""
    distribution = distribution_lib.DataParallel(devices=EIGHT_CPUS)
    assert len(distribution.device_mesh.devices) == 8
    assert distribution.device_mesh.axis_names == ["batch"]
    assert distribution.batch_dim_name == "batch"


def test_data_parallel_create_with_list_devices(monkeypatch):
    """Keras: DataParallelDistributionTest.test_create_with_list_devices."""
    calls = []
    monkeypatch.setattr(backend_dlib, "list_devices", lambda *a: calls.append(a) or EIGHT_CPUS)
    distribution = distribution_lib.DataParallel()
    assert calls == [()]
    assert len(distribution.device_mesh.devices) == 8
    assert distribution.device_mesh.axis_names == ["batch"]
    assert distribution.batch_dim_name == "batch"


def test_data_parallel_get_data_layout(data_mesh):
    """Keras: DataParallelDistributionTest.test_get_data_layout."""
    distribution = distribution_lib.DataParallel(device_mesh=data_mesh)
    data_layout = distribution.get_data_layout(np.arange(16).reshape((4, 2, 2)).shape)
    assert data_layout.device_mesh is data_mesh
    assert data_layout.axes == ("data", None, None)


def test_data_parallel_get_variable_layout(data_mesh):
    """Keras: DataParallelDistributionTest.test_get_variable_layout and
    test_get_variable_layout_with_explicit_layout."""
    distribution = distribution_lib.DataParallel(device_mesh=data_mesh)
    weight = variable("kernel", [1.0, 2.0, 3.0])
    layout = distribution.get_variable_layout(weight)
    assert layout.device_mesh is data_mesh and layout.axes == (None,)
    explicit_mesh = distribution_lib.DeviceMesh((8,), ["x"], EIGHT_CPUS)
    weight.layout = distribution_lib.TensorLayout(["x"], explicit_mesh)
    layout = distribution.get_variable_layout(weight)
    assert layout.device_mesh is explicit_mesh and layout.axes == ("x",)


def test_data_parallel_num_model_replicas_and_tensor_layout(data_mesh, monkeypatch):
    """Keras: DataParallelDistributionTest.test_num_model_replicas and
    test_get_tensor_layout."""
    monkeypatch.setattr(backend_dlib, "num_processes", lambda: 2)
    distribution = distribution_lib.DataParallel(device_mesh=data_mesh)
    assert distribution.num_model_replicas == 8 and distribution.num_processes == 2
    assert distribution.get_tensor_layout("path/to/tensor") is None


@pytest.fixture()
def two_by_four():
    return distribution_lib.DeviceMesh((2, 4), ["data", "model"], EIGHT_CPUS)


def test_model_parallel_distribute_weights(two_by_four):
    """Keras: ModelParallelDistributionTest.test_distribute_weights."""
    layout_map = distribution_lib.LayoutMap(two_by_four)
    layout_map[".*kernel"] = distribution_lib.TensorLayout([None, "model"])
    layout_map[".*bias"] = distribution_lib.TensorLayout(["model"])
    distribution = distribution_lib.ModelParallel(layout_map=layout_map, batch_dim_name="data")
    kernel = distribution.get_variable_layout(variable("kernel", np.zeros((8, 4))))
    assert kernel.device_mesh is two_by_four and kernel.axes == (None, "model")
    bias = distribution.get_variable_layout(variable("bias", np.arange(4)))
    assert bias.device_mesh is two_by_four and bias.axes == ("model",)
    seed = distribution.get_variable_layout(variable("seed", [0, 1]))
    assert seed.device_mesh is two_by_four and seed.axes == (None,)


def test_model_parallel_distribute_data(two_by_four):
    """Keras: ModelParallelDistributionTest.test_distribute_data."""
    distribution = distribution_lib.ModelParallel(
        layout_map=distribution_lib.LayoutMap(two_by_four), batch_dim_name="data"
    )
    data_layout = distribution.get_data_layout((4, 2, 2))
    assert data_layout.device_mesh is two_by_four
    assert data_layout.axes == ("data", None, None)


def test_model_parallel_get_tensor_layout(two_by_four):
    """Keras: ModelParallelDistributionTest.test_get_tensor_layout."""
    layout_map = distribution_lib.LayoutMap(two_by_four)
    layout_map[".*kernel"] = distribution_lib.TensorLayout([None, "model"])
    layout_map[".*bias"] = distribution_lib.TensorLayout(["model"])
    layout_map["/model/layer/tensor"] = ("data", None)
    distribution = distribution_lib.ModelParallel(layout_map=layout_map, batch_dim_name="data")
    layout = distribution.get_tensor_layout("/model/layer/tensor")
    assert layout.device_mesh is two_by_four and layout.axes == ("data", None)
    assert distribution.get_tensor_layout("/model/layer/other_tensor") is None


def test_model_parallel_explicit_layout_wins(two_by_four):
    """Keras: ModelParallelDistributionTest.test_get_variable_layout_with_explicit_layout."""
    layout_map = distribution_lib.LayoutMap(two_by_four)
    layout_map[".*kernel"] = distribution_lib.TensorLayout([None, "model"])
    distribution = distribution_lib.ModelParallel(layout_map=layout_map, batch_dim_name="data")
    explicit_mesh = distribution_lib.DeviceMesh((8,), ["x"], EIGHT_CPUS)
    kernel = variable("kernel", [1, 2, 3])
    kernel.layout = distribution_lib.TensorLayout(["x"], explicit_mesh)
    layout = distribution.get_variable_layout(kernel)
    assert layout.device_mesh is explicit_mesh and layout.axes == ("x",)


def test_model_parallel_processes_and_replicas(monkeypatch):
    """Keras: ModelParallelDistributionTest.test_num_processes_validation and
    test_num_model_replicas."""
    monkeypatch.setattr(backend_dlib, "num_processes", lambda: 4)
    three_by_two = distribution_lib.DeviceMesh((3, 2), ["data", "model"], EIGHT_CPUS[:6])
    with pytest.raises(ValueError, match="`num_processes` must be divisible by"):
        distribution_lib.ModelParallel(
            layout_map=distribution_lib.LayoutMap(three_by_two),
            batch_dim_name="data",
            auto_shard_dataset=True,
        )
    monkeypatch.setattr(backend_dlib, "num_processes", lambda: 2)
    four_by_two = distribution_lib.DeviceMesh((4, 2), ["data", "model"], EIGHT_CPUS)
    distribution = distribution_lib.ModelParallel(
        layout_map=distribution_lib.LayoutMap(four_by_two), batch_dim_name="data"
    )
    assert distribution.num_model_replicas == 4 and distribution.num_processes == 2


@pytest.fixture()
def keras_layouts(data_model_mesh):
    tl = distribution_lib.TensorLayout
    return {
        "mesh": data_model_mesh,
        "sharded_2d": tl([None, "model"]),
        "sharded_1d": tl(["model"]),
        "replicated_2d": tl([None, None]),
        "replicated_1d": tl([None]),
    }


def test_layout_map_add(keras_layouts):
    """Keras: LayoutMapTest.test_add."""
    mesh, sharded_2d, sharded_1d = (keras_layouts[k] for k in ("mesh", "sharded_2d", "sharded_1d"))
    layout_map = distribution_lib.LayoutMap(mesh)
    layout_map["dense/kernel"] = sharded_2d
    layout_map["dense/bias"] = sharded_1d
    layout_map["conv/bias"] = ("model",)  # a tuple is a TensorLayout on the map's mesh
    assert len(layout_map) == 3
    kernel = layout_map["dense/kernel"]
    assert kernel.axes == (None, "model") and kernel.device_mesh is mesh
    bias = layout_map["dense/bias"]
    assert bias.axes == ("model",) and bias.device_mesh is mesh
    conv_bias = layout_map["conv/bias"]
    assert conv_bias.axes == ("model",) and conv_bias.device_mesh is mesh
    with pytest.raises(ValueError, match="dense/kernel already exist"):
        layout_map["dense/kernel"] = sharded_2d
    with pytest.raises(ValueError, match="should be a TensorLayout"):
        layout_map["conv.kernel"] = ["a", "b"]


def test_layout_map_get_fully_matches_and_refuses_two_keys(keras_layouts):
    """Keras: LayoutMapTest.test_get (Keras 3.14's re.fullmatch rule)."""
    k = keras_layouts
    layout_map = distribution_lib.LayoutMap(k["mesh"])
    layout_map["dense/kernel"] = k["sharded_2d"]
    layout_map["dense/bias"] = k["sharded_1d"]
    layout_map[".*dense.*kernel"] = k["replicated_2d"]
    layout_map[".*dense.*bias"] = k["replicated_1d"]
    layout_map[".*bias"] = k["sharded_1d"]
    assert layout_map["dense/kernel"] is k["sharded_2d"]  # an exact key wins
    assert layout_map["dense/bias"] is k["sharded_1d"]
    assert layout_map["dense_2/kernel"] is k["replicated_2d"]
    with pytest.raises(ValueError, match="Path 'dense_2/bias' matches multiple layout"):
        layout_map["dense_2/bias"]
    assert layout_map["conv2d/kernel"] is None
    assert layout_map["conv2d/bias"] is k["sharded_1d"]
    # Full matches, not searches: "bias" alone would be found in "conv2d/bias" by re.search.
    partial = distribution_lib.LayoutMap(k["mesh"])
    partial["bias"] = k["sharded_1d"]
    assert partial["conv2d/bias"] is None


def test_layout_map_delete_len_and_iter(keras_layouts):
    """Keras: LayoutMapTest.test_delete, test_len and test_iter."""
    k = keras_layouts
    layout_map = distribution_lib.LayoutMap(k["mesh"])
    assert len(layout_map) == 0
    layout_map["dense/kernel"] = k["sharded_2d"]
    layout_map["dense/bias"] = k["sharded_1d"]
    assert len(layout_map) == 2
    assert list(layout_map.keys()) == ["dense/kernel", "dense/bias"]  # insertion order
    assert list(layout_map.values()) == [k["sharded_2d"], k["sharded_1d"]]
    assert layout_map.pop("dense/kernel") is k["sharded_2d"]
    with pytest.raises(KeyError):
        layout_map.pop(".*bias")  # pop takes exact keys, not regexes
    del layout_map["dense/bias"]
    assert len(layout_map) == 0


# --- on stratagem's meshes, one process -----------------------------------------------------


def test_list_devices_names_one_device_per_process():
    """Keras 3's PyTorch backend: a device is a process ("cpu:0" alone, as list_devices gives)."""
    assert distribution_lib.list_devices() == ["cpu:0"]
    assert distribution_lib.list_devices("cpu") == ["cpu:0"]
    assert distribution_lib.get_device_count("cpu") == 1
    if not torch.cuda.is_available():
        assert distribution_lib.list_devices("gpu") == []


def test_a_mesh_of_more_devices_than_processes_is_refused_when_used():
    """A DeviceMesh is data; its backend mesh needs one process per device."""
    mesh = distribution_lib.DeviceMesh((4, 2), ["batch", "model"], EIGHT_CPUS)
    with pytest.raises(MeshError, match="the mesh has 8 devices but this job has 1 process"):
        _ = mesh.backend_mesh
    shuffled = distribution_lib.DeviceMesh((2,), ["batch"], ["cpu:1", "cpu:0"])
    with pytest.raises(MeshError, match="not in rank order"):
        _ = shuffled.backend_mesh


def build_mlp() -> torch.nn.Sequential:
    """The seed's digits MLP, its layers named as the seed's Keras layers."""
    return torch.nn.Sequential(
        collections.OrderedDict(
            flatten=torch.nn.Flatten(),
            d1=torch.nn.Linear(28 * 28, 32),
            relu=torch.nn.ReLU(),
            d2=torch.nn.Linear(32, 10),
        )
    )


def keras_tensor_parallel_map(mesh: distribution_lib.DeviceMesh) -> distribution_lib.LayoutMap:
    layout_map = distribution_lib.LayoutMap(mesh)
    layout_map["d1/weight"] = ("model", None)  # column-wise: torch's Linear weight is (out, in)
    layout_map["d1/bias"] = ("model",)
    layout_map["d2/weight"] = (None, "model")  # row-wise
    return layout_map


def test_set_distribution_lays_out_models_built_after_it():
    """ModelParallel's map lays a torch model out as sg.dtensor's map with the same layouts
    does; set_distribution enters the mesh strategy's scope, and None leaves it."""
    mesh = one_device_mesh()
    layout_map = keras_tensor_parallel_map(mesh)
    distribution = distribution_lib.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    distribution_lib.set_distribution(distribution)
    assert distribution_lib.distribution() is distribution
    assert sg.distribute.get_strategy() is distribution.strategy
    assert isinstance(distribution.strategy, sg.distribute.experimental.MeshStrategy)
    model = sg.keras.Model(build_mlp())
    backend = mesh.backend_mesh
    assert model.module.d1.weight.layout == Layout(["model", UNSHARDED], backend)
    assert model.module.d1.bias.layout == Layout(["model"], backend)
    assert model.module.d2.weight.layout == Layout([UNSHARDED, "model"], backend)
    assert model.module.d2.bias.layout == Layout.replicated(backend, 1)
    # As Keras reads its map at each variable's creation, an edit applies to later models.
    layout_map["d2/bias"] = ("model",)
    assert sg.keras.Model(build_mlp()).module.d2.bias.layout == Layout(["model"], backend)
    distribution_lib.set_distribution(None)
    assert distribution_lib.distribution() is None
    assert not sg.distribute.has_strategy()


def test_distribute_tensor_lays_out_and_relays():
    """``distribute_tensor(tensor, layout)``: the backend layout, values kept."""
    mesh = one_device_mesh()
    full = torch.arange(12.0).reshape(4, 3)
    by_rows = distribution_lib.distribute_tensor(
        full, distribution_lib.TensorLayout(("batch", None), mesh)
    )
    assert dtensor.fetch_layout(by_rows) == Layout(["batch", UNSHARDED], mesh.backend_mesh)
    by_columns = distribution_lib.distribute_tensor(
        by_rows, distribution_lib.TensorLayout((None, "model"), mesh)
    )
    assert dtensor.fetch_layout(by_columns) == Layout([UNSHARDED, "model"], mesh.backend_mesh)
    assert torch.equal(by_columns.full_tensor(), full)


@functools.cache
def digits() -> tuple:
    (x_train, y_train), (x_test, y_test) = sg.data.datasets.load_digits(image_size=28)
    return (x_train.astype(np.float32) / 255.0, y_train), (
        x_test.astype(np.float32) / 255.0,
        y_test,
    )


def fit_digits(strategy_scope, seed: int = 7) -> tuple[float, dict[str, torch.Tensor], dict]:
    """One epoch of the seed's Model.fit on digits under ``strategy_scope``: test accuracy, the
    trained weights and their layouts (None where not on a mesh)."""
    (x_train, y_train), (x_test, y_test) = digits()
    torch.manual_seed(seed)
    with strategy_scope():
        model = sg.keras.Model(build_mlp())
        model.compile(
            optimizer=sg.keras.optimizers.Adam(learning_rate=0.01),
            loss=sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    model.fit(x_train, y_train, batch_size=128, epochs=1, verbose=0)
    _, accuracy = model.evaluate(x_test, y_test, batch_size=128, verbose=0)
    weights = {
        name: (p.full_tensor() if isinstance(p, dtensor.DTensor) else p).detach().clone()
        for name, p in model.module.named_parameters()
    }
    layouts = {
        name: dtensor.fetch_layout(p) if isinstance(p, dtensor.DTensor) else None
        for name, p in model.module.named_parameters()
    }
    return accuracy, weights, layouts


def test_the_seed_fit_with_keras3_names_trains_as_with_ours():
    """The seed's tensor-parallel Model.fit written with Keras 3's names (ModelParallel over a
    LayoutMap of tuples) trains to the accuracy and the weights of sg.dtensor's MeshStrategy
    with the same layouts, and of one process without any strategy."""
    keras_mesh = one_device_mesh()
    ours_mesh = keras_mesh.backend_mesh
    ours_map = dtensor.LayoutMap(ours_mesh)
    ours_map["d1.weight"] = Layout(["model", UNSHARDED], ours_mesh)
    ours_map["d1.bias"] = Layout(["model"], ours_mesh)
    ours_map["d2.weight"] = Layout([UNSHARDED, "model"], ours_mesh)
    ours = sg.distribute.experimental.MeshStrategy(ours_mesh, ours_map, batch_dim_name="batch")
    keras = distribution_lib.ModelParallel(
        layout_map=keras_tensor_parallel_map(keras_mesh), batch_dim_name="batch"
    )
    ours_accuracy, ours_weights, ours_layouts = fit_digits(ours.scope)
    keras_accuracy, keras_weights, keras_layouts = fit_digits(keras.scope)
    plain_accuracy, plain_weights, _ = fit_digits(sg.distribute.get_strategy().scope)
    assert keras_layouts == ours_layouts  # the same layouts, on the mesh
    assert keras_layouts["d1.weight"] == Layout(["model", UNSHARDED], ours_mesh)
    assert keras_accuracy == ours_accuracy
    assert abs(keras_accuracy - plain_accuracy) < 1e-6, (keras_accuracy, plain_accuracy)
    assert keras_accuracy > 0.8, keras_accuracy  # it learnt: one epoch, 10 classes
    for name, weight in keras_weights.items():
        torch.testing.assert_close(weight, ours_weights[name], rtol=0, atol=0)
        torch.testing.assert_close(weight, plain_weights[name], rtol=1e-5, atol=1e-6)


# --- no silent replication --------------------------------------------------------------------


def test_a_large_weight_no_key_matches_is_named_and_strict_refuses_it():
    """sg.dtensor.LayoutMap: a weight at or above large_weight_size that no key matches is
    named in a warning (once), an error with strict=True (the model left as it was); a key
    with a replicated layout says it is meant; an empty map (data parallelism) says nothing."""
    mesh = one_device_mesh().backend_mesh
    layout_map = dtensor.LayoutMap(mesh, large_weight_size=1000)
    layout_map["d1.weight"] = Layout(["model", UNSHARDED], mesh)  # 32 × 784: matched
    model = torch.nn.Sequential(
        collections.OrderedDict(d1=torch.nn.Linear(784, 32), renamed=torch.nn.Linear(32, 40))
    )
    with pytest.warns(UserWarning, match="large_weight_size") as said:
        layout_map.apply(model)
    (warning,) = [w for w in said if "replicated whole" in str(w.message)]
    assert "'renamed.weight' (parameter, shape [40, 32], 1280 elements)" in str(warning.message)
    assert "d1.weight" not in str(warning.message).split(":", 1)[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layout_map.apply(torch.nn.Sequential(collections.OrderedDict(d1=model.d1)))
        layout_map.apply(model)  # said once
        dtensor.LayoutMap(mesh, large_weight_size=1000).apply(build_mlp())  # empty map
        meant = dtensor.LayoutMap(mesh, large_weight_size=1000)
        meant["d1.weight"] = Layout(["model", UNSHARDED], mesh)
        meant["d2.weight"] = Layout.replicated(mesh, 2)  # 10 × 32: small; a key all the same
        meant.apply(build_mlp())
    strict = dtensor.LayoutMap(mesh, strict=True, large_weight_size=1000)
    strict["d1.weight"] = Layout(["model", UNSHARDED], mesh)
    fresh = torch.nn.Sequential(
        collections.OrderedDict(d1=torch.nn.Linear(784, 32), renamed=torch.nn.Linear(32, 40))
    )
    with pytest.raises(LayoutError, match=r"'renamed.weight'.*\(strict=True\)"):
        strict.apply(fresh)
    assert not isinstance(fresh.d1.weight, dtensor.DTensor)  # refused before any change
    strict["dense.kernel"] = Layout([UNSHARDED, "model"], mesh)  # Keras's name for weight
    with pytest.raises(LayoutError, match=r"keys \['dense.kernel'\] match none"):
        strict.apply(torch.nn.Sequential(collections.OrderedDict(d1=torch.nn.Linear(4, 4))))


def test_keras3_layout_map_names_silent_replication_too():
    """Keras 3's LayoutMap (strict=, large_weight_size=): a renamed layer's large weight is
    named, as a key that matches no weight is, and strict=True refuses both."""
    mesh = one_device_mesh()
    layout_map = distribution_lib.LayoutMap(mesh, large_weight_size=1000)
    layout_map["d1/weight"] = ("model", None)
    layout_map[".*dense.*kernel"] = (None, "model")  # Keras's names: match no torch weight
    distribution = distribution_lib.ModelParallel(layout_map=layout_map)
    with pytest.warns(UserWarning) as said, distribution.scope():
        sg.keras.Model(build_mlp())
    messages = " ".join(str(w.message) for w in said)
    assert "LayoutMap keys ['.*dense.*kernel'] match none" in messages, messages
    assert "'d2.weight' (parameter, shape [10, 32], 320 elements)" not in messages  # small
    strict = distribution_lib.LayoutMap(mesh, strict=True, large_weight_size=300)
    strict["d1/weight"] = ("model", None)
    distribution = distribution_lib.ModelParallel(layout_map=strict)
    expected = r"'d2.weight' \(parameter, shape \[10, 32\], 320"
    with pytest.raises(LayoutError, match=expected), distribution.scope():
        sg.keras.Model(build_mlp())


# --- on 2 processes ---------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_the_keras3_example_on_two_processes_trains_as_meshstrategy_does(tmp_path):
    """examples/keras3_distribution.py on 2 processes (a (1, 2) mesh from list_devices): the
    seed's model, tensor-parallel with Keras 3's names, holds half of d1 on each process and
    reaches the test accuracy of the same model under sg.dtensor's MeshStrategy."""
    example = REPO / "examples" / "keras3_distribution.py"
    results = run_cluster(example, 2, tmp_path, args=["--epochs", "1"], timeout=240)
    for i, result in enumerate(results):
        result.check(f"worker {i}")
    found = dict(
        re.findall(
            r"(Keras 3 ModelParallel|sg.dtensor MeshStrategy): d1.weight local shape "
            r"\(64, 784\), test accuracy: ([0-9.]+)",
            results[0].stdout,
        )
    )
    assert set(found) == {"Keras 3 ModelParallel", "sg.dtensor MeshStrategy"}, results[0].stdout
    assert found["Keras 3 ModelParallel"] == found["sg.dtensor MeshStrategy"]
    assert float(found["Keras 3 ModelParallel"]) > 0.5  # it learnt (chance is 0.1)
    assert results[1].stdout == ""  # only rank 0 prints
