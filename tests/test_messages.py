"""comm.messages, in one process: a ps's method table served over loopback to connections, with
the job secret's challenge, and every wait bounded and named (issue 14)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch.futures import Future

from cluster_utils import free_ports
from stratagem.comm.messages import Connection, Later, MessageServer
from stratagem.distribute.ps.shard_store import ShardStore, UpdateRule, methods, pairs
from stratagem.errors import CollectiveTimeoutError, PeerLostError, RendezvousError

SECRET = b"a-secret-of-the-test-0123456789"
WORKERS = ["worker:0", "worker:1"]


@contextmanager
def _served(table: dict, *, secret: bytes | None = SECRET) -> Iterator[tuple[str, MessageServer]]:
    port = free_ports(1)[0]
    server = MessageServer(
        "localhost",
        port,
        name="ps 0",
        secret=secret,
        clients=WORKERS,
        methods=table,
        handshake_timeout=5,
        note_every=0.05,
    )
    try:
        yield f"localhost:{port}", server
    finally:
        server.close()


def _connect(address: str, me: str = "worker:0", timeout: float = 5.0, **kw) -> Connection:
    return Connection(address, me=me, peer="ps 0", secret=kw.pop("secret", SECRET), timeout=timeout)


def _never_ended() -> bool:
    return False


def _sync_store() -> ShardStore:
    # The first torch optimizer made in a process imports torch._dynamo (1.5 s here): made now,
    # not by the push, whose first "waiting" note would come after the client's short timeout
    # when this test runs before any other made one.
    torch.optim.SGD([torch.zeros(1)], lr=1.0)
    store = ShardStore("ps:0", 2)
    store.create(UpdateRule("sync", 2, 2), 0, {(0, 0): torch.zeros(3)})
    return store


def _push(connection: Connection, worker: int, silent) -> object:  # type: ignore[no-untyped-def]
    args = [worker, ["torch.optim", "SGD"], [[{"lr": 1.0}, [[0, 0]]]], 0, [torch.ones(3)]]
    return connection.call("push", args, what="a push", silent=silent, peer_ended=_never_ended)


def test_a_ps_table_answers_with_tensors_and_errors_keep_their_type() -> None:
    store = ShardStore("ps:0", 1)
    with _served(methods(store, WORKERS[:1])) as (address, _):
        c = _connect(address)
        kw = {"silent": lambda names: [], "peer_ended": _never_ended}
        rule = {**UpdateRule("async", 1, 1, compression="bf16").__dict__}
        values = {(0, 0): torch.arange(4.0), (1, 0): torch.tensor(2.5)}
        c.call("create", [rule, 0, pairs(values)], what="the creation", **kw)
        got = c.call("fetch", [0, [[0, 0], [1, 0]]], what="a fetch", **kw)
        assert [t.dtype for t in got] == [torch.bfloat16, torch.bfloat16]
        assert got[0].tolist() == [0.0, 1.0, 2.0, 3.0] and got[1].shape == ()
        with pytest.raises(KeyError, match=r"ps 0 could not do a pull: .*holds no shard \(9, 9\)"):
            c.call("read", [[[9, 9]]], what="a pull", **kw)
        # The connection serves on after an error of the method's own.
        assert c.call("stats", [], what="its statistics", **kw)["steps"] == 0
        c.close()


def test_a_connection_must_prove_the_secret_and_a_task_of_the_job() -> None:
    with _served({"stats": lambda: 1}) as (address, server):
        with pytest.raises(RendezvousError, match="proof of the job secret is wrong"):
            _connect(address, secret=b"another-secret-0123456789")
        with pytest.raises(RendezvousError, match="'ps:1' is not a task this server serves"):
            _connect(address, me="ps:1")
        assert server.refused == 2
    with _served({"stats": lambda: 1}, secret=None) as (address, _):  # STRATAGEM_INSECURE=1
        c = _connect(address, secret=None)
        assert c.call("stats", [], what="x", silent=list, peer_ended=_never_ended) == 1
        c.close()


def test_a_sync_push_waiting_for_a_stopped_worker_names_that_worker() -> None:
    """Worker 1 does not answer its liveness probe: worker 0's push ends after the operation
    timeout with a CollectiveTimeoutError naming worker 1, not the ps."""
    with _served(methods(_sync_store(), WORKERS)) as (address, _):
        c = _connect(address, timeout=0.5)
        asked: list[list[str]] = []

        def silent(names: list[str]) -> list[str]:
            asked.append(names)
            return ["worker 1 (localhost:1)"]

        with pytest.raises(CollectiveTimeoutError) as info:
            _push(c, 0, silent)
        message = str(info.value)
        assert message.startswith("a push to ps 0 did not complete in"), message
        assert "the push waits for worker 1's gradient for update 1" in message
        assert "worker 1 (localhost:1) has not answered its liveness probe" in message
        assert asked and all(names == ["worker:1"] for names in asked)


def test_a_wait_on_live_workers_outlasts_the_timeout() -> None:
    """While worker 1 answers its probe, worker 0's push waits past the operation timeout; it
    completes when worker 1 pushes (after ten notes, twice the timeout's worth)."""
    with _served(methods(_sync_store(), WORKERS)) as (address, _):
        first, second = _connect(address, timeout=0.25), _connect(address, "worker:1")
        notes = threading.Semaphore(0)
        late: list[object] = []

        def alive(names: list[str]) -> list[str]:
            notes.release()
            return []

        def push_later() -> None:
            for _ in range(10):
                notes.acquire()
            late.append(_push(second, 1, alive))

        thread = threading.Thread(target=push_later)
        thread.start()
        values, version = _push(first, 0, alive)  # type: ignore[misc]
        thread.join(timeout=30)
        assert version == 1 and values[0].tolist() == [-1.0, -1.0, -1.0]
        assert late and late[0][1] == 1  # type: ignore[index]


def test_a_ps_that_stops_answering_or_ends_is_named() -> None:
    release = threading.Event()

    def stuck() -> int:
        release.wait(30)  # no notes: as a SIGSTOPped ps sends none
        return 0

    def later() -> Later:
        return Later(Future(), lambda: ("", []))

    with _served({"stuck": stuck, "later": later}) as (address, server):
        c = _connect(address, timeout=0.3)
        with pytest.raises(
            CollectiveTimeoutError, match=r"ps 0 did not answer a pull in \d+ s: its"
        ):
            c.call("stuck", [], what="a pull", silent=list, peer_ended=_never_ended)
        c = _connect(address, timeout=0.3)
        with pytest.raises(PeerLostError, match="ps 0 did not answer a pull: its process ended"):
            c.call("stuck", [], what="a pull", silent=list, peer_ended=lambda: True)
        c = _connect(address, timeout=30)
        c.send("later", [], what="a push")
        server.close()  # the ps's connections close with it
        with pytest.raises(PeerLostError, match="ps 0 did not answer a push: the connection clo"):
            c.receive(1, what="a push", silent=list, peer_ended=_never_ended)
        release.set()


def test_a_shared_memory_segment_is_only_a_file_of_ours_in_dev_shm(tmp_path) -> None:
    from stratagem.comm import shared_segment
    from stratagem.errors import PeerDataError

    def announce(name: bytes, size: int = 16) -> object:
        data = bytes([len(name)]) + name + size.to_bytes(8, "little") + bytes(16)
        offset = 0

        def read(n: int) -> bytes:
            nonlocal offset
            offset += n
            return data[offset - n : offset]

        return read

    for name, why in (
        (b"../../etc/passwd", "not sg-<hex>"),
        (b"sg-" + b"0" * 32, "cannot be opened"),
    ):
        with pytest.raises(PeerDataError, match=why):
            shared_segment.ReceiveSegment(announce(name), peer="worker 1", check=True)
    if not shared_segment.available():
        pytest.skip("no /dev/shm")
    segment = shared_segment.SendSegment(4096)
    try:
        # A segment of ours, but smaller than announced, or without the token it was offered
        # with: refused.
        name = segment.announce[1 : 1 + segment.announce[0]]
        with pytest.raises(PeerDataError, match="not a file of this user of 8192 bytes"):
            shared_segment.ReceiveSegment(announce(name, 8192), peer="worker 1", check=True)
        with pytest.raises(PeerDataError, match="does not hold its token"):
            shared_segment.ReceiveSegment(announce(name, 4096), peer="worker 1", check=True)
    finally:
        segment.close()


def test_tensors_are_received_into_the_homes_offered_and_a_request_lends_its_own() -> None:
    # The server reads each request into the tensors of the one before (same dtype and shape),
    # and the client reads a reply into tensors it offers: no fresh allocation per step.
    seen: list[tuple[torch.Tensor, list[float]]] = []  # holding each: no address reused

    def echo_sum(t: torch.Tensor, other: torch.Tensor) -> list[torch.Tensor]:
        seen.append((t, t.tolist()))
        return [t + 1, other.double()]

    kw = {"silent": lambda names: [], "peer_ended": _never_ended}
    with _served({"echo": echo_sum}) as (address, _):
        c = _connect(address)
        home, mismatched = torch.zeros(3), torch.zeros(2)  # the second has the wrong dtype
        for step in range(3):
            rid = c.send("echo", [torch.full((3,), float(step)), torch.ones(2)], what="an echo")
            got = c.receive(rid, what="an echo", into=[home, mismatched], **kw)
            assert got[0] is home and home.tolist() == [step + 1.0] * 3
            assert got[1] is not mismatched and got[1].dtype == torch.float64
        c.close()
    assert [values for _, values in seen] == [[0.0] * 3, [1.0] * 3, [2.0] * 3]
    assert seen[2][0] is seen[1][0], "the third request was not read into the second's tensor"


def test_a_push_reply_lands_in_the_parameters_and_later_replies_do_not_alias() -> None:
    store = ShardStore("ps:0", 1)
    store.create(UpdateRule("async", 1, 1), 0, {(0, 0): torch.zeros(4)})
    param = torch.nn.Parameter(torch.zeros(4))
    kw = {"silent": lambda names: [], "peer_ended": _never_ended}
    with _served(methods(store, WORKERS[:1])) as (address, _):
        c = _connect(address)
        args = [0, ["torch.optim", "SGD"], [[{"lr": 0.5}, [[0, 0]]]], 0, [torch.ones(4)]]
        rid = c.send("push", args, what="a push")
        values, version = c.receive(rid, what="a push", into=[param.detach()], **kw)
        # The ps copied its reply into this worker's reply buffer: a second push changes the
        # shard, and the values this worker already holds stay as they were.
        second = c.call("push", args, what="a push", **kw)
        c.close()
    assert version == 1 and values[0].data_ptr() == param.data_ptr()
    assert param.tolist() == [-0.5] * 4
    assert second[1] == 2 and second[0][0].tolist() == [-1.0] * 4
    assert store.read([(0, 0)])[0].tolist() == [-1.0] * 4


def test_a_server_borrows_large_request_tensors_from_shared_memory_without_a_copy(
    monkeypatch,
) -> None:
    from stratagem.comm import shared_segment

    if not shared_segment.available():
        pytest.skip("no /dev/shm")

    def no_copy(self):  # type: ignore[no-untyped-def]
        raise AssertionError("a request's tensors were copied out of shared memory")

    monkeypatch.setattr(shared_segment.ReceiveSegment, "reader", no_copy)
    kept: list[torch.Tensor] = []

    def first(t: torch.Tensor) -> float:
        kept.append(t)
        t.mul_(2)  # a method may work on what it was lent in place (the view is writable)
        return float(t[-1])

    kw = {"silent": lambda names: [], "peer_ended": _never_ended}
    n = shared_segment.MIN_BYTES // 4  # float32 elements: large enough for shared memory
    with _served({"first": first}) as (address, _):
        c = _connect(address)
        assert c.call("first", [torch.full((n,), 3.0)], what="a call", **kw) == 6.0
        assert c.call("first", [torch.full((n,), 5.0)], what="a call", **kw) == 10.0
        c.close()
    # Both requests were views of the same bytes of the client's segment: lent, not owned.
    assert kept[0].data_ptr() == kept[1].data_ptr()


def test_a_frame_brings_back_tuples_and_tensors_wherever_they_sit() -> None:
    """The receiver's parse makes tagged tuples as it goes and puts the frame's tensors in
    afterwards, at any depth (in tuples in tuples, in dicts in lists); a tagged object with a
    field too many, or a tensor index the frame lacks, is refused."""
    from stratagem.comm import plain_data
    from stratagem.errors import PeerDataError

    a, b = torch.arange(3.0), torch.ones(2, 2, dtype=torch.int64)
    value = {
        "t": (1, (a, "x"), [None, {"deep": (b,)}]),
        "l": [True, 2.5, {"e": ()}],
        "plain": {"k": [1, 2]},
    }
    head, tensors = plain_data.encode_parts(value, what="the test")
    frame = head + b"".join(plain_data.tensor_buffer(t).tobytes() for t in tensors)
    got = plain_data.decode(frame, sender="peer", what="the test")
    assert got["l"] == [True, 2.5, {"e": ()}] and got["plain"] == {"k": [1, 2]}
    one, (ta, x), (none, deep) = got["t"]
    assert (one, x, none) == (1, "x", None)
    assert torch.equal(ta, a) and torch.equal(deep["deep"][0], b)
    assert type(got["t"][1]) is tuple and type(deep["deep"]) is tuple

    def frame_of(header: dict) -> bytes:
        raw = json.dumps(header).encode()
        return b"SGO1" + len(raw).to_bytes(8, "little") + raw

    for bad in (
        {"__sg__": "tuple", "items": [], "more": 1},
        [{"__sg__": "tensor", "index": 0}],
        {"__sg__": "tensor", "index": "0"},
    ):
        with pytest.raises(PeerDataError, match="peer"):
            plain_data.decode(frame_of({"value": bad, "tensors": []}), sender="peer", what="t")
