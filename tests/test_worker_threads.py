"""The threads a coordinator's worker runs scheduled functions on (``_KeptThreads``): kept
from one call to the next, never making one call wait for another, each call starting as a
fresh thread would (gradients on). Synchronised by events, never by time."""

from __future__ import annotations

import threading

import torch

from stratagem.distribute.coordinator.worker import _KeptThreads

TIMEOUT_S = 30


def _run_and_wait(threads: _KeptThreads, call) -> None:  # type: ignore[no-untyped-def]
    """Run ``call`` and wait for its ``then``, as the chief waits for a function's reply."""
    done = threading.Event()
    threads.run(call, lambda _: done.set())
    assert done.wait(TIMEOUT_S), "the call never ran"


def test_calls_one_after_another_run_on_one_kept_thread() -> None:
    threads = _KeptThreads("test calls")
    seen: list[threading.Thread] = []
    for _ in range(3):
        _run_and_wait(threads, lambda: seen.append(threading.current_thread()))
    assert seen[0] is not threading.current_thread()
    assert seen == [seen[0]] * 3


def test_a_call_never_waits_for_one_still_running() -> None:
    threads = _KeptThreads("test calls")
    release, second_ran = threading.Event(), threading.Event()
    first_done = threading.Event()

    def first() -> None:
        # Blocks until the second call has run: on one shared thread this would never end.
        release.wait(TIMEOUT_S)
        first_done.set()

    threads.run(first, lambda _: None)
    _run_and_wait(threads, second_ran.set)
    release.set()
    assert first_done.wait(TIMEOUT_S)
    assert second_ran.is_set()


def test_each_call_starts_with_gradients_on() -> None:
    threads = _KeptThreads("test calls")
    modes: list[bool] = []
    _run_and_wait(threads, lambda: torch.set_grad_enabled(False))  # left off, not restored
    _run_and_wait(threads, lambda: modes.append(torch.is_grad_enabled()))
    assert modes == [True]


def test_a_failing_call_leaves_its_thread_serving(capsys) -> None:
    """Neither part of a call should raise; an answer that does is printed, and its thread
    takes the next call (a thread that ended while counted idle would leave that call
    waiting)."""
    threads = _KeptThreads("test calls")
    answered = threading.Event()

    def then_fails(_: object) -> None:
        answered.set()  # the thread already counts as idle here
        raise RuntimeError("a bug in an answer")

    threads.run(lambda: None, then_fails)
    assert answered.wait(TIMEOUT_S)
    _run_and_wait(threads, lambda: None)  # on that idle thread: it must still serve
    assert "a bug in an answer" in capsys.readouterr().err
