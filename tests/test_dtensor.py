"""sg.dtensor in one process: layouts as data, LayoutMap, the clear errors, a one-device mesh.

A process alone gets a one-process group from create_mesh, so everything here runs the real
DTensor code path; the multi-process behaviour is test_dtensor_multiprocess.py.
"""

from __future__ import annotations

import collections
import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from stratagem import dtensor
from stratagem.dtensor import UNSHARDED, Layout, LayoutError, LayoutMap, MeshError

pytestmark = pytest.mark.filterwarnings("ignore:DTensor random operators")


@pytest.fixture(scope="module")
def mesh():
    assert not dist.is_initialized()
    mesh = dtensor.create_mesh([("batch", 1), ("model", 1)], devices=["CPU:0"])
    yield mesh
    # Other test modules start their own process groups in this interpreter.
    dist.destroy_process_group()


class SubclassedModel(torch.nn.Module):
    """The seed's subclassed model with torch layers."""

    def __init__(self) -> None:
        super().__init__()
        self.feature = torch.nn.Linear(16, 16)
        self.feature_2 = torch.nn.Linear(16, 24)
        self.dropout = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.feature_2(self.dropout(self.feature(x)))


def seed_layout_map(mesh) -> LayoutMap:
    layout_map = LayoutMap(mesh)
    layout_map["feature.*weight"] = Layout.inner_sharded(mesh, "batch", rank=2)
    layout_map["feature.*bias"] = Layout.batch_sharded(mesh, "batch", rank=1)
    return layout_map


def test_a_mesh_names_its_dimensions(mesh):
    assert mesh.dim_names == ("batch", "model")
    assert mesh.shape == (1, 1) and mesh.size == 1
    assert mesh.dim_size("model") == 1 and mesh.coordinate("batch") == 0
    assert mesh.num_local_devices() == 1 and mesh.device_type == "cpu"
    assert repr(mesh) == "Mesh(|batch=1|model=1|, device_type='cpu')"
    assert mesh.device_mesh.mesh_dim_names == ("batch", "model")


def test_layouts_are_data_with_equality_and_a_readable_repr(mesh):
    assert Layout.replicated(mesh, rank=2) == Layout([UNSHARDED, UNSHARDED], mesh)
    assert Layout.batch_sharded(mesh, "batch", rank=3) == Layout(
        ["batch", UNSHARDED, UNSHARDED], mesh
    )
    assert Layout.inner_sharded(mesh, "model", rank=2) == Layout([UNSHARDED, "model"], mesh)
    assert Layout(["batch", "model"], mesh) != Layout(["model", "batch"], mesh)
    assert len({Layout.replicated(mesh, 1), Layout([UNSHARDED], mesh)}) == 1
    layout = Layout(["batch", UNSHARDED], mesh)
    assert layout.rank == 2 and layout.sharding_specs == ["batch", UNSHARDED]
    assert (
        repr(layout) == "Layout.from_string(sharding_specs:batch,unsharded, mesh:|batch=1|model=1|)"
    )


def test_the_translation_to_placements_is_one_per_mesh_dimension(mesh):
    from stratagem.dtensor.translate import placements

    assert placements(Layout(["model", UNSHARDED], mesh)) == (Replicate(), Shard(0))
    assert placements(Layout([UNSHARDED, "batch"], mesh)) == (Shard(1), Replicate())
    assert placements(Layout.replicated(mesh, 3)) == (Replicate(), Replicate())


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (
            lambda m: Layout(["batch", "replica"], m),
            r"no dimension 'replica'.*\['batch', 'model'\]",
        ),
        (lambda m: Layout(["batch", "batch"], m), "'batch' shards more than one tensor dimension"),
        (lambda m: Layout([0, UNSHARDED], m), "spec 0 is a int"),
        (lambda m: Layout("batch", m), "expected a list"),
        (lambda m: Layout.batch_sharded(m, "batch", rank=0), r"rank=0; expected an integer >= 1"),
        (lambda m: Layout.replicated(m, rank=-1), "rank=-1"),
    ],
)
def test_bad_layouts_say_what_was_expected(mesh, make, expected):
    with pytest.raises(LayoutError, match=expected):
        make(mesh)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"mesh_dims": [("batch", 2)]}, r"2 devices but this job has 1 process"),
        ({"mesh_dims": [("batch", 4), ("model", 2)]}, r"8 devices but this job has 1 process"),
        ({"mesh_dims": [("batch", 0)]}, "bad mesh dimension"),
        ({"mesh_dims": [("batch", 1), ("batch", 1)]}, "'batch' appears twice"),
        ({"mesh_dims": "batch"}, "expected a list of"),
        ({"mesh_dims": [("batch", 1)], "devices": ["CPU:0", "CPU:1"]}, "2 devices given"),
        ({"mesh_dims": [("batch", 1)], "devices": ["TPU:0"]}, "'TPU:0' is not understood"),
    ],
)
def test_bad_meshes_say_what_was_expected(mesh, kwargs, expected):
    with pytest.raises(MeshError, match=expected):
        dtensor.create_mesh(**kwargs)


