"""The one place that reads private fields of torch's dynamic rendezvous (torch 2.13).

torch's ``DynamicRendezvousHandler`` tells no one which round a completed ``next_rendezvous``
joined (only its store's key prefix holds it); workers need it to meet in that round's
namespace. ``tests/test_elastic_rendezvous.py`` pins the fields read here, so a torch that
renames them fails there by name instead of here at run time.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler


def joined_round(handler: DynamicRendezvousHandler) -> int:
    """The round of the rendezvous state ``handler`` holds: right after ``next_rendezvous``
    returns, the round it joined (its heartbeats, the only other writer, start a full
    keep-alive interval later)."""
    return int(handler._state_holder.state.round)
