"""The ready layouts and the mesh step in one process: Megatron's layout map for Linear and
Conv1D projections, tied weights laid out once, plain tensors replicated, unshardable
operators named. (Real models on a real 2-process mesh: real_models/test_mesh.py.)"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from stratagem import dtensor
from stratagem.dtensor import UNSHARDED, Layout, LayoutError, LayoutMap, mesh_step

U = UNSHARDED


@pytest.fixture(scope="module")
def mesh():
    assert not dist.is_initialized()
    mesh = dtensor.create_mesh([("batch", 1), ("model", 1)], devices=["CPU:0"])
    yield mesh
    dist.destroy_process_group()  # other test modules start their own groups


class Conv1D(torch.nn.Module):
    """Hugging Face's GPT-2 projection as it is built: weight (in, out) = (nx, nf)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = torch.nn.Parameter(torch.randn(nx, nf))
        self.bias = torch.nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.view(-1, self.nx), self.weight).view(*x.shape[:-1], -1)


def gpt2_block() -> torch.nn.Module:
    attn = torch.nn.Module()
    attn.c_attn, attn.c_proj = Conv1D(3 * 8, 8), Conv1D(8, 8)
    mlp = torch.nn.Module()
    mlp.c_fc, mlp.c_proj = Conv1D(32, 8), Conv1D(8, 32)
    block = torch.nn.Module()
    block.attn, block.mlp, block.ln_1 = attn, mlp, torch.nn.LayerNorm(8)
    return torch.nn.ModuleDict({"h": torch.nn.ModuleList([block, block])})


def llama_layer() -> torch.nn.Module:
    attn = torch.nn.Module()
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, torch.nn.Linear(8, 8, bias=False))
    attn.o_proj = torch.nn.Linear(8, 8, bias=False)
    mlp = torch.nn.Module()
    mlp.gate_proj, mlp.up_proj = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16)
    mlp.down_proj = torch.nn.Linear(16, 8)
    layer = torch.nn.Module()
    layer.self_attn, layer.mlp = attn, mlp
    return torch.nn.ModuleDict({"layers": torch.nn.ModuleList([layer])})


def _specs(layout_map: LayoutMap, path: str) -> list[str] | None:
    found = layout_map[path]
    return None if found is None else found.sharding_specs


def test_megatron_splits_conv1d_weights_which_are_in_out(mesh):
    layout_map = dtensor.megatron_layout_map(mesh, gpt2_block())
    assert _specs(layout_map, "h.0.attn.c_attn.weight") == [U, "model"]  # outputs: column
    assert _specs(layout_map, "h.0.attn.c_attn.bias") == ["model"]
    assert _specs(layout_map, "h.1.attn.c_proj.weight") == ["model", U]  # inputs: row
    assert _specs(layout_map, "h.1.attn.c_proj.bias") is None  # replicated
    assert _specs(layout_map, "h.0.mlp.c_fc.weight") == [U, "model"]
    assert _specs(layout_map, "h.0.mlp.c_proj.weight") == ["model", U]
    assert _specs(layout_map, "h.0.ln_1.weight") is None
    assert len(layout_map) == 6  # one key per pattern and weight, whatever the depth


def test_megatron_splits_linear_weights_which_are_out_in(mesh):
    layout_map = dtensor.megatron_layout_map(mesh, llama_layer())
    assert _specs(layout_map, "layers.0.self_attn.k_proj.weight") == ["model", U]
    assert _specs(layout_map, "layers.0.self_attn.o_proj.weight") == [U, "model"]
    assert _specs(layout_map, "layers.0.mlp.up_proj.bias") == ["model"]
    assert _specs(layout_map, "layers.0.mlp.down_proj.weight") == [U, "model"]
    assert _specs(layout_map, "layers.0.mlp.down_proj.bias") is None


def test_a_megatron_map_applies_and_computes_like_the_plain_model(mesh):
    torch.manual_seed(0)
    plain = gpt2_block()
    model = gpt2_block()
    model.load_state_dict(plain.state_dict())
    dtensor.megatron_layout_map(mesh, model).apply(model)
    assert dtensor.fetch_layout(model.h[0].attn.c_attn.weight).sharding_specs == [U, "model"]
    x = torch.randn(2, 3, 8)
    layout = Layout.replicated(mesh, 3)
    got = model.h[0].mlp.c_proj(model.h[0].mlp.c_fc(dtensor.copy_to_mesh(x, layout)))
    expected = plain.h[0].mlp.c_proj(plain.h[0].mlp.c_fc(x))
    torch.testing.assert_close(got.full_tensor(), expected)


