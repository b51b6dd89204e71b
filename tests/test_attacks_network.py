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


# ------------------------------------------------------------------ a parameter server's transport

PS_SCRIPT = WORKERS / "ps_target.py"
JOB_SECRET = "job-secret-of-the-test-" + "0123456789abcdef"


def _hello(sock: socket.socket) -> bytes:
    """Read the ps's opening; its challenge."""
    hello = _read_exact(sock, 37)
    assert hello[:4] == b"SGM1" and hello[4] == 1, hello  # a job with a secret challenges
    return hello[5:]


def _read_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _verdict(sock: socket.socket) -> str:
    """``accepted``, or the reason the ps gave for refusing the connection."""
    first = _read_exact(sock, 1)
    if first == b"\x01":
        return "accepted"
    assert first == b"\x00", first
    size = int.from_bytes(_read_exact(sock, 2), "little")
    return _read_exact(sock, size).decode()


def _opened(address: str, secret: str) -> socket.socket:
    """A connection through the opening, proving ``secret`` as worker 0."""
    from stratagem.cluster.job_secret import proof

    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    challenge = _hello(sock)
    name = b"worker:0"
    sock.sendall(len(name).to_bytes(2, "little") + name)
    sock.sendall(proof(secret.encode(), challenge, "worker:0"))
    assert _verdict(sock) == "accepted"
    sock.sendall(b"\x00")  # no shared memory: every frame's tensors come on the socket
    return sock


def _reply(sock: socket.socket) -> object:
    def read_into(buffer: memoryview) -> None:
        data = _read_exact(sock, len(buffer))
        if len(data) < len(buffer):
            raise ConnectionError("closed")
        buffer[:] = data

    assert _read_exact(sock, 1) == b"\x00"  # a frame whose tensors follow on the socket
    return plain_data.read_frame(read_into, sender="ps 0", what="a reply")


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _attack_ps(address: str, live: bytes, marker: Path) -> dict[str, str]:
    """Each attack on its own connection; what the ps answered to each."""
    from stratagem.comm.messages import Connection

    host, port = address.rsplit(":", 1)
    answers: dict[str, str] = {}

    def raw(name: str, data: bytes) -> None:
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            _hello(sock)
            sock.sendall(data)
            answers[name] = _verdict(sock)

    # Without the job's secret: refused before any request is read.
    raw("a pickle instead of the opening", live)
    raw("garbage", b"\xff\xfeGET / HTTP/1.1\r\n\r\n" + bytes(range(256)))
    raw("no proof of the secret", (8).to_bytes(2, "little") + b"worker:0" + bytes(32))
    for name, secret in (("a wrong secret", b"a-wrong-secret-0123456789"), ("no secret", None)):
        try:
            Connection(address, me="worker:0", peer="ps 0", secret=secret, timeout=30)
        except RendezvousError as e:
            answers[name] = str(e)
        else:
            answers[name] = "accepted"
    # With the secret (a peer that is part of the job, or one that stole the secret): the schema
    # and the method table still hold.
    with _opened(address, JOB_SECRET) as sock:
        sock.sendall(b"\x00" + live)
        answers["a pickled request"] = json.dumps(_reply(sock))
        assert _closed(sock)
    with _opened(address, JOB_SECRET) as sock:
        sock.sendall(live)  # no frame kind: the pickle's first byte is none
        answers["a pickle instead of a frame"] = json.dumps(_reply(sock))
        assert _closed(sock)
    with _opened(address, JOB_SECRET) as sock:
        # A shared-memory segment that was never offered, named outside /dev/shm/sg-*.
        name = b"../../tmp/x"
        sock.sendall(b"\x02" + bytes([len(name)]) + name + bytes(24))
        answers["a shared-memory segment unasked"] = json.dumps(_reply(sock))
        assert _closed(sock)
    with _opened(address, JOB_SECRET) as sock:
        request = {"id": 1, "method": "system", "args": [f"touch {marker}"]}
        head, _ = plain_data.encode_parts(request, what="an attack")
        sock.sendall(b"\x00" + head)
        answers["a method not in the table"] = json.dumps(_reply(sock))
        assert _closed(sock)
    with _opened(address, JOB_SECRET) as sock:
        request = {"id": 1, "method": "read", "args": [[[0, 0]]]}
        forged = _frame(request, [["object", [len(live)]]], live)
        sock.sendall(b"\x00" + forged)
        answers["a pickled tensor"] = json.dumps(_reply(sock))
        assert _closed(sock)
    return answers


