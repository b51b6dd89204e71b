"""Hugging Face models nobody here wrote, built from tiny configs with random weights (nothing
downloaded), and synthetic inputs for them: what the real-model tests train under every
strategy. Importable by the tests and by their worker scripts (``tests/`` is on their path)."""

from __future__ import annotations

import os

import torch

# Nothing may reach the hub: every model here is built from a config.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import transformers

transformers.logging.set_verbosity_error()

VOCAB = 96
SEQ = 16


def gpt2(seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A 2-layer GPT-2 language model: tied ``wte``/``lm_head``, a ``CausalLMOutput`` whose
    ``.loss`` it computes itself from ``labels``, position ids made inside ``forward``."""
    torch.manual_seed(seed)
    settings: dict[str, object] = {
        "vocab_size": VOCAB,
        "n_positions": 64,
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 2,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    }
    config = transformers.GPT2Config(**{**settings, **overrides})
    return transformers.GPT2LMHeadModel(config).eval()


def bert(seed: int = 0, num_labels: int = 3, **overrides: object) -> torch.nn.Module:
    """A 2-layer BERT classifier: dict inputs (``input_ids``, ``attention_mask``), an output
    with ``.loss`` when given ``labels`` and ``.logits``."""
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=num_labels,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **overrides,
    )
    return transformers.BertForSequenceClassification(config).eval()


def llama(seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A 2-layer Llama-style decoder (RMSNorm, rotary positions, SwiGLU), untied head."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        **overrides,
    )
    return transformers.LlamaForCausalLM(config).eval()


def resnet(seed: int = 0, num_labels: int = 4, **overrides: object) -> torch.nn.Module:
    """HF's ResNet image classifier, two tiny stages (BatchNorm buffers included)."""
    torch.manual_seed(seed)
    config = transformers.ResNetConfig(
        num_channels=3,
        embedding_size=8,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        layer_type="basic",
        num_labels=num_labels,
        **overrides,
    )
    return transformers.ResNetForImageClassification(config).eval()


def tokens(n: int, seed: int = 1, seq: int = SEQ) -> torch.Tensor:
    """``n`` sequences of ``seq`` random token ids."""
    return torch.randint(1, VOCAB, (n, seq), generator=torch.Generator().manual_seed(seed))


def images(n: int, seed: int = 1, size: int = 16) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def labels(n: int, classes: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(seed))


# The sharded-model checks' batches (FSDP on BERT and the Llama-style decoder): the worker
# trains on them and the test computes its one-process reference from the same.
SHARDED_STEPS, SHARDED_BATCH, SHARDED_LR = 3, 4, 0.1


def bert_batches() -> list[dict[str, torch.Tensor]]:
    """BERT batches with padding (the attention mask matters) and class labels."""
    out = []
    for i in range(SHARDED_STEPS):
        ids = tokens(SHARDED_BATCH, seed=50 + i)
        mask = torch.ones_like(ids)
        mask[1, -5:] = 0
        mask[3, -2:] = 0
        out.append(
            {"input_ids": ids, "attention_mask": mask, "labels": labels(SHARDED_BATCH, 3, 60 + i)}
        )
    return out


def llama_batches() -> list[dict[str, torch.Tensor]]:
    """Causal LM batches: the model shifts ``labels`` itself."""
    out = []
    for i in range(SHARDED_STEPS):
        ids = tokens(SHARDED_BATCH, seed=70 + i)
        out.append({"input_ids": ids, "labels": ids})
    return out
