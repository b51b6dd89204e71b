"""Point-to-point tensor transfers between stage processes, shapes included.

Each transfer is a small header (dtype code, rank, shape) then the data, on the same tag, so a
receiver needs no shape inference and a stage may send micro-batches of any size. gloo delivers
messages between two ranks on one tag in the order they were sent, which keeps micro-batches in
order. Every receive waits at most ``timeout`` seconds and then names the peer and the message.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from stratagem.errors import CollectiveTimeoutError, PeerLostError

_MAX_DIMS = 8
# Codes are positions: append only (bool: the attention masks traced stages hand on).
_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.bool,
]


def _wait(work: dist.Work, what: str, peer: int, timeout: float) -> None:
    try:
        work.wait(datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
        if "closed" in first.lower() or "reset" in first.lower():
            raise PeerLostError(
                f"rank {peer} was lost during the pipeline transfer of {what}: {first}"
            ) from e
        raise CollectiveTimeoutError(
            f"pipeline transfer of {what} with rank {peer} did not complete within "
            f"{timeout:g}s (STRATAGEM_OP_TIMEOUT): {first}"
        ) from e


def send(
    tensor: torch.Tensor, dst: int, tag: int
) -> tuple[list[dist.Work], tuple[torch.Tensor, torch.Tensor]]:
    """Start sending ``tensor`` to global rank ``dst``; keep the works and buffers until done."""
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(f"cannot send a {tensor.dim()}-d tensor between stages (at most 8-d)")
    if tensor.dtype not in _DTYPES:
        raise ValueError(f"cannot send a {tensor.dtype} tensor between stages ({_DTYPES})")
    data = tensor.detach().contiguous()
    header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
    header[0] = _DTYPES.index(data.dtype)
    header[1] = data.dim()
    header[2 : 2 + data.dim()] = torch.tensor(data.shape, dtype=torch.int64)
    works = [dist.isend(header, dst, tag=tag), dist.isend(data, dst, tag=tag)]
    return works, (header, data)


def recv(src: int, tag: int, *, what: str, timeout: float) -> torch.Tensor:
    """Receive one tensor sent by ``send`` from global rank ``src`` on ``tag``."""
    header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
    _wait(dist.irecv(header, src, tag=tag), what, src, timeout)
    dtype = _DTYPES[int(header[0])]
    shape = [int(d) for d in header[2 : 2 + int(header[1])]]
    out = torch.empty(shape, dtype=dtype)
    _wait(dist.irecv(out, src, tag=tag), what, src, timeout)
    return out


def send_values(
    values: torch.Tensor | tuple[torch.Tensor, ...], dst: int, tag: int
) -> tuple[list[dist.Work], list[object]]:
    """Start sending a tensor, or a tuple of them (what a traced stage hands on), to ``dst``:
    a count first (-1: one tensor, not a tuple), then each tensor as ``send`` does."""
    items = values if isinstance(values, tuple) else (values,)
    count = torch.tensor([len(items) if isinstance(values, tuple) else -1], dtype=torch.int64)
    works, buffers = [dist.isend(count, dst, tag=tag)], [count]
    for t in items:
        w, b = send(t, dst, tag)
        works += w
        buffers.append(b)
    return works, buffers


def recv_values(
    src: int, tag: int, *, what: str, timeout: float
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Receive what ``send_values`` sent from ``src``: the tensor, or the tuple."""
    count = torch.zeros(1, dtype=torch.int64)
    _wait(dist.irecv(count, src, tag=tag), what, src, timeout)
    n = int(count)
    items = tuple(recv(src, tag, what=what, timeout=timeout) for _ in range(max(n, 1)))
    return items[0] if n < 0 else items


class Outbox:
    """Sends in flight: their works and buffers are kept until they complete."""

    def __init__(self, timeout: float) -> None:
        self._pending: list[tuple[list[dist.Work], object, str, int]] = []
        self._timeout = timeout

    def send(self, tensor: torch.Tensor, dst: int, tag: int, what: str) -> None:
        works, buffers = send(tensor, dst, tag)
        self._pending.append((works, buffers, what, dst))
        # Reap finished sends so that a long run does not hold every buffer.
        while self._pending and all(w.is_completed() for w in self._pending[0][0]):
            self._pending.pop(0)

    def drain(self) -> None:
        for works, _, what, dst in self._pending:
            for w in works:
                _wait(w, what, dst, self._timeout)
        self._pending.clear()
