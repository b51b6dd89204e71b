"""The tiny models themselves: built offline, their quirks as the other tests expect them."""

from __future__ import annotations

import torch

from real_models import hf_models


def test_the_tiny_models_build_offline_and_have_the_quirks_the_tests_rely_on():
    gpt2 = hf_models.gpt2()
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight  # tied embeddings
    ids = hf_models.tokens(2)
    out = gpt2(input_ids=ids, labels=ids)
    assert out.loss.dim() == 0 and out.logits.shape == (2, hf_models.SEQ, hf_models.VOCAB)
    bert = hf_models.bert()
    out = bert(input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.tensor([0, 2]))
    assert out.loss.dim() == 0 and out.logits.shape == (2, 3)
    llama = hf_models.llama()
    assert llama.lm_head.weight is not llama.model.embed_tokens.weight
    assert llama(input_ids=ids).logits.shape == (2, hf_models.SEQ, hf_models.VOCAB)
    resnet = hf_models.resnet()
    assert resnet(pixel_values=hf_models.images(2)).logits.shape == (2, 4)
    assert any(True for _ in resnet.buffers())  # BatchNorm statistics
