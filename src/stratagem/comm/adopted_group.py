"""The roll call over a default process group that someone else started (Ray Train's
``TorchTrainer`` calls ``init_process_group`` in every worker before the user's function runs;
so may a user).

There is no store of ours then (the group's port is already taken by the owner's store), so the
roll call's facts (who each rank is, its liveness server, the cluster it was given) travel over
the group itself, as JSON bytes in tensors, so a lost peer is still named. The communicator that
joins such a group is ``process_group.AdoptedGroupCommunicator``; it hands in its all-gather.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from stratagem.comm.rendezvous import Member, _check_agreement, _decode, _encode
from stratagem.errors import RendezvousError

# Room for one member's JSON record (a few hundred bytes in practice).
_RECORD_BYTES = 4096


def exchange_over_group(
    me: Member, *, device: str, all_gather: Callable[[torch.Tensor], list[torch.Tensor]]
) -> list[Member]:
    """Every rank's sign-in record, gathered over the group by ``all_gather`` (a tensor on
    ``device`` in, every rank's tensor out); checked as the roll call checks them."""
    raw = _encode(me).encode("utf-8")
    if len(raw) > _RECORD_BYTES:
        raise RendezvousError(f"{me.name}'s sign-in record is {len(raw)} bytes, too long")
    record = torch.zeros(_RECORD_BYTES + 8, dtype=torch.uint8, device=device)
    record[:8] = torch.tensor(list(len(raw).to_bytes(8, "little")), dtype=torch.uint8)
    record[8 : 8 + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    members = []
    for rank, theirs in enumerate(all_gather(record)):
        data = bytes(theirs.cpu().tolist())
        size = min(int.from_bytes(data[:8], "little"), _RECORD_BYTES + 1)
        other = _decode(data[8 : 8 + size], key=f"rank {rank}'s record", me=me.name)
        if other.rank != rank:
            raise RendezvousError(
                f"{other.name} signed in as rank {other.rank} but holds rank {rank} of the "
                "group; every process must be given its own rank"
            )
        _check_agreement(me, other)
        members.append(other)
    return members
