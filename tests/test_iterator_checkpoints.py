"""Iterator checkpoints, as TF's: an ``sg.data`` iterator saved after k elements and restored
(from the bytes ``torch.load(weights_only=True)`` reads, in this process or a fresh one) yields
exactly the rest of an uninterrupted pass, through every transformation and their chains, k at
an epoch edge, inside a partial batch, inside a shuffle buffer and with elements prefetched."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import stratagem as sg
from cluster_utils import REPO, child_env

D = sg.data.Dataset
X = np.arange(40, dtype=np.float32).reshape(20, 2)
Y = np.arange(20)


def _plain(element):
    if isinstance(element, torch.Tensor):
        return element.tolist()
    if isinstance(element, tuple | list):
        return [_plain(e) for e in element]
    if isinstance(element, dict):
        return {k: _plain(v) for k, v in element.items()}
    return element


# Every transformation, alone and chained; each maker builds the same pipeline anew.
PIPELINES = {
    "range": lambda: D.range(25),
    "streaming_shuffle": lambda: D.range(30).shuffle(7, seed=3),
    "whole_shuffle": lambda: D.range(30).shuffle(100, seed=3),
    "repeat_reshuffles": lambda: D.range(10).shuffle(4, seed=1).repeat(3),
    "batch_partial": lambda: D.from_tensor_slices((X, Y)).batch(3),
    "map_then_batch": lambda: D.from_tensor_slices((X, Y)).map(lambda a, b: (a * 2, b)).batch(4),
    "parallel_map": lambda: D.range(33).map(lambda v: v + 1, num_parallel_calls=3).batch(5),
    "filter": lambda: D.range(200).filter(lambda v: v % 3 == 0),
    "take_skip_shard": lambda: D.range(100).skip(7).take(50).shard(3, 1),
    "prefetch": lambda: D.range(50).map(lambda v: v * 3).prefetch(4),
    "shuffle_batch_prefetch": lambda: D.range(50).shuffle(8, seed=2).batch(4).prefetch(2),
    "cache_of_map": lambda: D.range(12).map(lambda v: v * v).cache().repeat(3),
    "cache_then_shuffle": lambda: D.range(12).cache().shuffle(5, seed=9).repeat(2),
    "enumerate": lambda: D.range(15).enumerate(5).batch(2),
    "dict_drop_remainder": lambda: (
        D.from_tensor_slices({"a": X, "b": Y}).shuffle(6, seed=0).batch(4, True).repeat(2)
    ),
    "shuffle_after_map": lambda: (
        D.range(40).map(lambda v: (v, v * 2)).shuffle(9, seed=5).batch(3).prefetch(3)
    ),
    "shuffled_batches": lambda: D.range(40).batch(3).shuffle(5, seed=5),
    "interleave": lambda: D.range(1, 6).interleave(
        lambda x: D.from_tensors(x).repeat(6), cycle_length=2, block_length=4
    ),
    "interleave_chain": lambda: (
        D.range(8)
        .shuffle(4, seed=1)
        .interleave(lambda x: D.range(x).map(lambda v: v * 10 + x).batch(2), cycle_length=3)
        .prefetch(2)
    ),
}


def _saved(iterator) -> dict:
    """The iterator's state as a checkpoint file holds it: written, and read back as data."""
    buffer = io.BytesIO()
    torch.save(iterator.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_a_restored_iterator_yields_the_rest_of_an_uninterrupted_pass(name):
    make = PIPELINES[name]
    whole = [_plain(e) for e in make()]
    for k in range(len(whole) + 1):  # every position: epoch edges, partial batches, buffers
        iterator = iter(make())
        head = [_plain(next(iterator)) for _ in range(k)]
        state = _saved(iterator)
        restored = iter(make())
        restored.load_state_dict(state)
        # Saved again before it runs (a prefetch's thread may not have reached a stage yet):
        # what the stages had not used when restored is still theirs.
        again = iter(make())
        again.load_state_dict(_saved(restored))
        assert [_plain(e) for e in again] == whole[k:], f"{name}: saved again after {k}"
        rest = [_plain(e) for e in restored]
        assert head + rest == whole, f"{name}: restored after {k} elements"
        # Saving does not disturb the iterator that was saved.
        assert [_plain(e) for e in iterator] == rest


def test_tf_interleave_example_order():
    """TF's ``Dataset.interleave`` docstring example (cycle_length=2, block_length=4)."""
    dataset = D.range(1, 6).interleave(
        lambda x: D.from_tensors(x).repeat(6), cycle_length=2, block_length=4
    )
    assert [int(v) for v in dataset] == [
        1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 3, 3, 4, 4, 5, 5, 5, 5, 5, 5
    ]  # fmt: skip


def test_elements_prefetched_before_the_save_are_kept_not_made_again():
    made: list[int] = []
    ahead = threading.Event()

    def counted(v):
        made.append(int(v))
        if len(made) == 5:  # the first element, then the four the prefetch makes ahead
            ahead.set()
        return v * 2

    def pipeline():
        return D.range(30).map(counted).prefetch(4)

    iterator = iter(pipeline())
    assert int(next(iterator)) == 0
    assert ahead.wait(60), "the prefetch never made four elements ahead"
    state = _saved(iterator)
    made.clear()
    restored = iter(pipeline())
    restored.load_state_dict(state)
    assert [int(v) for v in restored] == [2 * v for v in range(1, 30)]
    assert made == list(range(5, 30)), "the prefetched elements 1..4 were made again (or lost)"


def test_a_generator_source_is_a_named_error_at_save():
    def numbers():
        yield from range(5)

    generated = D.from_generator(numbers, output_types=torch.int64).batch(2)
    # What the pipeline says of itself (an elastic fit asks it) is what a save finds.
    assert not generated.position_saveable()
    assert D.range(5).shuffle(3).map(lambda v: v).batch(2).prefetch(1).position_saveable()
    iterator = iter(generated)
    next(iterator)
    with pytest.raises(sg.errors.InputError, match=r"from_generator\(numbers\).*cannot be saved"):
        iterator.state_dict()
    checkpoint = sg.train.Checkpoint(iterator=iterator)
    with pytest.raises(sg.errors.InputError, match="from_generator"):
        checkpoint.write("unused/ckpt")


def test_restoring_into_another_pipeline_is_a_named_error():
    iterator = iter(D.range(10).batch(2))
    next(iterator)
    other = iter(D.range(10).shuffle(3).batch(2))
    with pytest.raises(sg.errors.InputError, match=r"stages \['SourceNode', 'Batch'\]"):
        other.load_state_dict(_saved(iterator))


RESTORE_IN_A_FRESH_PROCESS = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import test_iterator_checkpoints as t
out = {}
for name in t.PIPELINES:
    restored = iter(t.PIPELINES[name]())
    restored.load_state_dict(torch.load(f"{sys.argv[2]}/{name}.pt", weights_only=True))
    out[name] = [t._plain(e) for e in restored]
print(json.dumps(out))
"""


def test_a_checkpoint_restored_in_a_fresh_process_continues_the_pass(tmp_path):
    expected = {}
    for name, make in PIPELINES.items():
        whole = [_plain(e) for e in make()]
        iterator = iter(make())
        k = len(whole) // 2 + 1
        for _ in range(k):
            next(iterator)
        checkpoint = sg.train.Checkpoint(iterator=iterator, step=torch.tensor(k))
        checkpoint.write(str(tmp_path / name / "ckpt"))
        torch.save(iterator.state_dict(), tmp_path / f"{name}.pt")
        expected[name] = whole[k:]
    done = subprocess.run(
        [sys.executable, "-c", RESTORE_IN_A_FRESH_PROCESS, str(REPO / "tests"), str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=child_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == expected
    # sg.train.Checkpoint(iterator=...) restores the same position.
    for name, make in PIPELINES.items():
        restored = iter(make())
        sg.train.Checkpoint(iterator=restored, step=torch.tensor(0)).restore(
            str(tmp_path / name / "ckpt")
        )
        assert [_plain(e) for e in restored] == expected[name], name


class _Preempted(Exception):
    pass


def _consume_until_preempted(directory, stop_after: int | None) -> list:
    """A custom loop over a shuffled, mapped, batched, prefetched pipeline under a
    ``PreemptionCheckpointHandler`` whose checkpoint tracks the iterator; a notice after
    ``stop_after`` steps saves and 'exits'. Returns the batches this run consumed."""
    iterator = iter(PIPELINES["shuffle_after_map"]())
    step = torch.zeros((), dtype=torch.int64)
    manager = sg.train.CheckpointManager(
        sg.train.Checkpoint(iterator=iterator, step=step), str(directory), max_to_keep=1
    )

    def preempted() -> None:
        raise _Preempted

    config = sg.train.TerminationConfig(
        termination_watcher_fn=lambda: stop_after is not None and int(step) == stop_after,
        exit_fn=preempted,
        signals=(),
    )
    handler = sg.train.PreemptionCheckpointHandler(None, manager, termination_config=config)
    consumed = []

    def train_step(batch) -> None:
        consumed.append(_plain(batch))
        step.add_(1)

    try:
        for batch in iterator:
            handler.run(train_step, batch)
    except _Preempted:
        pass
    return consumed


def test_preemption_checkpoint_handler_saves_and_restores_the_input_position(tmp_path):
    whole = [_plain(e) for e in PIPELINES["shuffle_after_map"]()]
    before = _consume_until_preempted(tmp_path, stop_after=5)
    after = _consume_until_preempted(tmp_path, stop_after=None)  # restored at construction
    assert len(before) == 5
    assert before + after == whole


def _global_batches(strategy, iterator) -> list[list[int]]:
    """Each step's examples over the strategy's replicas (in replica order)."""
    return [
        [int(v) for part in strategy.experimental_local_results(batch) for v in part]
        for batch in iterator
    ]


@pytest.mark.parametrize(
    "saver, restorer",
    [
        (lambda: sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"]),
         lambda: sg.distribute.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])),
        (lambda: sg.distribute.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]),
         lambda: sg.distribute.experimental.CentralStorageStrategy(["cpu:0", "cpu:1"])),
        (lambda: sg.distribute.experimental.CentralStorageStrategy(["cpu:0", "cpu:1"]),
         lambda: sg.distribute.OneDeviceStrategy("cpu:0")),
    ],
    ids=["mirrored-2-to-3", "mirrored-3-to-central-storage-2", "central-storage-2-to-one"],
)  # fmt: skip
def test_in_process_strategies_resume_the_global_stream_on_another_number_of_replicas(
    saver, restorer
):
    def dataset():
        return D.range(60).shuffle(11, seed=4).batch(6).prefetch(2)

    whole = [sorted(b) for b in ([int(v) for v in batch] for batch in dataset())]
    before = saver()
    iterator = iter(before.experimental_distribute_dataset(dataset()))
    head = [sorted(b) for b in _global_batches(before, (next(iterator) for _ in range(4)))]
    state = _saved(iterator)
    after = restorer()
    restored = iter(after.experimental_distribute_dataset(dataset()))
    restored.load_state_dict(state)
    rest = [sorted(b) for b in _global_batches(after, restored)]
    assert head + rest == whole


@pytest.mark.parametrize("batch", [5, 6])  # 5: TF's rebatch re-cuts across input batches
def test_a_workers_own_rebatched_stream_resumes_exactly(batch):
    """``AutoShardPolicy.OFF``: the worker's own stream, rebatched for its replicas (the rows
    read and not handed out are part of the position)."""
    options = sg.data.Options()
    options.experimental_distribute.auto_shard_policy = sg.data.AutoShardPolicy.OFF

    def dataset():
        return D.range(47).shuffle(9, seed=2).batch(batch).with_options(options)

    strategy = sg.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    whole = _global_batches(strategy, iter(strategy.experimental_distribute_dataset(dataset())))
    for k in range(len(whole) + 1):
        iterator = iter(strategy.experimental_distribute_dataset(dataset()))
        head = _global_batches(strategy, (next(iterator) for _ in range(k)))
        state = _saved(iterator)
        restored = iter(strategy.experimental_distribute_dataset(dataset()))
        restored.load_state_dict(state)
        assert head + _global_batches(strategy, restored) == whole, f"after {k} steps"


def test_a_position_saved_by_another_input_pipeline_is_refused():
    """As under a parameter-server strategy, whose chief saves its own pipeline's position
    alone: worker 1's pipeline must not take pipeline 0's position for its own."""
    strategy = sg.distribute.get_strategy()

    def dataset_fn(ctx):
        return D.range(20).shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(2)

    iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
    next(iterator)
    state = _saved(iterator)
    assert state["per_worker"][0]["pipeline"] == [0, 1]
    state["per_worker"][0]["pipeline"] = [1, 2]  # what pipeline 1 of 2 would have saved
    restored = iter(strategy.distribute_datasets_from_function(dataset_fn))
    with pytest.raises(sg.errors.InputError, match="pipeline 1 of 2's; this iterator reads"):
        restored.load_state_dict(state)
    assert [int(v) for v in next(restored)] == [0, 1]  # refused before anything changed
