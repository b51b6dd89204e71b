"""Issue 14, "job identity": a process without the job's secret cannot join, claim a task, read
the job's records or forge one.

The rendezvous store is sealed with the job's secret (``comm/sealed_store.py``): key names are
HMACs, values are encrypted and authenticated. The attacks run against our own jobs on loopback;
the intruder's "payload" is a marker file it would create had it joined.
"""

from __future__ import annotations

import datetime
import json
import stat
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from cluster_utils import WORKERS, Process, child_env, free_ports, tf_config
from stratagem.cluster import job_secret as js
from stratagem.cluster.tasks import make_tasks
from stratagem.comm.rendezvous import wait_for_port
from stratagem.comm.sealed_store import SealedStore
from stratagem.errors import ClusterConfigError, RendezvousError

SCRIPT = WORKERS / "secret_join.py"
SECRET = "a" * 64
OTHER = "b" * 64


def _hash_store() -> dist.Store:
    return dist.HashStore()


# ------------------------------------------------------------------ the sealed store itself


def test_sealed_store_round_trips_what_torch_and_the_roll_call_use() -> None:
    base = _hash_store()
    store = SealedStore(base, SECRET.encode(), where="worker 0 (localhost:1)")
    store.set("member/0", '{"name": "worker 0 (localhost:2222)"}')
    assert store.get("member/0") == b'{"name": "worker 0 (localhost:2222)"}'
    assert store.add("claim/1", 1) == 1
    assert store.add("claim/1", 2) == 3
    assert store.compare_set("cs", "", "first") == b"first"
    assert store.compare_set("cs", "wrong", "second") == b"first"
    assert store.compare_set("cs", "first", "second") == b"second"
    assert store.compare_set("missing", "x", "y") == b"x"  # torch's rule for a missing key
    store.append("log", "a")
    store.append("log", "b")
    assert store.get("log") == b"ab"
    store.multi_set(["m1", "m2"], ["1", "2"])
    assert store.multi_get(["m1", "m2"]) == [b"1", b"2"]
    assert store.check(["member/0", "claim/1"]) and not store.check(["member/1"])
    store.wait(["member/0"], datetime.timedelta(seconds=1))
    assert store.delete_key("log") and not store.check(["log"])
    # Through a PrefixStore, as gloo and the roll call use it.
    prefixed = dist.PrefixStore("pg/", store)
    prefixed.set("k", "v")
    assert prefixed.get("k") == b"v"


def test_an_outsider_reads_no_name_and_no_value() -> None:
    base = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5))
    store = SealedStore(base, SECRET.encode(), where="worker 0")
    record = json.dumps({"name": "worker 1 (localhost:40001)", "pid": 4242, "host": "box"})
    store.set("stratagem/0/member/1", record)
    store.add("stratagem/0/claim/1", 1)
    keys = base.list_keys()
    assert len(keys) == 2 and all(k.startswith("sg/") for k in keys), keys
    assert not any("member" in k or "claim" in k for k in keys)
    for k in keys:
        raw = bytes(base.get(k))
        for plain in (b"worker", b"localhost", b"40001", b"4242", b"box"):
            assert plain not in raw, (k, plain)
    # Another secret (a process of another job or user) finds none of it.
    other = SealedStore(base, OTHER.encode(), where="worker 0")
    assert not other.check(["stratagem/0/member/1"])


def test_a_forged_or_moved_record_is_a_named_rendezvous_error() -> None:
    base = _hash_store()
    store = SealedStore(base, SECRET.encode(), where="worker 0 (localhost:2222)")
    store.set("member/0", "real")
    store.set("member/1", "real too")
    names = {k: store._key(k) for k in ("member/0", "member/1", "claim/1")}  # the sealed names
    # 1. a value written by a process without the secret (in the sealed name, found by listing)
    base.set(names["member/0"], b'{"rank": 0}')
    with pytest.raises(RendezvousError, match=r"worker 0 \(localhost:2222\).*'member/0'.*secret"):
        store.get("member/0")
    # 2. a genuine sealed value moved to another key
    base.set(names["member/0"], base.get(names["member/1"]))
    with pytest.raises(RendezvousError, match="fails the job secret's check"):
        store.get("member/0")
    # 3. a forged counter: the claim of a task
    base.set(names["claim/1"], b"SGS1" + bytes(60))
    with pytest.raises(RendezvousError, match="'claim/1'"):
        store.add("claim/1", 1)


