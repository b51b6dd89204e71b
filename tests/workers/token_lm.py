"""A tiny causal language model whose own loss is Hugging Face's, padded batches whose halves hold
1 and 97 real tokens, and the one-process reference: shared by tests/test_global_token_loss.py
and its worker (workers/token_loss_checks.py)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

VOCAB, WIDTH, SEQ = 13, 6, 50  # a row of SEQ labels has SEQ - 1 targets after the shift
PAD = -100
MICRO = 4  # a micro-batch's global examples: 2 for each of 2 workers
# Real targets of each worker's half of the 4 micro-batches: 1 and 97 (49 + 48), alike or not.
HALVES = [(1, 1), (1, 97), (97, 97), (97, 1)]
LR = 0.5


def ForCausalLMLoss(  # HF's name, which the global-token rule reads
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: float | torch.Tensor | None = None,
    ignore_index: int = PAD,
    **kwargs: object,
) -> torch.Tensor:
    """transformers/loss/loss_utils.py's ``ForCausalLMLoss`` and ``fixed_cross_entropy``: the
    labels shifted (position t predicts t+1), the mean over the real targets, or their sum over
    ``num_items_in_batch`` when given."""
    labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(
        logits.float().reshape(-1, vocab_size),
        labels.reshape(-1),
        ignore_index=ignore_index,
        reduction=reduction,
    )
    return loss / num_items_in_batch if num_items_in_batch is not None else loss


@dataclass
class Output:
    loss: torch.Tensor | None
    logits: torch.Tensor


class TinyLM(torch.nn.Module):
    """An HF-style causal LM: ``forward(input_ids, labels=None, **kwargs)`` returns ``.loss``
    (HF's loss function, given the loss keywords) and ``.logits``; each position sees the mean
    of the embeddings up to it."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.mix = torch.nn.Linear(WIDTH, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    @property
    def loss_function(self):  # HF's PreTrainedModel.loss_function
        return ForCausalLMLoss

    def forward(self, input_ids: torch.Tensor, labels=None, **kwargs: object) -> Output:
        h = self.embed(input_ids)
        steps = torch.arange(1, h.shape[1] + 1, dtype=h.dtype, device=h.device)
        h = torch.tanh(self.mix(h.cumsum(1) / steps[:, None]))
        logits = self.head(h)
        loss = None if labels is None else self.loss_function(logits, labels, VOCAB, **kwargs)
        return Output(loss, logits)


def _row(targets: int, g: torch.Generator) -> torch.Tensor:
    """A row of labels with ``targets`` real targets (positions 1..targets), padding after."""
    row = torch.randint(0, VOCAB, (SEQ,), generator=g)
    row[targets + 1 :] = PAD
    return row


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, labels) of the 4 micro-batches of 4 rows: rows 0-1 of each are the first
    worker's half, rows 2-3 the second's; a half of 97 targets is rows of 49 and 48, a half of
    1 a row of 1 and a row of padding only."""
    g = torch.Generator().manual_seed(7)
    rows = []
    for halves in HALVES:
        for targets in halves:
            split = (49, 48) if targets == 97 else (1, 0)
            rows += [_row(t, g) for t in split]
    labels = torch.stack(rows)
    ids = labels.clamp(min=0)
    return ids, labels


@functools.cache
def reference_update(k: int) -> dict[str, torch.Tensor]:
    """One process on the global batch: each step (k micro-batches) the model's own mean over
    every real target of the step, one SGD step; the initial weights minus the final ones."""
    model = TinyLM()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ids, labels = data()
    rows = MICRO * k
    for lo in range(0, len(ids), rows):
        optimizer.zero_grad()
        model(ids[lo : lo + rows], labels=labels[lo : lo + rows]).loss.backward()
        optimizer.step()
    return {n: initial[n] - p.detach() for n, p in model.named_parameters()}


def check_update(update: dict[str, torch.Tensor], k: int, what: str) -> None:
    """The weights moved as the reference's, within 1e-5 relative (SGD: lr x the gradients)."""
    reference = reference_update(k)
    for name, expected in reference.items():
        torch.testing.assert_close(
            update[name], expected, rtol=1e-5, atol=1e-7, msg=f"{what}: {name}"
        )
