"""Hugging Face transformers on a 2-process mesh, against one unsharded process.

One job (workers/mesh_real_models.py) trains GPT-2 data-parallel and tensor-parallel (Megatron's
split of its Conv1D projections), a Llama-style decoder both ways (Linear projections, with
Hugging Face's own tensor-parallel plan), and BERT tensor-parallel with its default attention,
3 SGD steps each on the same global batches as the process alone. These models make tensors
inside ``forward`` (GPT-2's position ids, Llama's rotary tables and key/value cache, BERT's
mask), which a mesh step replicates; before it did, every case died on "got mixed
torch.Tensor and DTensor".
"""

from __future__ import annotations

import json

import pytest

from cluster_utils import WORKERS, run_cluster

pytestmark = pytest.mark.multiprocess

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    directory = tmp_path_factory.mktemp("mesh_real_models")
    worker = WORKERS / "mesh_real_models.py"
    results = run_cluster(worker, 2, directory, args=[str(directory)], timeout=300)
    for i, result in enumerate(results):
        result.check(f"mesh worker {i}")
    return [json.loads((directory / f"mesh-rank{i}.json").read_text()) for i in range(2)]


def _equal_to_one_process(ranks: list[dict], case: str) -> dict:
    for r in ranks:
        diffs = r[case]
        assert diffs["loss"] < TOLERANCE and diffs["weights"] < TOLERANCE, diffs
        assert diffs["moved"] > 1e-3, diffs  # the steps did change the weights
        assert diffs["plain"] == [], diffs  # every weight is on the mesh
    return ranks[0][case]


def test_gpt2_on_a_data_parallel_mesh_equals_one_process(ranks):
    case = _equal_to_one_process(ranks, "gpt2_dp")
    assert case["tied"], "lm_head.weight must stay the embedding's weight"
    assert case["local_shapes"]["transformer.h.0.attn.c_attn.weight"] == [32, 96]


def test_gpt2_tensor_parallel_splits_its_conv1d_projections_megatron_style(ranks):
    case = _equal_to_one_process(ranks, "gpt2_tp")
    assert case["tied"]
    shapes = case["local_shapes"]
    # Conv1D weights are (in, out): column-wise splits dimension 1, row-wise dimension 0.
    assert shapes["transformer.h.0.attn.c_attn.weight"] == [32, 48]
    assert shapes["transformer.h.0.attn.c_attn.bias"] == [48]
    assert shapes["transformer.h.0.attn.c_proj.weight"] == [16, 32]
    assert shapes["transformer.h.0.attn.c_proj.bias"] == [32]  # after the all-reduce: whole
    assert shapes["transformer.h.1.mlp.c_fc.weight"] == [32, 64]
    assert shapes["transformer.h.1.mlp.c_proj.weight"] == [64, 32]
    assert shapes["transformer.wte.weight"] == [96, 32]  # not in the plan: replicated


def test_llama_data_parallel_and_tensor_parallel_equal_one_process(ranks):
    _equal_to_one_process(ranks, "llama_dp")
    shapes = _equal_to_one_process(ranks, "llama_tp")["local_shapes"]
    # Linear weights are (out, in), split by Hugging Face's own plan for Llama.
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == [16, 32]
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == [32, 16]
    assert shapes["model.layers.1.mlp.gate_proj.weight"] == [32, 32]
    assert shapes["model.layers.1.mlp.down_proj.weight"] == [32, 32]
    assert shapes["lm_head.weight"] == [96, 32]
    assert "layers.*.self_attn.q_proj" in ranks[0]["layout_maps"]["LlamaForCausalLM"]


def test_bert_tensor_parallel_with_its_default_attention_equals_one_process(ranks):
    shapes = _equal_to_one_process(ranks, "bert_tp")["local_shapes"]
    assert shapes["bert.encoder.layer.0.attention.self.query.weight"] == [16, 32]
    assert shapes["bert.encoder.layer.0.attention.output.dense.weight"] == [32, 16]
    assert shapes["bert.encoder.layer.0.intermediate.dense.weight"] == [32, 32]
    assert shapes["bert.encoder.layer.0.output.dense.weight"] == [32, 32]


def test_a_fused_attention_kernel_is_a_named_error_with_the_remedy(ranks):
    for r in ranks:
        error = r["fused_attention"]
        assert error.startswith(
            "ShardingRuleError: DTensor has no sharding rule for operator "
            "aten._scaled_dot_product_flash_attention_for_cpu.default in "
            "GPT2Attention"
        ), error
        assert 'attn_implementation="eager"' in error, error
