"""``Dataset.prefetch``, ``map(num_parallel_calls=)`` and ``prefetch_to_device``.

No verdict depends on timing: that work happens in the background, or concurrently, is shown
with events that only another thread can set (waited for with a generous timeout that only a
deadlock reaches), never by measuring speed (``benchmarks/prefetch.py`` does that).
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
import time
import traceback

import pytest
import torch

import stratagem as sg

# Long enough that only a deadlock (the work not being concurrent at all) reaches it.
DEADLOCK_S = 60


_PIPELINE = ("stratagem-prefetch", "stratagem-map")  # the names of the input pipeline's threads


def _our_threads() -> list[str]:
    """The input pipeline's threads (a process-wide service's, such as a liveness server left
    by an earlier test, are not this file's to count)."""
    names = (t.name for t in threading.enumerate())
    return sorted(n for n in names if n.startswith(_PIPELINE))


def _settled_threads(allowed: list[str]) -> list[str]:
    """The pipeline threads left once every pass that ended has let its threads go.

    A pass dropped by an exception or a ``break`` is stopped when its iterator is collected,
    and an element's error makes a cycle (its traceback holds the consumer's frames, which hold
    the iterator) that only the garbage collector frees. The producer thread itself may still
    hold the error for a moment (a local of the put it has not yet returned from, when the
    machine is busy), so a collection made then frees nothing. So: collect and wait for the
    extra threads, again, until they are gone or ``DEADLOCK_S`` has passed (which only a thread
    that never stops reaches). Where the garbage collector happens to run in one of the pass's
    own background threads, that thread cannot join itself: it ends on its own right after,
    unjoined, and the wait covers it too."""
    deadline = time.monotonic() + DEADLOCK_S
    while _our_threads() != allowed and time.monotonic() < deadline:
        gc.collect()  # only while threads are left: a collection takes a while with torch
        for thread in threading.enumerate():
            if thread.name.startswith(_PIPELINE) and thread.name not in allowed:
                thread.join(0.5)
    return _our_threads()


@pytest.fixture(autouse=True)
def _no_stray_threads():
    before = _our_threads()
    yield
    assert _settled_threads(before) == before, "a prefetch or parallel-map thread outlived its pass"


def _values(ds):
    return [x.tolist() if isinstance(x, torch.Tensor) else x for x in ds]


@pytest.mark.parametrize("buffer_size", [0, 1, 3, sg.data.AUTOTUNE])
def test_prefetch_keeps_the_elements_and_their_order(buffer_size):
    x = torch.arange(40.0).reshape(20, 2)

    def make():  # two pipelines: a shuffle counts its own passes
        return sg.data.Dataset.from_tensor_slices((x, torch.arange(20))).shuffle(20, seed=3)

    base, pre = make().batch(6), make().batch(6).prefetch(buffer_size)
    for a, b in zip(base.repeat(2), pre.repeat(2), strict=True):
        torch.testing.assert_close(a, b)
    assert pre.cardinality() == base.cardinality() == 4
    assert pre.element_spec == base.element_spec
    assert "prefetch(AUTOTUNE)" in repr(sg.data.Dataset.range(3).prefetch(sg.data.AUTOTUNE))


def test_prefetch_makes_elements_ahead_in_a_background_thread():
    made: list[int] = []
    where: set[str] = set()
    third_made = threading.Event()

    def slow(i):
        made.append(int(i))
        where.add(threading.current_thread().name)
        if int(i) == 2:
            third_made.set()
        return i

    it = iter(sg.data.Dataset.range(10).map(slow).prefetch(2))
    assert int(next(it)) == 0
    # The step has taken one element and waits: the thread goes on making the next ones.
    assert third_made.wait(DEADLOCK_S)
    assert where == {"stratagem-prefetch"}
    assert [int(v) for v in it] == list(range(1, 10))
    assert made == list(range(10))


def test_parallel_map_runs_calls_at_once_and_keeps_the_order():
    second_started = threading.Event()

    def fn(i):
        if int(i) == 0:
            # Returns only if call 1 runs while call 0 waits: the calls overlap.
            assert second_started.wait(DEADLOCK_S), "the map calls did not run concurrently"
        if int(i) == 1:
            second_started.set()
        return i * 10

    ds = sg.data.Dataset.range(7).map(fn, num_parallel_calls=2).batch(3)
    assert _values(ds) == [[0, 10, 20], [30, 40, 50], [60]]
    assert "num_parallel_calls=2" in repr(ds)


def test_parallel_map_autotune_and_structures():
    ds = sg.data.Dataset.from_tensor_slices({"a": torch.arange(5), "b": torch.ones(5)})
    out = ds.map(lambda e: (e["a"] + 1, e["b"] * 2), num_parallel_calls=sg.data.AUTOTUNE)
    assert [(int(a), float(b)) for a, b in out] == [(i + 1, 2.0) for i in range(5)]
    assert out.cardinality() == 5


@pytest.mark.parametrize("calls", [0, -2, 1.5, True])
def test_bad_num_parallel_calls(calls):
    with pytest.raises((sg.errors.InputError, TypeError), match=r"num_parallel_calls|integer"):
        sg.data.Dataset.range(3).map(lambda x: x, num_parallel_calls=calls)


def _fails_at_3(x):
    if int(x) == 3:
        raise ValueError(f"cannot decode element {int(x)}")
    return x


