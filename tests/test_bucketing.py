"""The gradient reducer's buckets, in one process: a communicator standing for a world of two
identical replicas (a sum is twice the local value) records when each bucket's all-reduce
starts, so overlap with backward is checked by order, never by time."""

from __future__ import annotations

import pytest
import torch

from stratagem.comm.bucketing import GradientReducer
from stratagem.comm.communicator import LocalCommunicator, PendingOp
from stratagem.distribute import multi_worker_mirrored_strategy as mwms


class _Doubled(PendingOp):
    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def wait(self) -> None:
        self._tensor.mul_(2)  # the sum over two replicas that computed the same


class _TwoReplicas(LocalCommunicator):
    """A world of two identical replicas: each launch is recorded with whether backward was
    still running then."""

    def __init__(self) -> None:
        super().__init__()
        self.world_size = 2
        self.reducer: GradientReducer | None = None
        self.launches: list[bool] = []  # per bucket all-reduce: started during backward?

    def all_reduce(self, tensor, op=None, *, what):  # type: ignore[no-untyped-def]
        return None  # who still holds what: the same on both replicas

    def all_reduce_async(self, tensor: torch.Tensor, *, what: str) -> PendingOp:
        assert self.reducer is not None
        self.launches.append(self.reducer._in_backward)
        return _Doubled(tensor)


class _Tied(torch.nn.Module):
    """An embedding, a body, and a head tied to the embedding after it was made (as Hugging
    Face ties ``lm_head`` to ``wte``): the head's own first weight is dropped."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.body = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))
        self.head = torch.nn.Linear(8, 16, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)))


def _tied_under_a_reducer() -> tuple[_TwoReplicas, GradientReducer, _Tied]:
    """A tied model whose parameters the reducer adopted before the tie, in buckets of one or
    two parameters each (so the order shows)."""
    torch.manual_seed(0)
    comm = _TwoReplicas()
    reducer = GradientReducer(comm, first_bucket_bytes=64 * 4, bucket_bytes=64 * 4)
    comm.reducer = reducer
    model = _Tied()
    reducer.add_parameters(list(model.parameters()))
    model.head.weight = model.embed.weight  # the tie: the adopted head weight is let go
    return comm, reducer, model


def _reference_grads(model: _Tied, ids: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of one process training a copy of ``model``, untouched by any reducer."""
    reference = _Tied()
    reference.load_state_dict(model.state_dict(), strict=False)
    reference.head.weight = reference.embed.weight
    reference(ids).square().mean().backward()
    return [q.grad for q in reference.parameters()]


def test_a_parameter_dropped_after_adoption_does_not_hold_back_the_buckets() -> None:
    """The head's first weight, adopted and then replaced by the tie, was last made: it sits in
    the first bucket, which waited for it until the end of backward, and every bucket after it
    with it (no overlap at all: GPT-2 under MWMS). Now every bucket but the last (the tied
    weight's, whose gradient completes last) starts while backward runs, and the gradients are
    the sums."""
    comm, _, model = _tied_under_a_reducer()
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    expected = _reference_grads(model, ids)
    model(ids).square().mean().backward()

    assert len(comm.launches) >= 4
    assert all(comm.launches[:-1]), comm.launches
    for (name, p), g in zip(model.named_parameters(), expected):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, 2 * g, msg=name)


def test_a_slot_every_process_let_go_leaves_the_buckets_after_one_step() -> None:
    """The tied-away head weight goes out as zeros in the first step (its live flag 0 on both
    replicas), and from then on not at all: the buckets are rebuilt without it, on every
    process alike (they all read the same sums). Gradients stay the sums."""
    comm, reducer, model = _tied_under_a_reducer()
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    live = list(model.parameters())
    slots = sum(b.numel for b in reducer._buckets)
    assert slots == sum(p.numel() for p in live) + 16 * 8  # the head's first weight too

    model(ids).square().mean().backward()
    assert sum(b.numel for b in reducer._buckets) == sum(p.numel() for p in live)
    assert len(reducer._entries) == len(live)

    for p in live:
        p.grad = None
    comm.launches.clear()
    expected = _reference_grads(model, ids)
    model(ids).square().mean().backward()
    assert all(comm.launches[:-1]), comm.launches
    for (name, p), g in zip(model.named_parameters(), expected):
        torch.testing.assert_close(p.grad, 2 * g, msg=name)


def test_the_buckets_a_rebuild_replaced_are_freed_at_once() -> None:
    """After the tied-away weight's slot leaves the buckets, the old buckets' buffers are freed
    when the rebuild drops them, without waiting for the cycle collector: a dropped entry no
    longer points at its old bucket, which pointed back at it (under MWMS a tied GPT-2 kept a
    second copy of its gradient buffers until Python's collector ran)."""
    import gc
    import weakref

    _, reducer, model = _tied_under_a_reducer()
    old = [weakref.ref(b.buffer) for b in reducer._buckets]
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    gc.disable()
    try:
        model(ids).square().mean().backward()  # the flush at its end rebuilds the buckets
        assert [r() is None for r in old] == [True] * len(old)
    finally:
        gc.enable()


class _Gathering(LocalCommunicator):
    """This process and ``others``, as the host, thread and core counts each reports."""

    def __init__(self, others: list[list]) -> None:
        super().__init__()
        self.others = others
        self.world_size = 1 + len(others)

    def all_gather_object(self, obj, *, what):  # type: ignore[no-untyped-def]
        return [obj, *self.others]


@pytest.mark.parametrize(
    ("others", "expected"),
    [
        ([["here", 1, 4]] * 3, True),  # 4 single-threaded processes on a 4-core host
        ([["here", 1, 4]], False),  # 2 of them: half its cores idle, overlap can use them
        ([["elsewhere", 3, 4]], False),  # two hosts: a network between them
    ],
)
def test_one_pack_only_where_the_processes_fill_one_hosts_cores(monkeypatch, others, expected):
    monkeypatch.setattr(mwms.socket, "gethostname", lambda: "here")
    monkeypatch.setattr(mwms, "usable_cpus", lambda: 4)
    monkeypatch.setattr(mwms.torch, "get_num_threads", lambda: 1)
    assert mwms.one_pack_fits(_Gathering(others)) is expected
