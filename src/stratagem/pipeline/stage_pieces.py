"""What a rank holds of a split model: its chunks to run, and its parameters under the whole
model's names.

Two kinds of cut give them: slices of an ``nn.Sequential`` (``SequentialPieces``, the same
chunks for every batch) and stages traced by ``torch.export`` (``trace.TracedPieces``, whose
graphs are specialised to one micro-batch size, so the chunks depend on it). The schedules,
the forward pass and the checkpoints see only this interface.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

import torch
from torch import nn

# A rank's model chunks: (chunk index in the whole pipeline, the module that runs it).
Chunks = list[tuple[int, nn.Module]]


class StagePieces(Protocol):
    """A rank's part of a split model."""

    @property
    def module(self) -> nn.Module:
        """This rank's parameters and buffers, named as in the whole model (``state_dict``'s
        keys are the whole model's): the optimizer's parameters and the checkpoint's keys."""
        ...

    @property
    def fixed_chunks(self) -> Chunks | None:
        """The chunks, when they run batches of any size (None: ask ``chunks_for``)."""
        ...

    def chunks_for(self, batch_size: int) -> Chunks:
        """The chunks that run inputs whose first dimension is ``batch_size``."""
        ...


class SequentialPieces:
    """Slices of an ``nn.Sequential``: the layers keep their names, any batch size runs."""

    def __init__(self, chunks: list[tuple[int, nn.Sequential]]) -> None:
        self._chunks: Chunks = list(chunks)
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        for _, chunk in chunks:
            layers.update(chunk._modules)  # type: ignore[arg-type]
        self._module = nn.Sequential(layers)

    @property
    def module(self) -> nn.Module:
        return self._module

    @property
    def fixed_chunks(self) -> Chunks:
        return self._chunks

    def chunks_for(self, batch_size: int) -> Chunks:
        return self._chunks


def run_chunks(chunks: Chunks, x: torch.Tensor) -> torch.Tensor:
    """``x`` through ``chunks`` one after another: a chunk that returns several tensors gives
    them to the next as its arguments (traced stages hand on every tensor later ones need)."""
    h: torch.Tensor | tuple[torch.Tensor, ...] = x
    for _, chunk in chunks:
        h = chunk(*h) if isinstance(h, tuple) else chunk(h)
    assert isinstance(h, torch.Tensor), f"the last chunk returned {type(h).__name__}"
    return h