def test_copy_to_mesh_pack_and_unpack_round_trip(mesh):
    full = torch.arange(12.0).reshape(4, 3)
    layout = Layout.batch_sharded(mesh, "batch", rank=2)
    x = dtensor.copy_to_mesh(full, layout)
    assert isinstance(x, DTensor) and dtensor.fetch_layout(x) == layout
    assert torch.equal(x.full_tensor(), full)
    packed = dtensor.pack([full], layout)
    assert torch.equal(packed.full_tensor(), full)
    assert torch.equal(dtensor.unpack(packed)[0], full)
    moved = dtensor.relayout(x, Layout.inner_sharded(mesh, "model", rank=2))
    assert dtensor.fetch_layout(moved) == Layout([UNSHARDED, "model"], mesh)
    with pytest.raises(LayoutError, match=r"has rank 2 but copy_to_mesh's tensor of shape \[12\]"):
        dtensor.copy_to_mesh(torch.zeros(12), layout)
    with pytest.raises(LayoutError, match=r"pack's shard of shape \[12\] has rank 1"):
        dtensor.pack([torch.zeros(12)], layout)
    with pytest.raises(LayoutError, match="pack got 2 tensors"):
        dtensor.pack([full, full], layout)
    with pytest.raises(LayoutError, match="fetch_layout expects a DTensor"):
        dtensor.fetch_layout(full)


def test_layout_map_keys_are_regexes_and_two_matches_are_an_error(mesh):
    layout_map = seed_layout_map(mesh)
    assert layout_map["feature.weight"] == Layout([UNSHARDED, "batch"], mesh)
    assert layout_map["feature_2.bias"] == Layout(["batch"], mesh)
    assert layout_map["other.weight"] is None
    assert len(layout_map) == 2 and list(layout_map) == ["feature.*weight", "feature.*bias"]
    layout_map["feature_2"] = Layout.replicated(mesh, 2)
    with pytest.raises(
        LayoutError,
        match=r"'feature_2.weight' matches several LayoutMap keys: "
        r"\['feature.\*weight', 'feature_2'\]",
    ):
        layout_map["feature_2.weight"]
    del layout_map["feature_2"]
    layout_map["feature_2.weight"] = Layout.replicated(mesh, 2)  # an exact key wins outright
    assert layout_map["feature_2.weight"] == Layout.replicated(mesh, 2)
    with pytest.raises(LayoutError, match=r"must be a sg\.dtensor\.Layout"):
        layout_map["x"] = "batch"
    with pytest.raises(LayoutError, match="not a regular expression"):
        layout_map["(unclosed"] = Layout.replicated(mesh, 1)


def test_layout_map_keys_that_match_no_weight_are_said_once_and_shard_nothing(mesh):
    layout_map = LayoutMap(mesh)
    layout_map["dense.kernel"] = Layout([UNSHARDED, "batch"], mesh)  # Keras's name for weight
    layout_map["0.bias"] = Layout(["batch"], mesh)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with pytest.warns(UserWarning) as said:
        layout_map.apply(model)
    (warning,) = [w for w in said if "LayoutMap" in str(w.message)]
    assert str(warning.message).startswith(
        "LayoutMap keys ['dense.kernel'] match none of the 2 weights of Sequential (paths such "
        "as '0.weight', '0.bias'): those layouts shard nothing"
    ), warning.message
    assert model[0].bias.layout == Layout(["batch"], mesh)  # the key that matched still applies
    again = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layout_map.apply(again)  # each key is said once
        LayoutMap(mesh).apply(torch.nn.Sequential(torch.nn.Linear(4, 4)))  # an empty map: none
        layout_map.apply(torch.nn.CrossEntropyLoss())  # no weights: not the model it was for