# ------------------------------------------------------------------ where the secret comes from


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in (js.SECRET_VARIABLE, js.SECRET_FILE_VARIABLE, js.INSECURE_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


def test_a_local_job_uses_this_users_own_secret_file(clean_env: Path) -> None:
    first = js.job_secret(["localhost", "127.0.0.1"], me="worker 0")
    path = clean_env / "cache" / "stratagem" / "job-secret"
    assert path.exists() and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert first is not None and len(first) == 64
    assert js.job_secret(["localhost"], me="worker 1") == first  # shared by the user's tasks


def test_a_multi_machine_job_without_a_secret_is_refused(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ClusterConfigError, match=r"worker 1 .*10\.1\.2\.3.*STRATAGEM_JOB_SECRET"):
        js.job_secret(["10.1.2.3", "localhost"], me="worker 1")
    monkeypatch.setenv(js.INSECURE_VARIABLE, "1")
    assert js.job_secret(["10.1.2.3"], me="worker 1") is None
    monkeypatch.setenv(js.SECRET_VARIABLE, SECRET)
    assert js.job_secret(["10.1.2.3"], me="worker 1") == SECRET.encode()


def test_a_secret_must_be_long_and_its_file_private(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(js.SECRET_VARIABLE, "short")
    with pytest.raises(ClusterConfigError, match="5 characters; expected at least 16"):
        js.job_secret(["localhost"], me="worker 0")
    monkeypatch.delenv(js.SECRET_VARIABLE)
    path = clean_env / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o644)
    monkeypatch.setenv(js.SECRET_FILE_VARIABLE, str(path))
    with pytest.raises(ClusterConfigError, match=r"readable by others .*mode 644"):
        js.job_secret(["10.1.2.3"], me="worker 0")
    path.chmod(0o600)
    assert js.job_secret(["10.1.2.3"], me="worker 0") == SECRET.encode()


def test_a_task_of_a_multi_machine_job_without_a_secret_stops_before_listening(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stratagem as sg

    port = free_ports(1)[0]
    config = {
        "cluster": {"worker": [f"localhost:{port}", "10.1.2.3:2222"]},
        "task": {"type": "worker", "index": 0},
    }
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    with pytest.raises(ClusterConfigError, match="several machines"):
        sg.distribute.MultiWorkerMirroredStrategy()


def test_a_host_name_that_does_not_resolve_is_named_not_taken_for_another_machine(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import stratagem as sg

    port = free_ports(1)[0]
    # .invalid never resolves (RFC 2606): a typo in the task's own address, not a second machine.
    config = {
        "cluster": {"worker": [f"no-such-host.invalid:{port}", f"localhost:{port + 1}"]},
        "task": {"type": "worker", "index": 0},
    }
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    with pytest.raises(ClusterConfigError) as raised:
        sg.distribute.MultiWorkerMirroredStrategy()
    message = str(raised.value)
    assert "host names do not resolve on this machine: 'no-such-host.invalid' (" in message
    assert "secret" not in message.lower(), message


def test_the_launcher_gives_each_job_a_fresh_secret_and_keeps_the_users() -> None:
    tasks = make_tasks({"worker": 2}, base_env={})
    secrets = {t.env[js.SECRET_VARIABLE] for t in tasks}
    assert len(secrets) == 1 and len(next(iter(secrets))) == 64
    again = make_tasks({"worker": 2}, base_env={})
    assert again[0].env[js.SECRET_VARIABLE] not in secrets
    mine = make_tasks({"worker": 2}, base_env={js.SECRET_VARIABLE: SECRET})
    assert {t.env[js.SECRET_VARIABLE] for t in mine} == {SECRET}
    by_file = make_tasks({"worker": 1}, base_env={js.SECRET_FILE_VARIABLE: "/some/file"})
    assert js.SECRET_VARIABLE not in by_file[0].env


# ------------------------------------------------------------------ attacks on a real job


def _task(workers: list[str], i: int, tmp: Path, name: str, **env: str) -> Process:
    extra = {"TF_CONFIG": tf_config(workers, i), **env}
    return Process([sys.executable, str(SCRIPT)], child_env(extra), tmp, name)


def test_an_intruder_without_the_secret_cannot_join_or_block_the_task_it_claims(
    tmp_path: Path,
) -> None:
    """The intruder is given the job's TF_CONFIG as worker 1 but another secret. It signs in
    before the real worker 1 starts; it never sees worker 0, and the real worker 1 joins."""
    marker = tmp_path / "marker"
    workers = [f"localhost:{p}" for p in free_ports(2)]
    job = {js.SECRET_VARIABLE: SECRET}
    victim = _task(workers, 0, tmp_path, "worker0", **job)
    processes = [victim]
    try:
        intruder = _task(
            workers,
            1,
            tmp_path,
            "intruder",
            MARKER=str(marker),
            STRATAGEM_RENDEZVOUS_TIMEOUT="3",
            **{js.SECRET_VARIABLE: OTHER},
        )
        processes.append(intruder)
        refused = intruder.wait(90)
        real = _task(workers, 1, tmp_path, "worker1", **job)
        processes.append(real)
        results = [victim.wait(120), real.wait(120)]
    finally:
        for p in processes:
            p.kill_group()
    assert refused.returncode != 0
    assert "RendezvousError" in refused.stderr and "missing: worker 0" in refused.stderr, (
        refused.stderr
    )
    assert not marker.exists()
    for i, r in enumerate(results):
        r.check(f"worker {i}")
        assert "joined: sum of task ids 1" in r.stdout


def test_store_keys_written_first_by_an_outsider_are_ignored(tmp_path: Path) -> None:
    """An outsider connects to the job's store before worker 1 starts, reads every record
    worker 0 wrote (finding no address, name or pid), and writes the claim and the sign-in of
    worker 1 under the names the unsealed store used: the job still runs."""
    ports = free_ports(2)
    workers = [f"localhost:{p}" for p in ports]
    job = {js.SECRET_VARIABLE: SECRET}
    victim = _task(workers, 0, tmp_path, "worker0", **job)
    processes = [victim]
    try:
        wait_for_port("localhost", ports[0], time.monotonic() + 60, owner="worker 0", me="the test")
        outsider = dist.TCPStore("localhost", ports[0], None, False, datetime.timedelta(seconds=30))
        _wait_keys(outsider, 2)  # worker 0's claim and sign-in
        for key in outsider.list_keys():
            raw = bytes(outsider.get(key))
            assert not any(
                p in raw for p in (b"worker", b"localhost", str(ports[0]).encode(), b"pid")
            )
        forged = {
            "rank": 1,
            "world_size": 2,
            "name": "worker 1",
            "cluster": "x",
            "pid": 1,
            "host": "x",
            "liveness": "127.0.0.1:1",
        }
        for attempt in ("0", "1"):
            outsider.add(f"stratagem/{attempt}/claim/1", 1)
            outsider.set(f"stratagem/{attempt}/member/1", json.dumps(forged))
        real = _task(workers, 1, tmp_path, "worker1", **job)
        processes.append(real)
        results = [victim.wait(120), real.wait(120)]
    finally:
        for p in processes:
            p.kill_group()
    for i, r in enumerate(results):
        r.check(f"worker {i}")
        assert "joined: sum of task ids 1" in r.stdout


def _wait_keys(store: dist.TCPStore, count: int) -> None:
    """Poll until the store holds ``count`` keys (worker 0 has signed in), at most 60 s."""
    deadline = time.monotonic() + 60
    while store.num_keys() < count:
        assert time.monotonic() < deadline, f"worker 0 wrote {store.num_keys()} keys in 60 s"
        time.sleep(0.05)


@pytest.mark.parametrize("same", [True, False], ids=["same-secret", "impostor"])
def test_each_connection_proves_the_job_secret(tmp_path: Path, same: bool) -> None:
    """gloo's connections carry no credentials; after start-up each pair of tasks answers a
    challenge with the secret over its own connection. An impostor (another secret) on the
    other end is named by each side."""
    script = WORKERS / "peer_check.py"
    rendezvous = tmp_path / "filestore"
    secrets = [SECRET, SECRET if same else OTHER]
    processes = [
        Process(
            [sys.executable, str(script), str(i), str(rendezvous)],
            child_env({"SECRET": secrets[i]}),
            tmp_path,
            f"task{i}",
        )
        for i in range(2)
    ]
    try:
        results = [p.wait(60) for p in processes]
    finally:
        for p in processes:
            p.kill_group()
    for i, r in enumerate(results):
        r.check(f"task {i}")
        if same:
            assert r.stdout.strip() == "CHECKED", r.stdout
        else:
            assert f"REFUSED the connection from task {i} to task {1 - i} failed" in r.stdout
