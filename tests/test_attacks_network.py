"""Attacks over the network on our own jobs (loopback only), and where our servers listen.

Issue 14, "no code from the network" and "binding": nothing a peer sends through an object
exchange or the roll call is unpickled (a forged pickle is refused with an error naming the
peer and the operation, and its payload, which would create a marker file, never runs); each
server listens on its task's own address, every interface only with STRATAGEM_BIND_ALL=1.
"""

from __future__ import annotations

import collections
import fcntl
import json
import os
import pickle
import socket
import struct
import sys
import threading
from pathlib import Path

import pytest
import torch

from cluster_utils import WORKERS, Process, child_env, free_ports, run_cluster
from stratagem.comm import plain_data
from stratagem.comm.binding import bind_address
from stratagem.comm.communicator import LocalCommunicator
from stratagem.comm.liveness import probe
from stratagem.comm.rendezvous import Member, listen_socket
from stratagem.errors import PeerDataError, RendezvousError

SCRIPT = WORKERS / "network_attacks.py"


class _Payload:
    """Harmless: unpickling it creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (self.marker, "w"))


def _live_pickle(marker: Path) -> bytes:
    """A pickle that does run code when loaded (checked here, so the attacks are real)."""
    data = pickle.dumps([_Payload(marker)])
    pickle.loads(data)[0].close()
    assert marker.exists(), "the payload must create its marker when unpickled"
    marker.unlink()
    return data


def _frame(value: object, tensors: list, body: bytes = b"") -> bytes:
    return _raw_frame(json.dumps({"value": value, "tensors": tensors}).encode(), body)


def _raw_frame(header: bytes, body: bytes = b"") -> bytes:
    return b"SGO1" + len(header).to_bytes(8, "little") + header + body


# ------------------------------------------------------------------ the schema, in one process


def test_plain_data_round_trips_what_our_callers_send() -> None:
    weight = torch.arange(6.0).reshape(2, 3).t()  # not contiguous
    sent = {
        # multi_worker_mirrored_strategy: shapes and dtypes as tuples, compared with ==
        "signature": [((3, 2), "torch.float32"), ((), "torch.int64")],
        "split_points": [2, 5],  # pipeline_strategy
        # stage_checkpoints: a state dict (an OrderedDict) and optimizer state
        "state": collections.OrderedDict(w=weight, b=torch.zeros(0, 4)),
        "optimizer": {"0.w": {"step": torch.tensor(3.0), "momentum_buffer": None}},
        "misc": [True, False, None, -7, 2.5, float("inf"), "é", {"nested": (1, [2, (3,)])}],
        "dtypes": [torch.ones(2, dtype=d) for d in (torch.bfloat16, torch.bool, torch.int8)],
    }
    received = plain_data.decode(plain_data.encode(sent, what="x"), sender="worker 1", what="x")
    assert received["signature"] == sent["signature"]
    assert received["split_points"] == [2, 5]
    assert type(received["state"]) is dict
    assert torch.equal(received["state"]["w"], weight)
    assert received["state"]["b"].shape == (0, 4)
    assert received["optimizer"]["0.w"]["step"].item() == 3.0
    assert received["optimizer"]["0.w"]["momentum_buffer"] is None
    assert received["misc"] == sent["misc"]
    for got, want in zip(received["dtypes"], sent["dtypes"], strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


class _Opaque:
    pass


@pytest.mark.parametrize(
    "value, named",
    [
        (_Opaque(), "_Opaque"),
        ({"a": [1, {"b": lambda: 0}]}, "value['a'][1]['b']"),
        ({3: "x"}, "key 3"),
        ({"__sg__": "tuple", "items": []}, "'__sg__'"),
        (b"raw bytes", "bytes"),
        (torch.eye(2).to_sparse(), "layout"),
        (torch.zeros(2, dtype=torch.uint16), "uint16"),
    ],
)
def test_the_sender_refuses_what_is_not_plain_data(value: object, named: str) -> None:
    with pytest.raises(TypeError, match="the weights") as info:
        plain_data.encode(value, what="the weights")
    assert named in str(info.value)
    # A world of one refuses too, so the mistake shows before a cluster runs it.
    with pytest.raises(TypeError, match=r"nothing is pickled|str keys|dense tensors|dtype"):
        LocalCommunicator().all_gather_object(value, what="the weights")


def test_the_receiver_refuses_every_frame_outside_the_schema(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    live = _live_pickle(marker)
    forged = {
        "a pickle": live,
        "nothing": b"",
        "a cut preamble": b"SGO1\x05",
        "a header longer than the frame": b"SGO1" + (10**6).to_bytes(8, "little") + b"{}",
        "a header that is not JSON": b"SGO1" + (4).to_bytes(8, "little") + b"\x80\x04K\x01",
        "a header with other fields": _raw_frame(b'{"value": [], "tensors": [], "code": 1}'),
        "a pickled dtype": _frame({"__sg__": "tensor", "index": 0}, [["object", [1]]], live),
        "too few tensor bytes": _frame({"__sg__": "tensor", "index": 0}, [["float32", [4]]], b"1"),
        "bytes after the tensors": _frame(1, [], live),
        "an unknown tag": _frame({"__sg__": "pickle", "data": live.hex()}, []),
        "a tensor index out of range": _frame({"__sg__": "tensor", "index": 1}, []),
        "a negative size": _frame(0, [["float32", [-1]]]),
        "deep nesting": _raw_frame(
            b'{"value": ' + b"[" * 100000 + b"]" * 100000 + b', "tensors": []}'
        ),
    }
    for name, frame in forged.items():
        with pytest.raises(PeerDataError) as info:
            plain_data.decode(frame, sender="worker 1 (localhost:1)", what="the split points")
        message = str(info.value)
        assert "worker 1 (localhost:1)" in message and "the split points" in message, name
    assert not marker.exists()


def test_a_forged_sign_in_record_is_a_named_rendezvous_error() -> None:
    from stratagem.comm import rendezvous

    good = Member(1, 2, "worker 1", "worker=2", 42, "h", "127.0.0.1:1")
    assert rendezvous._decode(rendezvous._encode(good).encode(), key="k", me="m") == good
    for raw in (
        pickle.dumps(good),
        b"[]",
        json.dumps({**good.__dict__, "rank": "1"}).encode(),
        json.dumps({**good.__dict__, "extra": 1}).encode(),
        b"{" * 70000,
    ):
        with pytest.raises(RendezvousError, match="worker 0 found a sign-in record under 'm/1'"):
            rendezvous._decode(raw, key="m/1", me="worker 0")


def test_a_liveness_answer_is_bounded() -> None:
    """A 'peer' that streams without end is an unanswering peer, not a memory sink."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def flood() -> None:
        conn, _ = server.accept()
        with conn:
            try:
                conn.sendall(b"x" * (1 << 20))
            except OSError:
                pass

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    try:
        assert probe(f"127.0.0.1:{server.getsockname()[1]}", timeout=5.0) is None
    finally:
        thread.join(timeout=10)
        server.close()