def test_layout_map_scope_lays_out_subclassed_and_sequential_models(mesh):
    layout_map = seed_layout_map(mesh)
    with layout_map.scope():
        subclassed = SubclassedModel()
        sequential = torch.nn.Sequential(
            collections.OrderedDict(
                feature=torch.nn.Linear(16, 16),
                dropout=torch.nn.Dropout(0.1),
                feature_2=torch.nn.Linear(16, 32),
            )
        )
    outside = torch.nn.Linear(2, 2)
    assert not isinstance(outside.weight, DTensor)
    for model in (subclassed, sequential):
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor) and isinstance(p, torch.nn.Parameter), name
            assert p.layout == layout_map[name] == dtensor.fetch_layout(p), name
    assert subclassed.feature.weight.layout == Layout([UNSHARDED, "batch"], mesh)
    assert sequential.feature_2.bias.layout == Layout(["batch"], mesh)
    out = subclassed(dtensor.copy_to_mesh(torch.zeros(16, 16), Layout.replicated(mesh, 2)))
    assert isinstance(out, DTensor) and out.shape == (16, 24)


def test_unmatched_weights_and_buffers_are_replicated(mesh):
    layout_map = LayoutMap(mesh)
    layout_map["0.weight"] = Layout(["model", UNSHARDED], mesh)
    model = layout_map.apply(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)))
    assert model[0].weight.layout == Layout(["model", UNSHARDED], mesh)
    assert model[0].bias.layout == Layout.replicated(mesh, 1)
    assert model[1].running_mean.layout == Layout.replicated(mesh, 1)
    # Still buffers (not parameters), now DTensors: BatchNorm runs on laid-out inputs.
    assert all(isinstance(b, DTensor) for b in model.buffers())
    assert len(list(model.parameters())) == 4
    out = model(dtensor.copy_to_mesh(torch.randn(4, 3), Layout.batch_sharded(mesh, "batch", 2)))
    assert out.shape == (4, 4) and int(model[1].num_batches_tracked.full_tensor()) == 1


def test_a_layout_that_does_not_fit_leaves_the_module_unchanged(mesh):
    layout_map = LayoutMap(mesh)
    layout_map["bias"] = Layout.replicated(mesh, 2)
    model = torch.nn.Linear(3, 4)
    with pytest.raises(
        LayoutError, match=r"has rank 2 but parameter 'bias' of shape \[4\] has rank 1"
    ):
        dtensor.apply_layout_map(model, layout_map)
    assert not any(isinstance(p, DTensor) for p in model.parameters())


def test_layout_weights_ports_kernel_layout_and_bias_layout(mesh):
    layer = dtensor.layout_weights(
        torch.nn.Linear(4, 2),
        weight=Layout.replicated(mesh, 2),
        bias=Layout.replicated(mesh, 1),
    )
    assert layer.weight.layout == Layout.replicated(mesh, 2)
    with pytest.raises(LayoutError, match=r"has no weights \['kernel'\]"):
        dtensor.layout_weights(torch.nn.Linear(4, 2), kernel=Layout.replicated(mesh, 2))


def test_laid_out_parameters_train_with_a_plain_optimizer_like_plain_ones(mesh):
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    laid_out = dtensor.apply_layout_map(copy.deepcopy(plain), LayoutMap(mesh))
    opts = [torch.optim.Adam(m.parameters(), lr=0.1) for m in (plain, laid_out)]
    x, y = torch.randn(6, 5), torch.tensor([0, 1, 2, 0, 1, 2])
    layout = Layout.batch_sharded(mesh, "batch", rank=2)
    for _ in range(3):
        for model, opt, inputs, labels in (
            (plain, opts[0], x, y),
            (
                laid_out,
                opts[1],
                dtensor.copy_to_mesh(x, layout),
                dtensor.copy_to_mesh(y, Layout.batch_sharded(mesh, "batch", 1)),
            ),
        ):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(inputs), labels).backward()
            opt.step()
    for a, b in zip(plain.parameters(), laid_out.parameters(), strict=True):
        torch.testing.assert_close(b.full_tensor(), a.detach())
    assert isinstance(opts[1].state[laid_out[0].weight]["exp_avg"], DTensor)
    # Copies keep the layout; values derived from a parameter are plain DTensors.
    copied = copy.deepcopy(laid_out)
    assert copied[0].weight.layout == laid_out[0].weight.layout
    assert copied[0].weight is not laid_out[0].weight
    assert laid_out.state_dict()["0.weight"].layout == torch.strided