@pytest.mark.multiprocess
def test_a_parameter_server_refuses_what_is_not_its_jobs_plain_requests(tmp_path: Path) -> None:
    """Pickles, garbage, connections without the secret's proof and requests outside the ps's
    method table, sent to the ps of a running job: each refused and named, the payload never
    runs, and the ps goes on serving the job, which finishes with exit 0."""
    marker = tmp_path / "marker"
    live = _live_pickle(marker)
    worker, ps = (f"localhost:{p}" for p in free_ports(2))
    cluster = {"worker": [worker], "ps": [ps]}
    processes = []
    try:
        for task, index in (("ps", 0), ("worker", 0)):
            config = {"cluster": cluster, "task": {"type": task, "index": index}}
            env = child_env({"TF_CONFIG": json.dumps(config), "STRATAGEM_JOB_SECRET": JOB_SECRET})
            argv = [sys.executable, str(PS_SCRIPT), str(tmp_path)]
            processes.append(Process(argv, env, tmp_path, f"{task}{index}"))
        ready = tmp_path / "ready"
        for _ in range(2400):  # the worker has built its model on the ps (at most 120 s)
            if ready.exists() or any(p.proc.poll() is not None for p in processes):
                break
            threading.Event().wait(0.05)
        assert ready.exists(), [p.proc.poll() for p in processes]
        answers = _attack_ps(ps, live, marker)
        (tmp_path / "go").touch()
        ps_result, worker_result = (p.wait(120) for p in processes)
    finally:
        for p in processes:
            p.kill_group()
    refused = "ps 0 (" + ps + ") refused the connection"
    for name in ("a pickle instead of the opening", "garbage", "no proof of the secret"):
        assert answers[name].startswith(refused), (name, answers[name])
    assert "its proof of the job secret is wrong" in answers["no proof of the secret"]
    assert "its proof of the job secret is wrong" in answers["a wrong secret"]
    assert "runs without one" in answers["no secret"]
    sent_with_the_secret = (
        "a pickled request",
        "a pickle instead of a frame",
        "a shared-memory segment unasked",
        "a method not in the table",
        "a pickled tensor",
    )
    for name in sent_with_the_secret:
        assert '"error": ["PeerDataError"' in answers[name], (name, answers[name])
    assert "a frame of kind b" in answers["a pickle instead of a frame"]
    assert "announced a shared-memory segment unasked" in answers["a shared-memory segment unasked"]
    assert "not one this server has" in answers["a method not in the table"]
    assert "not the frame marker" in answers["a pickled request"]
    assert "'object'" in answers["a pickled tensor"]
    assert not marker.exists()
    worker_result.check("worker 0")
    ps_result.check("ps 0")
    assert "trained; ps stats [{'applied': 5, 'dropped': 0, 'steps': 5" in worker_result.stdout
    # The ps named every attack it refused; "no secret" was refused by the client itself, and
    # the ps saw only its connection close during the opening.
    lines = [x for x in ps_result.stderr.splitlines() if f"[ps 0 ({ps})] refused" in x]
    assert len(lines) == 10, ps_result.stderr
    assert sum("PeerDataError" in x for x in lines) == 9, ps_result.stderr
    assert sum("its opening failed" in x for x in lines) == 1, ps_result.stderr
