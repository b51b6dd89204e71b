"""Every connection of a process group proves, with the job's secret, that a task of the job is
at its other end.

gloo's connections have no credentials: a listener matches an incoming connection to a peer by
a small sequence number, so a process that reaches the port first, with the right number, is
taken for that peer. The sealed store keeps the addresses and numbers secret, but numbers are
small and ports can be scanned. So once the group is up, each pair of tasks runs a challenge
over the very connection between them (an all-to-all, which gloo sends pair by pair): task i
sends each peer j a fresh random challenge, and j answers with an HMAC of it under the job's
secret, bound to the direction (j to i). An impostor on a connection cannot answer.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from stratagem.cluster.job_secret import key_for
from stratagem.errors import RendezvousError

_BYTES = 32


def _answer(key: bytes, sender: int, receiver: int, challenge: bytes) -> bytes:
    message = f"{sender}->{receiver}|".encode() + challenge
    return hmac.new(key, message, hashlib.sha256).digest()


def check_peers(
    secret: bytes,
    *,
    rank: int,
    world_size: int,
    peer_name: Callable[[int], str],
    group: dist.ProcessGroup | None = None,
) -> None:
    """Challenge every peer over its connection; raise ``RendezvousError`` naming the first
    peer whose answer is wrong. ``peer_name(rank)`` names a rank in errors."""
    if world_size < 2:
        return
    key = key_for(secret, "connections")
    challenges = [os.urandom(_BYTES) for _ in range(world_size)]
    sent = torch.frombuffer(bytearray(b"".join(challenges)), dtype=torch.uint8)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    got = bytes(received.numpy())
    answers = b"".join(
        _answer(key, rank, j, got[j * _BYTES : (j + 1) * _BYTES]) for j in range(world_size)
    )
    replies = torch.empty_like(sent)
    dist.all_to_all_single(
        replies, torch.frombuffer(bytearray(answers), dtype=torch.uint8), group=group
    )
    back = bytes(replies.numpy())
    for j in range(world_size):
        if j == rank:
            continue
        expected = _answer(key, j, rank, challenges[j])
        if not hmac.compare_digest(back[j * _BYTES : (j + 1) * _BYTES], expected):
            raise RendezvousError(
                f"the connection from {peer_name(rank)} to {peer_name(j)} failed the job "
                "secret's check: the process at its other end is not a task of this job (or "
                "was given another STRATAGEM_JOB_SECRET). Stop whatever else is connecting to "
                "this job's ports"
            )
