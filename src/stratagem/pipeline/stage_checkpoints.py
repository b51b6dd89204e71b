"""Checkpoints of a pipeline's stages, and gathering the stages into the whole model.

A checkpoint is a directory of one file per stage, ``stage-S.pt``, written by replica 0 of the
stage: its layers under the unsplit model's names, so that the stage files of one save together
are the whole model's state dict. A restore gives each rank its stage's file back and refuses
one cut differently. The gathers bring every stage's layers and optimizer state to every
process, so that a whole-model checkpoint (``model.save``, ``ModelCheckpoint``) can be written.

A parameter shared between stages (tied embeddings) is written once, by the stage of its first
use (its owner): the other stages' files name it instead (``"shared"``), and a restore or a
gather loads every copy, under every name, from that one tensor.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from stratagem.comm import Communicator
from stratagem.errors import CheckpointError
from stratagem.pipeline.shared import SharedParameter
from stratagem.pipeline.stage_layout import PipelineLayout


class StageCheckpoints:
    """Saves, restores and gathers this rank's ``module`` (its stages' layers).

    ``flush`` runs what is still in flight first: it belongs to the weights being saved or
    replaced.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        layout: PipelineLayout,
        stage: int,
        replica: int,
        split_points: Sequence[int | str],
        schedule_name: str,
        comm: Communicator,
        flush: Callable[[], None],
        shared: Sequence[SharedParameter] = (),
    ) -> None:
        self.module = module
        self.layout = layout
        self.stage = stage
        self.replica = replica
        self.split_points = list(split_points)
        self.schedule_name = schedule_name
        self._comm = comm
        self._flush = flush
        # Every later name of a shared parameter -> its first (the name the owner writes).
        self._first_name = {n: s.names[0] for s in shared for n in s.names[1:]}
        # This stage's names of shared parameters another stage owns -> (owner, owner's name):
        # not written here, read from the owner's file.
        names = dict(module.named_parameters(remove_duplicate=False))
        self._borrowed = {
            n: (s.owner, s.names[0])
            for s in shared
            if s.owner != stage
            for n in s.names
            if n in names
        }
        self._borrowed_ids = {id(names[n]) for n in self._borrowed}

    def _own_state(self) -> dict[str, torch.Tensor]:
        """This stage's layers but the shared parameters another stage writes."""
        return {k: v for k, v in self.module.state_dict().items() if k not in self._borrowed}

    def _cut(self) -> dict[str, Any]:
        """How the model was cut: a checkpoint restores only into a pipeline cut the same."""
        return {
            "num_stages": self.layout.num_stages,
            "stages_per_rank": self.layout.stages_per_rank,
            "split_points": self.split_points,
        }

    # ------------------------------------------------------------------ the whole model

    def gather_module(self, whole: nn.Module) -> None:
        """Every stage's current layers into ``whole``, on every process (collective)."""
        mine = self._own_state() if self.replica == 0 else {}
        merged: dict[str, torch.Tensor] = {}
        for part in self._comm.all_gather_object(mine, what="the pipeline stages' layers"):
            merged.update(part)
        for name, first in self._first_name.items():  # a shared tensor came once: every name
            merged.setdefault(name, merged[first])
        whole.load_state_dict(merged)

    def gather_optimizer_state(self, whole: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Every stage's optimizer state into ``optimizer`` over ``whole`` (collective)."""
        by_name = dict(whole.named_parameters())
        own = {id(p) for p in self.module.parameters()}
        sent = own - self._borrowed_ids  # a shared parameter's state comes from its owner
        mine = {}
        if self.replica == 0:
            mine = {
                n: optimizer.state[p]
                for n, p in by_name.items()
                if id(p) in sent and p in optimizer.state
            }
        for part in self._comm.all_gather_object(mine, what="the pipeline stages' optimizer state"):
            for name, state in part.items():
                p = by_name[name]
                if id(p) not in own:
                    optimizer.state[p] = {
                        k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()
                    }

    # ------------------------------------------------------------------ checkpoints

    def save(
        self,
        path: str,
        optimizer: torch.optim.Optimizer | None,
        tensors: Mapping[str, torch.Tensor],
    ) -> str:
        """Write ``stage-S.pt`` into ``path`` (replica 0), atomically; return when all have."""
        os.makedirs(path, exist_ok=True)
        self._flush()
        if self.replica == 0:
            state = {
                "model": self._own_state(),
                "shared": {n: {"stage": s, "name": f} for n, (s, f) in self._borrowed.items()},
                "optimizer": optimizer.state_dict() if optimizer is not None else None,
                "tensors": {k: v.detach().clone() for k, v in tensors.items()},
                "layout": {**self._cut(), "schedule": self.schedule_name},
            }
            final = os.path.join(path, f"stage-{self.stage}.pt")
            tmp = f"{final}.tmp-{os.getpid()}"
            torch.save(state, tmp)
            os.replace(tmp, final)
        self._comm.barrier(what="the pipeline checkpoint's stage files")
        return path

    def restore(
        self,
        path: str,
        optimizer: torch.optim.Optimizer | None,
        tensors: Mapping[str, torch.Tensor],
    ) -> None:
        """Load this rank's stage file of ``path`` (and optimizer, and ``tensors`` in place)."""
        self._flush()  # what is in flight belongs to the weights being replaced
        file = os.path.join(path, f"stage-{self.stage}.pt")
        first = os.path.join(path, "stage-0.pt")  # every save has one: its cut, if not mine
        if not os.path.exists(file) and not os.path.exists(first):
            raise FileNotFoundError(
                f"no pipeline checkpoint for stage {self.stage} at {file!r} (expected the "
                "directory PipelineModel.save wrote)"
            )
        state = torch.load(file if os.path.exists(file) else first, weights_only=True)
        saved, mine = state["layout"], self._cut()
        if any(saved[k] != v for k, v in mine.items()):
            raise CheckpointError(
                f"checkpoint {path!r} was saved by a pipeline cut into {_cut_words(saved)}; "
                f"this one is cut into {_cut_words(mine)}: a pipeline's own checkpoint restores "
                "into the same stages and split points only (on any number of replicas); to "
                "change the stages, checkpoint the whole model (sg.train.Checkpoint of the "
                "sg.keras.Model, or BackupAndRestore), which gathers every stage"
            )
        if not os.path.exists(file):
            raise FileNotFoundError(
                f"pipeline checkpoint {path!r} has no file for stage {self.stage} ({file!r}): "
                "it is incomplete"
            )
        missing = [k for k in tensors if k not in state["tensors"]]
        if missing or (optimizer is not None and state["optimizer"] is None):
            raise ValueError(
                f"checkpoint {path!r} has no {missing or 'optimizer'} (it saved tensors "
                f"{sorted(state['tensors'])} and {'an' if state['optimizer'] else 'no'} optimizer)"
            )
        self.module.load_state_dict({**state["model"], **self._read_borrowed(path)})
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for k, t in tensors.items():
                t.copy_(state["tensors"][k])

    def _read_borrowed(self, path: str) -> dict[str, torch.Tensor]:
        """The shared parameters this stage holds but another owns, from the owner's file:
        every copy is loaded from the one tensor written (whatever this stage's file holds)."""
        files: dict[int, dict[str, torch.Tensor]] = {}
        values = {}
        for name, (owner, first) in self._borrowed.items():
            if owner not in files:
                file = os.path.join(path, f"stage-{owner}.pt")
                files[owner] = torch.load(file, weights_only=True)["model"]
            if first not in files[owner]:
                raise ValueError(
                    f"checkpoint {path!r}: stage {owner}'s file has no {first!r}, which stage "
                    f"{self.stage}'s {name!r} shares (its file names {sorted(files[owner])})"
                )
            values[name] = files[owner][first]
        return values


def _cut_words(cut: Mapping[str, Any]) -> str:
    """A cut (``StageCheckpoints._cut``) in words."""
    return (
        f"{cut['num_stages']} stage(s) at split points {cut['split_points']} "
        f"({cut['stages_per_rank']} per process)"
    )
