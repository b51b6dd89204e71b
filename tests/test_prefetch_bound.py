"""``prefetch(n)`` never lets the stages above it run more than ``n`` elements ahead.

TF's bound, from ``PrefetchThread`` in ``tensorflow/core/kernels/data/prefetch_dataset_op.cc``
(TF's ``prefetch_test.py`` has no test of it): the thread waits while
``buffer_.size() >= buffer_limit()`` and only then asks its input for the next element, so
the elements in the buffer plus the one being made are at most ``buffer_size``. Above the
prefetch, a ``map(num_parallel_calls=k)`` keeps up to ``k`` calls of its own (TF's
``ParallelMapIterator`` waits while ``invocation_results_.size() >= num_parallel_calls``), so
TF's bound on the elements made upstream is ``consumed + n + k``. Ours keeps ``k - 1``: its next
call is started when the prefetch asks for the next element, not before.

The counts are taken once the prefetch thread is provably idle (it waits for room in a full
buffer, shown by its ``waiting_for_room`` event, never by a sleep): then every count is exact.
"""

from __future__ import annotations

import gc
import threading

import pytest

import stratagem as sg
from stratagem.data._prefetch import running_prefetchers

DEADLOCK_S = 60  # only a thread that never fills its buffer reaches it


class _Counter:
    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def __call__(self, x):
        with self._lock:
            self.count += 1
        return x


def _started_since(before):
    return [worker for worker in running_prefetchers() if worker not in before]


@pytest.mark.parametrize("buffer_size", [1, 3])
@pytest.mark.parametrize("calls", [None, 1, 3])
@pytest.mark.parametrize("taken", [1, 5])
def test_prefetch_never_runs_the_stages_above_more_than_its_buffer_ahead(buffer_size, calls, taken):
    before = running_prefetchers()  # an earlier test's pass not collected yet is not ours
    made = _Counter()
    ds = sg.data.Dataset.range(100).map(made)  # in the prefetch thread: counts what it pulls
    if calls is not None:
        ds = ds.map(lambda x: x * 2, num_parallel_calls=calls)
    it = iter(ds.prefetch(buffer_size))
    for i in range(taken):  # the thread starts at the first next(), as TF's
        assert int(next(it)) == i * (1 if calls is None else 2)
    [worker] = _started_since(before)
    assert worker.waiting_for_room.wait(DEADLOCK_S), "the prefetch never filled its buffer"

    tf_bound = taken + buffer_size + (calls or 0)
    assert made.count <= tf_bound
    # Exact, so that one element too many (a bound of n + 1) fails even where TF's allows it.
    own_calls = 0 if calls is None else calls - 1
    assert made.count == taken + buffer_size + own_calls
    del it, worker
    gc.collect()
    assert _started_since(before) == []


def test_the_bound_holds_again_after_each_element_taken():
    """Take one element at a time: each wakes the thread for exactly one more."""
    before = running_prefetchers()
    made = _Counter()
    it = iter(sg.data.Dataset.range(100).map(made).prefetch(2))
    for consumed in range(1, 8):
        next(it)
        [worker] = _started_since(before)
        assert worker.waiting_for_room.wait(DEADLOCK_S)
        assert made.count == consumed + 2
    del it, worker
    gc.collect()
