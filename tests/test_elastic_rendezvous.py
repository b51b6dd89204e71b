"""torch's dynamic rendezvous over the job's sealed store (``stratagem.elastic``), in process.

Each node is a ``SealedRendezvous`` driven from a thread, as torch's agent drives its handler;
the references are torch's own rules (ranks, rounds, last call: ``dynamic_rendezvous.py``), a
sealed client of our own opened where workers would open theirs, and a raw ``TCPStore`` client
playing a process without the job's secret.
"""

from __future__ import annotations

import base64
import concurrent.futures
import datetime
import importlib.metadata
import os
import pickle
import socket
import time
import types
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as torch_dynamic
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from cluster_utils import free_ports
from stratagem.comm.sealed_store import SealedStore
from stratagem.elastic import torchrun_backend
from stratagem.elastic.sealed_rendezvous import (
    SHARE_STORE_VARIABLE,
    SealedRendezvous,
    explain,
    run_id_for,
    sealed_handler,
)
from stratagem.errors import ClusterConfigError, RendezvousError

SECRET = b"the job's secret, 32 characters!"
OTHER = b"another job's secret, 32 chars.."
HOST = "127.0.0.1"
JOIN_S = 20.0  # a bound for a broken test only: every verdict comes from an event


@pytest.fixture
def nodes() -> Iterator[list[SealedRendezvous]]:
    """The handlers a test makes; shut down afterwards (host last), heartbeats stopped."""
    made: list[SealedRendezvous] = []
    yield made
    for handler in reversed(made):
        handler.shutdown()


@pytest.fixture(autouse=True)
def _share_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    # The handler sets it; each test starts without it and leaves the process as it found it.
    monkeypatch.delenv(SHARE_STORE_VARIABLE, raising=False)


def node(made: list[SealedRendezvous], port: int, index: int, **kwargs: object) -> SealedRendezvous:
    settings: dict[str, object] = dict(
        host=HOST,
        port=port,
        is_host=index == 0,
        secret=SECRET,
        run_id=None,
        min_nodes=2,
        max_nodes=2,
        join_timeout_s=JOIN_S,
        close_timeout_s=5,
        where=f"node {index}",
    )
    settings.update(kwargs)
    handler = sealed_handler(**settings)  # type: ignore[arg-type]
    made.append(handler)
    return handler


def join_all(handlers: list[SealedRendezvous]) -> list:
    """``next_rendezvous`` on every handler at once, each in its own thread."""
    with concurrent.futures.ThreadPoolExecutor(len(handlers)) as pool:
        futures = [pool.submit(h.next_rendezvous) for h in handlers]
        return [f.result(timeout=2 * JOIN_S) for f in futures]


def sealed_client(host: str, port: int, secret: bytes = SECRET) -> dist.Store:
    """What a worker opens at the address the rendezvous gives it (``comm.process_group``)."""
    raw = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=10))
    return SealedStore(raw, secret, where="the test's worker")


def test_two_nodes_complete_a_round_then_the_next_on_the_store_they_share(nodes, monkeypatch):
    """torch's rules: ranks are 0 and 1 in a world of 2 (max_nodes reached: complete at once),
    and when both re-enter, the round advances (torch counts rounds from 0). Each round's store
    is the sealed store's prefix ``torch.rendezvous.<run_id>.<round>`` at the address the info
    gives workers, where a worker's own sealed client finds what an agent wrote; torch's rank 0
    opens no second, unsealed store server."""
    second_servers: list[object] = []
    monkeypatch.setattr(
        torch_dynamic.DynamicRendezvousHandler,
        "_create_tcp_store_server",
        lambda self, addr, port: second_servers.append((addr, port)),
    )
    (port,) = free_ports(1)
    handlers = [node(nodes, port, 0), node(nodes, port, 1)]
    worker = sealed_client(HOST, port)
    for expected_round in (0, 1):
        infos = join_all(handlers)
        assert sorted(i.rank for i in infos) == [0, 1]
        assert [i.world_size for i in infos] == [2, 2]
        assert [h.round for h in handlers] == [expected_round, expected_round]
        for info in infos:
            bootstrap = info.bootstrap_store_info
            assert (bootstrap.master_addr, bootstrap.master_port) == (HOST, port)
        infos[0].store.set(f"hello/{expected_round}", b"from an agent")
        key = f"torch.rendezvous.{run_id_for(SECRET)}.{expected_round}/hello/{expected_round}"
        assert worker.get(key) == b"from an agent"
    assert all(h.use_agent_store for h in handlers)
    assert os.environ[SHARE_STORE_VARIABLE] == "1"
    assert second_servers == []