def test_a_hugging_face_style_plan_is_taken_as_it_is(mesh):
    plan = {"layers.*.self_attn.q_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
    layout_map = dtensor.megatron_layout_map(mesh, llama_layer(), plan=plan)
    assert _specs(layout_map, "layers.0.self_attn.q_proj.weight") == ["model", U]
    assert _specs(layout_map, "layers.0.self_attn.k_proj.weight") is None  # not in this plan
    assert _specs(layout_map, "layers.0.mlp.down_proj.weight") == [U, "model"]


def test_megatron_errors_name_what_was_received(mesh):
    with pytest.raises(LayoutError, match=r"no dimension 'tp' .* expected one of \['batch', "):
        dtensor.megatron_layout_map(mesh, llama_layer(), axis="tp")
    with pytest.raises(LayoutError, match=r"plan\['q_proj'\] = 'sideways'; expected one of"):
        dtensor.megatron_layout_map(mesh, llama_layer(), plan={"q_proj": "sideways"})
    with pytest.raises(LayoutError, match=r"'h.0.ln_1' is a LayerNorm; expected an nn.Linear"):
        dtensor.megatron_layout_map(mesh, gpt2_block(), plan={r"ln_1": "colwise"})
    mixed = torch.nn.ModuleDict({"a_proj": torch.nn.Linear(4, 4), "b_proj": Conv1D(4, 4)})
    with pytest.raises(LayoutError, match=r"matches 'a_proj' \(Linear\) and 'b_proj' \(Conv1D\)"):
        dtensor.megatron_layout_map(mesh, mixed, plan={r"_proj": "colwise"})


class TiedModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(8, 4)
        self.lm_head = torch.nn.Linear(4, 8, bias=False)
        self.lm_head.weight = self.wte.weight


def test_a_tied_weight_is_laid_out_once_for_all_its_paths(mesh):
    model = TiedModel()
    layout_map = LayoutMap(mesh)
    layout_map["wte.weight"] = Layout(["model", U], mesh)  # a key for one of its paths
    layout_map.apply(model)
    assert model.lm_head.weight is model.wte.weight
    assert isinstance(model.wte.weight, DTensor)
    assert dtensor.fetch_layout(model.lm_head.weight).sharding_specs == ["model", U]
    assert len(list(model.parameters())) == 1


def test_tied_paths_with_different_layouts_are_an_error_naming_both(mesh):
    model = TiedModel()
    layout_map = LayoutMap(mesh)
    layout_map["wte.weight"] = Layout(["model", U], mesh)
    layout_map["lm_head.weight"] = Layout([U, "model"], mesh)
    with pytest.raises(LayoutError, match=r"reached by the paths \['wte.weight', 'lm_head.weight'"):
        layout_map.apply(model)
    assert not isinstance(model.wte.weight, DTensor)  # unchanged


def test_plain_tensors_made_in_a_step_are_replicated_and_the_setting_restored(mesh):
    x = dtensor.copy_to_mesh(torch.ones(2, 3), Layout.batch_sharded(mesh, "batch", 2))
    with pytest.raises(RuntimeError, match=r"got mixed torch\.Tensor and DTensor"):
        x + torch.arange(3.0)
    with mesh_step.replicated_plain_tensors():
        with mesh_step.replicated_plain_tensors():
            pass  # an inner block must not end the outer one
        total = x + torch.arange(3.0)
        # A key/value cache's first keys: torch.cat skips the 1-D empty placeholder.
        cached = torch.cat([torch.tensor([]), x], dim=-2)
    assert total.full_tensor().tolist() == [[1.0, 2.0, 3.0]] * 2
    assert cached.shape == (2, 3)
    with pytest.raises(RuntimeError, match=r"got mixed torch\.Tensor and DTensor"):
        x + torch.arange(3.0)


def test_an_operator_without_a_sharding_rule_is_named_with_its_remedy(mesh):
    error = NotImplementedError(
        "Operator aten._scaled_dot_product_flash_attention_for_cpu_backward.default does not "
        "have a sharding strategy registered."
    )
    named = mesh_step.sharding_rule_error(error, None)
    assert isinstance(named, dtensor.ShardingRuleError)
    assert "aten._scaled_dot_product_flash_attention_for_cpu_backward.default (during " in str(
        named
    )
    assert 'attn_implementation="eager"' in str(named)
    other = mesh_step.sharding_rule_error(
        RuntimeError("Operator aten.cummax.default does not have a sharding strategy registered."),
        None,
    )
    assert other is not None and "aten.cummax.default" in str(other)
    assert "replicated" in str(other)
    assert mesh_step.sharding_rule_error(RuntimeError("a shape error"), None) is None


# DTensor's words when a view flattens a batch its mesh cut 2 + 1 (torch 2.10).
UNEVEN_VIEW = (
    "Cannot flatten unevenly sharded tensor: dimension 0 (size 3) is not evenly divisible by "
    "mesh dimension 0 (size 2). Please redistribute the tensor before this operation.\n\n"
    "Sharding propagation failed for aten.view.default(Spec(f32[3, 16, 32](S(0))), [-1, 32]) "
    "on DeviceMesh((batch=2), 'cpu', stride=(1,)))"
)


def test_a_reshape_across_an_unevenly_cut_batch_is_named_with_its_remedy():
    named = mesh_step.sharding_rule_error(RuntimeError(UNEVEN_VIEW), None, ("batch",), "batch")
    assert isinstance(named, dtensor.ShardingRuleError)
    message = str(named)
    assert message.startswith(
        "DTensor cannot run aten.view.default on a tensor whose dimension 0 (size 3) the mesh "
        "cuts unevenly along 'batch' (2 parts: 2 + 1)"
    ), message
    assert "global batch of 3 does not divide by the 2 replicas" in message, message
    assert "drop_remainder=True" in message, message
    # Cut along another dimension than the batch's: the layout is what to change.
    other = mesh_step.sharding_rule_error(
        RuntimeError(UNEVEN_VIEW.replace("mesh dimension 0", "mesh dimension 1")),
        None,
        ("batch", "model"),
        "batch",
    )
    assert other is not None and "along 'model'" in str(other), other
    assert "redistribute" in str(other) and "global batch" not in str(other), other


class NoRule(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(
            "Operator aten.cummax.default does not have a sharding strategy registered."
        )


def test_the_named_error_says_which_module_ran_the_operator(mesh):
    model = torch.nn.Sequential(collections.OrderedDict(inner=NoRule()))
    expected = pytest.raises(dtensor.ShardingRuleError, match=r"aten.cummax.default in NoRule")
    with expected, mesh_step.named_operator_errors():
        model(torch.ones(1))
