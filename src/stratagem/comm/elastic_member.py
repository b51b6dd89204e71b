"""A worker's side of an elastic membership change: its rank in the next round, and the rebuild
of its group in place (``ProcessGroupCommunicator.rebuild``), with no new process.

Survivors keep their order: the next round's ranks are the old ones with the lost ranks taken
out (the lowest survivor becomes rank 0, the next chief). Newcomers take the ranks after the
survivors, whose ranks stay. Every member computes the same answer from the same facts (the
round and the lost ranks, from the agent); the channel that tells them is not here.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

import torch.distributed as dist

from stratagem.errors import RendezvousError

#: Where the agent posts what follows a round (``RoundDecision``), in the job's store.
DECISION_KEY = "stratagem/elastic/after-round-{round}"
#: Where a worker says it goes on in place after a change (every survivor must have).
IN_PLACE_KEY = "stratagem/elastic/in-place/{round}/{rank}"
#: Set ("1") by an agent that may keep survivors in place (a job on one machine); over several
#: machines every change starts new processes, so a worker must not wait for a word.
IN_PLACE_VARIABLE = "STRATAGEM_ELASTIC_IN_PLACE"


def agent_keeps_survivors() -> bool:
    """Whether this worker's agent may keep survivors in their processes after a change."""
    return os.environ.get(IN_PLACE_VARIABLE) == "1"


@dataclass(frozen=True)
class RoundDecision:
    """The agent's word after a lost worker: the next round, the lost ranks, why (in words)."""

    round: int
    lost: tuple[int, ...]
    why: str

    def encode(self) -> bytes:
        return json.dumps({"round": self.round, "lost": list(self.lost), "why": self.why}).encode()

    @classmethod
    def decode(cls, raw: bytes, *, key: str) -> RoundDecision:
        try:
            fields = json.loads(raw)
            lost = tuple(int(r) for r in fields["lost"])
            decision = cls(int(fields["round"]), lost, fields["why"])
        except (ValueError, KeyError, TypeError) as e:
            raise RendezvousError(
                f"the elastic agent's decision at {key!r} is not one: {raw[:200]!r} ({e})"
            ) from None
        if not isinstance(decision.why, str):
            raise RendezvousError(f"the elastic agent's decision at {key!r} has no reason")
        return decision


class Rebuildable(Protocol):
    """What a membership change needs of the communicator."""

    rank: int
    world_size: int
    round: int

    def rebuild(self, *, round: int, rank: int, world_size: int) -> None: ...


def ranks_after_loss(world_size: int, lost: Collection[int]) -> dict[int, int]:
    """Each survivor's old rank mapped to its rank in the next round, in the old order."""
    bad = sorted(r for r in lost if isinstance(r, bool) or not isinstance(r, int))
    wrong = sorted(r for r in lost if r not in bad and not 0 <= r < world_size)
    if bad or wrong or not lost or len(set(lost)) != len(lost) or len(lost) >= world_size:
        raise ValueError(
            f"lost ranks {sorted(lost, key=str)} of a world of {world_size}: expected one or "
            f"more distinct ranks in 0..{world_size - 1}, leaving at least one survivor"
        )
    survivors = [r for r in range(world_size) if r not in set(lost)]
    return {old: new for new, old in enumerate(survivors)}


def continue_without(comm: Rebuildable, *, round: int, lost: Collection[int]) -> int:
    """Rebuild ``comm``'s group for ``round`` without the ``lost`` ranks; its new rank."""
    after = ranks_after_loss(comm.world_size, lost)
    if comm.rank not in after:
        raise ValueError(
            f"rank {comm.rank} is among the lost ranks {sorted(lost)}: a lost worker does not "
            "rebuild, it ends"
        )
    rank = after[comm.rank]
    comm.rebuild(round=round, rank=rank, world_size=len(after))
    return rank


def admit(comm: Rebuildable, *, round: int, newcomers: int) -> None:
    """Rebuild ``comm``'s group for ``round`` with ``newcomers`` more members after it (each
    started with its rank, the world's size and the round; see ``STRATAGEM_ELASTIC``)."""
    if isinstance(newcomers, bool) or not isinstance(newcomers, int) or newcomers < 1:
        raise ValueError(f"newcomers={newcomers!r}; expected a positive number of workers")
    comm.rebuild(round=round, rank=comm.rank, world_size=comm.world_size + newcomers)


def offer_in_place(store: dist.Store, *, round: int, rank: int) -> None:
    """Say that this worker goes on in place after a change in ``round`` (its fit can)."""
    store.set(IN_PLACE_KEY.format(round=round, rank=rank), b"1")


def all_in_place(store: dist.Store, *, round: int, ranks: Collection[int]) -> bool:
    """Whether every one of ``ranks`` said it goes on in place in ``round`` (the agent asks)."""
    return store.check([IN_PLACE_KEY.format(round=round, rank=r) for r in ranks])


def post_decision(store: dist.Store, *, after: int, decision: RoundDecision) -> None:
    """The agent's word to the survivors of round ``after``."""
    store.set(DECISION_KEY.format(round=after), decision.encode())


def await_decision(store: dist.Store, *, after: int, timeout_s: float) -> RoundDecision:
    """The agent's word after round ``after``, waited for up to ``timeout_s``."""
    key = DECISION_KEY.format(round=after)
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError) as e:
        raise RendezvousError(
            f"no word from the elastic agent on round {after + 1} within {timeout_s:g} s after "
            f"a peer was lost ({e}); expected the agent to post the next round"
        ) from None
    return RoundDecision.decode(store.get(key), key=key)