def test_one_node_of_one_to_two_completes_after_the_last_call(nodes):
    """min_nodes=1, max_nodes=2, one node: the round completes at the last call's deadline
    (torch: ``deadline = now + last_call`` when min_nodes have joined), not before."""
    (port,) = free_ports(1)
    handler = node(nodes, port, 0, min_nodes=1, max_nodes=2, last_call_s=0.3)
    start = time.monotonic()
    (info,) = join_all([handler])
    assert time.monotonic() - start >= 0.3
    assert (info.rank, info.world_size, handler.round) == (0, 1, 0)


def _sealed_name(key: str) -> str:
    """The name ``key`` has in the store under SECRET, found as a spy on the base store sees it."""

    class Spy(dist.Store):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def check(self, keys: list[str]) -> bool:
            self.names.extend(keys)
            return False

        def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
            return desired

    spy = Spy()
    SealedStore(spy, SECRET, where="spy").compare_set(key, b"", b"x")
    return spy.names[0]


def test_a_state_written_without_the_secret_is_named_before_torch_unpickles_it(nodes, monkeypatch):
    """A raw client (no secret) replaces the rendezvous state with a well-formed torch state
    (base64 of a pickle): the next join fails with our named error inside torch's
    ``RendezvousConnectionError``, and torch's ``pickle.loads`` never sees a byte of it."""
    (port,) = free_ports(1)
    handler = node(nodes, port, 0, min_nodes=1, max_nodes=1)
    join_all([handler])
    unpickled: list[bytes] = []

    def loads(data: bytes) -> object:
        unpickled.append(data)
        raise AssertionError("torch unpickled a record of the rendezvous")

    monkeypatch.setattr(
        torch_dynamic,
        "pickle",
        types.SimpleNamespace(loads=loads, dumps=pickle.dumps, PickleError=pickle.PickleError),
    )
    outsider = dist.TCPStore(HOST, port, None, False, datetime.timedelta(seconds=5))
    forged = base64.b64encode(pickle.dumps(torch_dynamic._RendezvousState()))
    outsider.set(_sealed_name(f"torch.rendezvous.{run_id_for(SECRET)}"), forged)
    with pytest.raises(RendezvousConnectionError) as caught:
        handler.next_rendezvous()
    assert isinstance(caught.value.__cause__, RendezvousError)
    line = explain(caught.value)
    assert line.startswith(f"node 0 could not join the next round at {HOST}:{port}: ")
    assert f"under 'torch.rendezvous.{run_id_for(SECRET)}'" in line
    assert "a process without the job's secret wrote into it" in line
    assert unpickled == []


def test_a_node_given_another_secret_is_refused_by_name(nodes):
    """Under another secret every key has another name: without the check such a node would
    wait alone until its join timeout. It is refused at once, naming the mismatch; so is a node
    without a secret, and a node with one at an insecure rendezvous."""
    (port,) = free_ports(1)
    node(nodes, port, 0)
    with pytest.raises(RendezvousError, match="was made with another job secret"):
        node(nodes, port, 1, secret=OTHER, join_timeout_s=1)
    with pytest.raises(RendezvousError, match="this node runs without one"):
        node(nodes, port, 1, secret=None, join_timeout_s=1)
    (insecure_port,) = free_ports(1)
    node(nodes, insecure_port, 0, secret=None)
    with pytest.raises(RendezvousError, match=r"runs without a job secret \(STRATAGEM_INSECURE"):
        node(nodes, insecure_port, 1, join_timeout_s=1)


def test_a_taken_port_is_named():
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(RendezvousError, match=f"port {port} is already in use"):
            sealed_handler(
                host=HOST, port=port, is_host=True, secret=SECRET, run_id=None,
                min_nodes=1, max_nodes=1, where="node 0",
            )  # fmt: skip