@pytest.mark.parametrize(
    "pipeline",
    [
        lambda ds: ds.map(_fails_at_3).prefetch(2),
        lambda ds: ds.map(_fails_at_3, num_parallel_calls=3),
        lambda ds: ds.map(_fails_at_3, num_parallel_calls=2).prefetch(1),
    ],
    ids=["prefetch", "parallel_map", "both"],
)
def test_background_errors_reach_the_step_with_their_traceback(pipeline):
    ds = pipeline(sg.data.Dataset.range(8))
    got = []
    with pytest.raises(ValueError, match="cannot decode element 3") as info:
        for x in ds:
            got.append(int(x))
    assert got == [0, 1, 2]  # the elements before the failing one still arrive, in order
    frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert "_fails_at_3" in frames  # where it happened, in the background thread


def test_threads_stop_on_break_on_drop_and_at_the_end():
    ds = sg.data.Dataset.range(10**6).map(lambda x: x + 1, num_parallel_calls=2).prefetch(4)
    for x in ds:
        if int(x) == 5:
            break
    gc.collect()
    assert _settled_threads([]) == []
    never_started = iter(ds)  # a pass dropped before its first element
    del never_started
    gc.collect()
    assert _settled_threads([]) == []
    taken = ds.take(3).map(lambda x: x, num_parallel_calls=2)  # a take stops pulling early
    assert [int(v) for v in taken] == [1, 2, 3]
    assert _settled_threads([]) == []
    it = iter(sg.data.Dataset.range(3).prefetch(1))
    assert [int(v) for v in it] == [0, 1, 2]
    assert _settled_threads([]) == []


def test_an_abandoned_pass_does_not_stop_the_process_from_exiting(tmp_path):
    script = tmp_path / "leave.py"
    script.write_text(
        textwrap.dedent(
            """
            import time
            import stratagem as sg

            def slow(x):
                time.sleep(0.001)
                return x

            ds = sg.data.Dataset.range(10**9).map(slow, num_parallel_calls=2).prefetch(8)
            it = iter(ds)  # kept alive to the end: the atexit hook must stop its thread
            print(int(next(it)), int(next(it)))
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=DEADLOCK_S
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "1"]
    assert "Traceback" not in done.stderr and "Exception" not in done.stderr


@pytest.mark.parametrize("device", ["/cpu:0", "cpu:1", "/device:CPU:0", torch.device("cpu")])
def test_prefetch_to_device_on_cpu(device):
    ds = sg.data.Dataset.from_tensor_slices(torch.arange(12.0)).batch(5)
    moved = ds.apply(sg.data.experimental.prefetch_to_device(device, 2))
    assert _values(moved) == _values(ds)
    assert all(b.device.type == "cpu" for b in moved)
    assert "prefetch_to_device('cpu', 2)" in repr(moved)
    copied = ds.apply(sg.data.experimental.copy_to_device(device))
    assert _values(copied) == _values(ds)


def test_prefetch_to_device_bad_arguments():
    with pytest.raises(sg.errors.InputError, match="unknown device 'tpu:0'"):
        sg.data.experimental.prefetch_to_device("tpu:0")
    if not torch.cuda.is_available():
        with pytest.raises(sg.errors.InputError, match="'/gpu:0' does not exist"):
            sg.data.experimental.prefetch_to_device("/gpu:0")
    with pytest.raises(TypeError, match="buffer_size"):
        sg.data.experimental.prefetch_to_device("/cpu:0", -3)
    with pytest.raises(TypeError, match=r"must return an sg\.data\.Dataset"):
        sg.data.Dataset.range(3).apply(lambda ds: 5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefetch_to_device_on_cuda_copies_ahead_on_a_side_stream():
    x = torch.randn(64, 8)
    ds = sg.data.Dataset.from_tensor_slices((x, torch.arange(64))).batch(16)
    moved = ds.apply(sg.data.experimental.prefetch_to_device("/gpu:0", 2))
    got = list(moved)
    assert all(a.device.type == "cuda" and b.device.type == "cuda" for a, b in got)
    torch.testing.assert_close(torch.cat([a for a, _ in got]).cpu(), x)
    # The step's stream may use the tensors at once: its work is ordered after the copy.
    total = sum(float((a * 2).sum()) for a, _ in moved)
    assert total == pytest.approx(float(x.sum()) * 2, rel=1e-5)


def test_a_pass_dropped_inside_one_of_its_own_map_calls_ends_without_an_error(monkeypatch):
    """The last reference to a pass let go by its own map function, in one of the pool's
    threads: the pass is closed there, and its pool must not wait for the thread that closes
    it ("cannot join current thread", reported as an ignored exception)."""
    ignored = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: ignored.append(repr(u.exc_value)))
    release, holder = threading.Event(), {}

    def drop_the_pass_at_1(x):
        if int(x) == 1:
            assert release.wait(DEADLOCK_S)
            holder.clear()  # the pass's last reference, in this pool thread
        return x

    it = iter(sg.data.Dataset.range(10).map(drop_the_pass_at_1, num_parallel_calls=2))
    assert int(next(it)) == 0  # element 1's call is running, waiting for the release
    holder["it"] = it
    del it
    release.set()
    assert _settled_threads([]) == []
    assert ignored == []
