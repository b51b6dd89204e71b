"""Where a coordinator's worker runs scheduled functions (``comm.messages.Here``): on the thread
of the chief's connection, one call after another, each starting as a fresh thread would
(gradients on), while the server's note thread tells the chief that it runs. Synchronised by
events, never by time."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch

from cluster_utils import free_ports
from stratagem.comm.messages import Connection, Here, MessageServer
from stratagem.distribute.coordinator.worker import WorkerServer

TIMEOUT_S = 30
CHIEF = "chief:0"


@contextmanager
def _served(methods: dict[str, Callable[..., Any]], note_every: float) -> Iterator[Connection]:
    port = free_ports(1)[0]
    server = MessageServer(
        "localhost",
        port,
        name="worker 0",
        secret=None,
        clients=[CHIEF],
        methods=methods,
        handshake_timeout=5,
        note_every=note_every,
    )
    try:
        connection = Connection(
            f"localhost:{port}", me=CHIEF, peer="worker 0", secret=None, timeout=TIMEOUT_S
        )
        try:
            yield connection
        finally:
            connection.close()
    finally:
        server.close()


def _call(connection: Connection, method: str, silent: Callable[[list[str]], list[str]] = list):
    return connection.call(method, [], what=method, silent=silent, peer_ended=lambda: False)


def test_calls_run_one_after_another_on_the_connections_own_thread() -> None:
    seen: list[threading.Thread] = []

    def here() -> Here:
        return Here(lambda: seen.append(threading.current_thread()), lambda: ("runs", []))

    with _served({"run": here}, note_every=5) as connection:
        for _ in range(3):
            _call(connection, "run")
    assert seen[0] is not threading.current_thread()
    assert seen == [seen[0]] * 3


def test_a_call_that_runs_long_is_said_to_run_and_answers_after_the_notes() -> None:
    notes: list[list[str]] = []
    heard = threading.Event()

    def silent(tasks: list[str]) -> list[str]:  # the client's look at each note
        notes.append(tasks)
        if len(notes) >= 3:
            heard.set()
        return []

    def here() -> Here:
        # Ends only once the client has heard three notes of it: a call the notes did not
        # cover would time out here instead.
        return Here(lambda: heard.wait(TIMEOUT_S), lambda: ("the function runs", ["worker:0"]))

    with _served({"run": here}, note_every=0.01) as connection:
        assert _call(connection, "run", silent) is True
    assert notes[:3] == [["worker:0"]] * 3


def test_each_scheduled_function_starts_with_gradients_on() -> None:
    worker = WorkerServer.__new__(WorkerServer)  # only what _here reads of a serving worker
    worker.me = "worker 0"
    worker.world = SimpleNamespace(name="worker:0")
    modes: list[bool] = []

    def switch_off() -> dict[str, Any]:
        torch.set_grad_enabled(False)  # left off, not restored
        return {"value": None}

    def look() -> dict[str, Any]:
        modes.append(torch.is_grad_enabled())
        return {"value": None}

    methods = {
        "off": lambda: worker._here(switch_off, "off"),
        "look": lambda: worker._here(look, "look"),
    }
    with _served(methods, note_every=5) as connection:
        _call(connection, "off")
        _call(connection, "look")
    assert modes == [True]