def test_torchs_registry_creates_the_stratagem_backend(nodes, monkeypatch):
    """``get_rendezvous_handler`` with ``backend="stratagem"`` (torch's own lookup, which also
    checks the handler's ``get_backend()``), options as torchrun passes them (strings), the
    secret from ``STRATAGEM_JOB_SECRET``; the ``torchrun.handlers`` entry point yields the
    creator ``register()`` registers, so registering twice is no conflict."""
    monkeypatch.setenv("STRATAGEM_JOB_SECRET", SECRET.decode())
    torchrun_backend.register()
    torchrun_backend.register()
    (entry,) = importlib.metadata.entry_points(group="torchrun.handlers", name="stratagem")
    assert entry.load()() is torchrun_backend.create
    (port,) = free_ports(1)
    params = RendezvousParameters(
        backend="stratagem",
        endpoint=f"{HOST}:{port}",
        run_id="none",  # torchrun's when --rdzv-id is not given
        min_nodes=1,
        max_nodes=1,
        is_host="1",
        join_timeout="20",
        last_call_timeout="1",
        keep_alive_interval="5",
    )
    handler = get_rendezvous_handler(params)
    nodes.append(handler)
    assert isinstance(handler, SealedRendezvous)
    assert (handler.get_backend(), handler.get_run_id()) == ("stratagem", run_id_for(SECRET))
    (info,) = join_all([handler])
    assert (info.rank, info.world_size) == (0, 1)


def test_a_bad_option_is_named(monkeypatch):
    monkeypatch.setenv("STRATAGEM_JOB_SECRET", SECRET.decode())
    params = RendezvousParameters(
        "stratagem", f"{HOST}:1", "none", 1, 1, is_host="1", join_timeout="soon"
    )
    with pytest.raises(ClusterConfigError, match="join_timeout='soon': expected a positive"):
        torchrun_backend.create(params)


def test_join_timeout_is_torchs_error_with_the_node_named(nodes):
    """A round that never fills ends in torch's ``RendezvousTimeoutError`` (the agent's rule);
    ``explain`` names this node and the operation."""
    (port,) = free_ports(1)
    handler = node(nodes, port, 0, join_timeout_s=0.5)
    with pytest.raises(RendezvousTimeoutError) as caught:
        handler.next_rendezvous()
    assert explain(caught.value) == (
        f"node 0 could not join the next round at {HOST}:{port}: RendezvousTimeoutError"
    )


def test_the_private_torch_fields_read_are_still_there(nodes):
    """``elastic.torch_state`` reads ``DynamicRendezvousHandler._state_holder.state.round``
    (torch 2.13): a torch that renames it fails here by name."""
    (port,) = free_ports(1)
    handler = node(nodes, port, 0, min_nodes=1, max_nodes=1)
    holder = handler._torch._state_holder
    assert isinstance(holder.state, torch_dynamic._RendezvousState)
    assert set(vars(torch_dynamic._RendezvousState())) == {
        "round",
        "complete",
        "deadline",
        "closed",
        "participants",
        "wait_list",
        "redundancy_list",
        "last_heartbeats",
    }
    join_all([handler])
    assert holder.state.round == handler.round == 0 and holder.state.complete


def test_without_is_host_the_first_node_here_hosts_and_the_next_joins_it(nodes, monkeypatch):
    """torch's c10d rule when ``is_host`` is not given: the node whose machine the endpoint
    names hosts the store if its port is free, else joins whoever hosts it (two agents on one
    machine); both then complete one round."""
    monkeypatch.setenv("STRATAGEM_JOB_SECRET", SECRET.decode())
    torchrun_backend.register()
    (port,) = free_ports(1)
    for _ in range(2):
        nodes.append(
            get_rendezvous_handler(
                RendezvousParameters("stratagem", f"{HOST}:{port}", "job-7", 2, 2)
            )
        )
    infos = join_all(nodes)
    assert sorted(i.rank for i in infos) == [0, 1]
    assert all(h.get_run_id() == "job-7" for h in nodes)