def test_mesh_metrics_match_a_plain_computation(mesh):
    logits = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    labels = torch.tensor([1, 1, 1, 0])
    metric = dtensor.metrics.SparseCategoricalAccuracy(mesh=mesh)
    layout = Layout.batch_sharded(mesh, "batch", rank=2)
    metric.update_state(
        y_true=dtensor.copy_to_mesh(labels, Layout.batch_sharded(mesh, "batch", 1)),
        y_pred=dtensor.copy_to_mesh(logits, layout),
    )
    metric.update_state(
        y_true=dtensor.copy_to_mesh(labels[:2], Layout.batch_sharded(mesh, "batch", 1)),
        y_pred=dtensor.copy_to_mesh(logits[:2], layout),
    )
    assert float(metric.result()) == pytest.approx(4 / 6)
    metric.reset_state()
    assert float(metric.result()) == 0.0
    plain = dtensor.metrics.SparseCategoricalAccuracy()  # plain tensors, no mesh
    plain.update_state(y_true=labels, y_pred=logits)
    assert float(plain.result()) == pytest.approx(3 / 4)


def test_checkpoint_of_laid_out_weights_is_sharded_and_restores_in_place(mesh, tmp_path):
    import json

    import stratagem as sg

    # The seed's keys name its model's layers: a bare Linear is replicated, and told so.
    with pytest.warns(UserWarning, match=r"match none of the 2 weights of Linear"):
        model = dtensor.apply_layout_map(torch.nn.Linear(4, 2), seed_layout_map(mesh))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(dtensor.copy_to_mesh(torch.ones(3, 4), Layout.replicated(mesh, 2))).sum().backward()
    optimizer.step()
    epoch = torch.tensor(2)
    checkpoint = sg.train.Checkpoint(model=model, optimizer=optimizer, epoch=epoch)
    path = checkpoint.save(tmp_path / "ckpt")
    meta = json.loads((tmp_path / "ckpt-1" / "meta.json").read_text())
    assert meta["sharded"] is True and (tmp_path / "ckpt-1" / ".metadata").is_file()
    assert sg.train.latest_checkpoint(tmp_path) == path
    saved = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    saved_avg = optimizer.state[model.weight]["exp_avg"].full_tensor().clone()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    optimizer.state[model.weight]["exp_avg"].zero_()
    epoch.fill_(0)
    weight = model.weight
    checkpoint.restore(path).assert_consumed()
    assert model.weight is weight and int(epoch) == 2 and int(checkpoint.save_counter) == 1
    for name, p in model.named_parameters():
        assert torch.equal(p.full_tensor(), saved[name]), name
    assert torch.equal(optimizer.state[model.weight]["exp_avg"].full_tensor(), saved_avg)
    # CheckpointManager writes sharded checkpoints the same way, and keeps max_to_keep of them.
    manager = sg.train.CheckpointManager(checkpoint, tmp_path / "managed", max_to_keep=1)
    manager.save()
    last = manager.save()
    assert sorted(p.name for p in (tmp_path / "managed").iterdir()) == ["checkpoint", "ckpt-3"]
    assert sg.train.latest_checkpoint(tmp_path / "managed") == last


def test_a_sharded_optimizer_needs_its_model_in_the_checkpoint(mesh, tmp_path):
    import stratagem as sg

    model = dtensor.apply_layout_map(torch.nn.Linear(4, 2), LayoutMap(mesh))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(sg.train.CheckpointError, match="no module tracked by the same Checkpoint"):
        sg.train.Checkpoint(optimizer=optimizer).save(tmp_path / "ckpt")


def test_a_failing_scope_lays_out_nothing_and_leaves_no_hooks(mesh):
    layout_map = seed_layout_map(mesh)
    with pytest.raises(RuntimeError, match="boom"), layout_map.scope():
        inside = SubclassedModel()
        raise RuntimeError("boom")
    after = SubclassedModel()
    assert not any(isinstance(p, DTensor) for p in [*inside.parameters(), *after.parameters()])


def test_a_layout_map_takes_layouts_of_its_own_mesh_only(mesh):
    other = dtensor.create_mesh([("replica", 1)])
    assert other != mesh
    with pytest.raises(LayoutError, match=r"is on another mesh than the map's Mesh\(\|batch=1\|"):
        LayoutMap(mesh)["weight"] = Layout.replicated(other, 2)
