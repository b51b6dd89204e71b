"""Hugging Face models on a 2-process mesh (tests/real_models/test_mesh.py).

Each case trains one tiny model a few SGD steps under ``MeshStrategy``, data-parallel on a
``(batch=2)`` mesh or tensor-parallel on a ``(batch=1, model=2)`` one (Megatron's split, from
``sg.dtensor.megatron_layout_map``), and the same model in this process alone on the same
global batches; the worker writes the largest differences to ``<out>/mesh-rank<r>.json``.
One job runs every case: starting torch processes on 2 cores is the expensive part.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import stratagem as sg
from real_models import hf_models

STEPS = 3
BATCH = 4  # global: 2 sequences per replica on the data-parallel mesh
LR = 0.1


def lm_batches(seed: int) -> list[dict[str, torch.Tensor]]:
    """Causal LM batches: the model shifts ``labels`` itself."""
    out = []
    for step in range(STEPS):
        ids = hf_models.tokens(BATCH, seed=seed + step)
        out.append({"input_ids": ids, "labels": ids})
    return out


def classifier_batches(seed: int) -> list[dict[str, torch.Tensor]]:
    """BERT batches with padding, so that the attention mask matters."""
    out = []
    for step in range(STEPS):
        ids = hf_models.tokens(BATCH, seed=seed + step)
        mask = torch.ones_like(ids)
        mask[1, -5:] = 0
        mask[3, -2:] = 0
        labels = hf_models.labels(BATCH, 3, seed=seed + step)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def reference_run(build: Callable[[], torch.nn.Module], batches: list) -> dict:
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"model": model, "losses": losses}


def mesh_run(strategy, build: Callable[[], torch.nn.Module], batches: list) -> dict:
    with strategy.scope():
        model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def step(batch: dict) -> torch.Tensor:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    losses = []
    for batch in strategy.experimental_distribute_dataset(batches):
        share = strategy.run(step, args=(batch,))
        # The model's loss is the mean over the global batch; each replica holds its share.
        losses.append(float(strategy.reduce("MEAN", share, axis=None)))
    return {"model": model, "losses": losses}


def compare(strategy, build: Callable[[], torch.nn.Module], batches: list) -> dict:
    initial = dict(build().named_parameters(remove_duplicate=False))
    reference = reference_run(build, batches)
    laid_out = mesh_run(strategy, build, batches)
    # Every path, tied ones too: a tie broken on the mesh shows as a weight of its own.
    expected = dict(reference["model"].named_parameters(remove_duplicate=False))
    weights = dict(laid_out["model"].named_parameters(remove_duplicate=False))
    local_shapes = {
        name: list(p.to_local().shape)
        for name, p in weights.items()
        if isinstance(p, sg.dtensor.DTensor)
    }
    return {
        "loss": max(abs(a - b) for a, b in zip(laid_out["losses"], reference["losses"])),
        "weights": max(
            float((_whole(p) - expected[name].detach()).abs().max()) for name, p in weights.items()
        ),
        # How far the steps moved the weights: equal weights then mean equal steps.
        "moved": max(
            float((p.detach() - initial[name].detach()).abs().max()) for name, p in expected.items()
        ),
        "plain": sorted(n for n, p in weights.items() if not isinstance(p, sg.dtensor.DTensor)),
        "local_shapes": local_shapes,
        "tied": bool(
            getattr(laid_out["model"], "lm_head", None) is not None
            and laid_out["model"].lm_head.weight is laid_out["model"].get_input_embeddings().weight
        ),
    }


def _whole(weight: torch.Tensor) -> torch.Tensor:
    """The full value of a weight, laid out or (wrongly, a test failure) left plain."""
    whole = weight.full_tensor() if isinstance(weight, sg.dtensor.DTensor) else weight
    return whole.detach()


def error_of(fn: Callable[[], object]) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def fused_attention_error(strategy, batches: list) -> str:
    """GPT-2's step with SDPA's fused CPU kernel forced: the named error. (Where the kernel
    gets an attention mask, BERT's, DTensor first tries to shard it through its
    decomposition, which takes a minute before the same error.)"""
    with strategy.scope():
        model = hf_models.gpt2()

    def step(batch: dict) -> None:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            model(**batch).loss.backward()

    batch = next(iter(strategy.experimental_distribute_dataset(batches[:1])))
    return error_of(lambda: strategy.run(step, args=(batch,)))


def main() -> None:
    directory = sys.argv[1]
    out: dict = {}
    dp = sg.dtensor.create_mesh([("batch", 2)])
    tp = sg.dtensor.create_mesh([("batch", 1), ("model", 2)])

    def data_parallel() -> sg.distribute.experimental.MeshStrategy:
        return sg.distribute.experimental.MeshStrategy(dp)

    def tensor_parallel(model: torch.nn.Module, **plan) -> sg.distribute.experimental.MeshStrategy:
        layout_map = sg.dtensor.megatron_layout_map(tp, model, **plan)
        out.setdefault("layout_maps", {})[type(model).__name__] = repr(layout_map)
        return sg.distribute.experimental.MeshStrategy(tp, layout_map)

    lm, classifier = lm_batches(seed=3), classifier_batches(seed=5)
    out["gpt2_dp"] = compare(data_parallel(), hf_models.gpt2, lm)
    out["gpt2_tp"] = compare(tensor_parallel(hf_models.gpt2()), hf_models.gpt2, lm)
    out["llama_dp"] = compare(data_parallel(), hf_models.llama, lm)
    llama = hf_models.llama()
    # Hugging Face's own tensor-parallel plan for Llama, as a plan.
    out["llama_tp"] = compare(
        tensor_parallel(llama, plan=llama.config.base_model_tp_plan), hf_models.llama, lm
    )
    out["bert_tp"] = compare(tensor_parallel(hf_models.bert()), hf_models.bert, classifier)
    out["fused_attention"] = fused_attention_error(data_parallel(), lm)
    rank = torch.distributed.get_rank()
    with open(os.path.join(directory, f"mesh-rank{rank}.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