# ------------------------------------------------------------------ binding


def _routable_ipv4() -> str | None:
    """An IPv4 address of this machine that is not loopback, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            address = socket.inet_ntoa(packed[20:24])
            if not address.startswith("127."):
                return address
    return None


def test_bind_address_is_the_tasks_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STRATAGEM_BIND_ALL", raising=False)
    assert bind_address("localhost", 1)[1] == "127.0.0.1"
    assert bind_address("127.0.0.5", 1)[1] == "127.0.0.1"
    assert bind_address("10.1.2.3", 1)[1] == "10.1.2.3"  # never all interfaces unasked
    monkeypatch.setenv("STRATAGEM_BIND_ALL", "1")
    assert bind_address("10.1.2.3", 1)[1] == "0.0.0.0"
    assert bind_address("localhost", 1)[1] == "127.0.0.1"  # loopback jobs stay on loopback
    monkeypatch.setenv("STRATAGEM_BIND_ALL", "maybe")
    with pytest.raises(ValueError, match="STRATAGEM_BIND_ALL"):
        bind_address("10.1.2.3", 1)


def test_a_host_that_is_not_ours_is_a_named_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STRATAGEM_BIND_ALL", raising=False)
    # 192.0.2.0/24 is TEST-NET-1; an address of it that this machine does not hold.
    ours = _routable_ipv4()
    foreign = "192.0.2.254" if ours != "192.0.2.254" else "192.0.2.253"
    with pytest.raises(RendezvousError, match="must be an address of this machine") as info:
        listen_socket(foreign, free_ports(1)[0], owner="worker 0")
    assert "STRATAGEM_BIND_ALL=1" in str(info.value)


def _listening(result_stdout: str) -> list[str]:
    line = next(x for x in result_stdout.splitlines() if x.startswith("LISTENING "))
    return json.loads(line[len("LISTENING ") :])


def test_a_loopback_job_listens_on_loopback_only(tmp_path: Path) -> None:
    results = run_cluster(SCRIPT, 2, tmp_path, env={"MODE": "listen"}, timeout=90)
    for i, r in enumerate(results):
        r.check(f"worker {i}")
        sockets = _listening(r.stdout)
        # worker 0: the store, its liveness server, gloo; worker 1: liveness, gloo
        assert len(sockets) >= 2, sockets
        assert all(s.startswith("127.0.0.1:") for s in sockets), (i, sockets)


def test_a_job_on_a_routable_host_listens_on_that_address_only(tmp_path: Path) -> None:
    host = _routable_ipv4()
    if host is None:
        pytest.skip("this machine has no IPv4 address besides loopback")
    workers = [f"{host}:{p}" for p in free_ports(2)]
    processes = []
    try:
        for i in range(2):
            config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}
            env = child_env({"TF_CONFIG": json.dumps(config), "MODE": "listen"})
            env.pop("STRATAGEM_BIND_ALL", None)
            argv = [sys.executable, str(SCRIPT)]
            processes.append(Process(argv, env, tmp_path, f"worker{i}"))
        results = [p.wait(90) for p in processes]
    finally:
        for p in processes:
            p.kill_group()
    for i, r in enumerate(results):
        r.check(f"worker {i}")
        sockets = _listening(r.stdout)
        assert len(sockets) >= 2, sockets
        assert all(s.startswith(f"{host}:") for s in sockets), (i, sockets)


# ------------------------------------------------------------------ a forged peer in a real job


def test_a_forged_pickle_in_an_object_exchange_runs_nothing(tmp_path: Path) -> None:
    """Worker 1 is an attacker with the job's TF_CONFIG: where worker 0 exchanges the shapes
    of its new parameters, it sends a pickle that would create the marker."""
    marker = tmp_path / "marker"
    _live_pickle(marker)  # the payload is real
    attacker = {"MODE": "attacker", "MARKER": str(marker), "FORGED": "pickle"}
    victim, forger = run_cluster(
        SCRIPT, 2, tmp_path, per_worker_env=[{"MODE": "victim"}, attacker], timeout=90
    )
    forger.check("the attacker")
    assert victim.returncode != 0, victim.stdout
    assert "model built" not in victim.stdout
    # One block (comm/error_report): the error, then its message naming the forging peer.
    assert "\nstratagem: PeerDataError on worker 0" in "\n" + victim.stderr, victim.stderr
    assert "\n  worker 1 (localhost:" in victim.stderr, victim.stderr
    assert "the shapes of the new parameters" in victim.stderr
    assert not marker.exists()
    assert not os.path.exists(tmp_path / "worker0" / "marker")
