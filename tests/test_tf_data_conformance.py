"""``sg.data`` as ``tf.data`` behaves, translated from TensorFlow's own kernel tests.

Each test names the TF test it comes from (``tensorflow/python/data/kernel_tests/<name>_test.py``)
and the behaviour it checks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import stratagem as sg
from stratagem.errors import InputError

Dataset = sg.data.Dataset


# -- batch_test.py ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("count", "batch_size", "drop_remainder"),
    [(20, 14, False), (20, 14, True), (20, 20, False), (20, 21, True), (0, 14, False)],
)
def test_batch_dataset(count, batch_size, drop_remainder):
    """batch_test.testBasic: full batches in order; the remainder is kept unless
    drop_remainder; the cardinality counts it the same way."""
    dataset = Dataset.range(count).batch(batch_size, drop_remainder=drop_remainder)
    full, rest = divmod(count, batch_size)
    expected = [list(range(i * batch_size, (i + 1) * batch_size)) for i in range(full)]
    if rest and not drop_remainder:
        expected.append(list(range(full * batch_size, count)))
    assert [b.tolist() for b in dataset] == expected
    assert dataset.cardinality() == len(expected)


def test_batch_static_shape_with_drop_remainder():
    """batch_test.testBatchShapeError's counterpart: element_spec has the static batch size
    with drop_remainder=True and None without (TF's output shapes)."""
    assert Dataset.range(10).batch(4, drop_remainder=True).element_spec.shape == (4,)
    assert Dataset.range(10).batch(4).element_spec.shape == (None,)


@pytest.mark.parametrize("batch_size", [0, -1])
def test_batch_invalid_size(batch_size):
    """batch_test.testInvalidBatchSize: batch_size must be positive."""
    with pytest.raises(InputError, match="batch_size must be >= 1"):
        Dataset.range(10).batch(batch_size)


def test_batch_of_structures():
    """batch_test (nested components): a tuple of components batches component-wise."""
    dataset = Dataset.from_tensor_slices((np.arange(5), np.arange(5) * 2.0)).batch(2)
    first = next(iter(dataset))
    assert isinstance(first, tuple)
    assert first[0].tolist() == [0, 1] and first[1].tolist() == [0.0, 2.0]


# -- shard_test.py ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("count", "num_shards", "index", "expected"),
    [
        (10, 5, 2, [2, 7]),  # testSimpleCase
        (10, 5, 0, [0, 5]),  # testOffsetZero
        (1, 5, 2, []),  # testIteratorEndsBeforeFirstElem
        (10, 7, 5, [5]),  # testLargerWorkerPool
        (10, 5, 4, [4, 9]),  # testIndexEqualsNumShards
        (10, 4, 3, [3, 7]),  # testIndexEqualsNumShards2
        (10, 20, 5, [5]),  # testNumShardsLargerThanDataset
    ],
)
def test_shard(count, num_shards, index, expected):
    """shard_test: element i goes to shard i % num_shards; the cardinality says how many."""
    dataset = Dataset.range(count).shard(num_shards, index)
    assert [int(x) for x in dataset] == expected
    assert dataset.cardinality() == len(expected)


def test_shard_nested_data():
    """shard_test.testNestedData: a tuple element is sharded whole."""
    dataset = Dataset.from_tensor_slices((np.arange(10), np.arange(10) * 2)).shard(5, 2)
    assert [(int(a), int(b)) for a, b in dataset] == [(2, 4), (7, 14)]


@pytest.mark.parametrize(
    ("num_shards", "index", "message"),
    [
        (5, 7, r"index must be in \[0, 5\)"),  # testOffsetGreaterNumShards
        (5, -3, r"index must be in \[0, 5\)"),  # testNegativeOffset
        (-3, 1, "num_shards must be >= 1"),  # testNegativeNumShards
        (0, 1, "num_shards must be >= 1"),  # testZeroNumShards
    ],
)
def test_shard_invalid_arguments(num_shards, index, message):
    """shard_test: an index outside [0, num_shards) or num_shards < 1 is an error."""
    with pytest.raises(InputError, match=message):
        Dataset.range(10).shard(num_shards, index)


def test_shard_hint_is_a_placeholder():
    """distribute's SHARD_HINT: shard(SHARD_HINT, SHARD_HINT) only means something under
    AutoShardPolicy.HINT; iterating it directly says so."""
    hinted = Dataset.range(4).shard(sg.data.experimental.SHARD_HINT, -1)
    with pytest.raises(ValueError, match="placeholder"):
        list(hinted)


# -- shuffle_test.py ----------------------------------------------------------------------------


def test_shuffle_is_a_permutation():
    """shuffle_test.testBasic: every element once, in another order."""
    values = [int(x) for x in Dataset.range(100).shuffle(100, seed=3)]
    assert sorted(values) == list(range(100)) and values != list(range(100))


def test_shuffle_seed_determinism():
    """shuffle_test.testSeedZero / testShuffleSeed: the same seed gives the same order in a
    new pipeline; another seed another order."""

    def order(seed):
        return [int(x) for x in Dataset.range(50).shuffle(10, seed=seed)]

    assert order(7) == order(7)
    assert order(7) != order(8)
    assert order(0) == order(0)  # seed 0 is a seed, not "no seed"


@pytest.mark.parametrize("reshuffle", [True, False, None])
def test_reshuffle_each_iteration(reshuffle):
    """shuffle_test.testReshuffleRepeatEpochs / testDefaultArguments: each pass (an iter()
    or a repeat round) reshuffles unless reshuffle_each_iteration=False; the default is True."""
    dataset = Dataset.range(20).shuffle(20, seed=1, reshuffle_each_iteration=reshuffle)
    first, second = [int(x) for x in dataset], [int(x) for x in dataset]
    repeated = [int(x) for x in dataset.repeat(2)]
    if reshuffle is False:
        assert first == second and repeated[:20] == repeated[20:]
    else:
        assert first != second and repeated[:20] != repeated[20:]
    assert sorted(first) == sorted(second) == list(range(20))


def test_shuffle_small_buffer_moves_elements_little():
    """shuffle_test.testSmallBuffer: with buffer_size 1 the order is unchanged (the buffer
    holds one element at a time)."""
    assert [int(x) for x in Dataset.range(10).shuffle(1, seed=5)] == list(range(10))


@pytest.mark.parametrize("size", [0, -5])
def test_shuffle_invalid_buffer_size(size):
    """shuffle_test.testInvalidBufferSize: the buffer size must be positive."""
    with pytest.raises(InputError, match="buffer_size must be >= 1"):
        Dataset.range(10).shuffle(size)


# -- from_tensors_test.py, from_tensor_slices_test.py --------------------------------------------


def test_from_tensors_is_one_element():
    """from_tensors_test.testFromTensors: the whole structure is the single element; repeat
    then batch as in the distributed input guide."""
    dataset = Dataset.from_tensors((torch.tensor([1.0]), torch.tensor([2.0, 3.0])))
    (element,) = list(dataset)
    assert element[0].tolist() == [1.0] and element[1].tolist() == [2.0, 3.0]
    assert dataset.cardinality() == 1
    batch = next(iter(Dataset.from_tensors(([1.0], [1.0])).repeat(100).batch(16)))
    assert batch[0].shape == (16, 1)
    assert Dataset.from_tensors(5).element_spec == sg.data.TensorSpec((), torch.int64)


def test_none_component_is_kept():
    """dataset_test.testNoneComponent: ``from_tensors((42, None))`` gives ``(42, None)``; its
    spec has no tensor for the None (TF's NoneTensorSpec; here None)."""
    dataset = Dataset.from_tensors((42, None))
    ((value, nothing),) = list(dataset)
    assert value.item() == 42 and nothing is None
    assert dataset.element_spec == (sg.data.TensorSpec((), torch.int64), None)


def test_none_component_reaches_map_functions():
    """map_test.testNoneComponent: map_func receives the None component as an argument."""

    def halve_if_none(x, y):
        return x / 2 if y is None else x

    assert [v.item() for v in Dataset.from_tensors((42, None)).map(halve_if_none)] == [21]


def test_none_component_returned_by_map_then_batched():
    """dataset_test.testNoneComponentInFunction: ``range(10).map(lambda x: (x, None))``
    iterates to 45; and as TF's NoneTensorSpec batches to itself, ``batch`` keeps None."""
    dataset = Dataset.range(10).map(lambda x: (x, None))
    assert sum(x.item() for x, _ in dataset) == 45
    batches = list(dataset.batch(4))
    assert [b[0].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert all(b[1] is None for b in batches)
    assert dataset.batch(4).element_spec == (sg.data.TensorSpec((None,), torch.int64), None)
    slices = Dataset.from_tensor_slices({"x": torch.arange(3), "none": None}).batch(2)
    assert [(b["x"].tolist(), b["none"]) for b in slices] == [([0, 1], None), ([2], None)]


def test_from_tensor_slices_empty_list():
    """from_tensor_slices_test.testFromTensorSlicesEmptyComponent: [] is an empty dataset
    (float32, as TF converts an empty list)."""
    dataset = Dataset.from_tensor_slices([])
    assert list(dataset) == [] and dataset.cardinality() == 0
    assert dataset.element_spec == sg.data.TensorSpec((), torch.float32)


def test_string_components():
    """from_tensor_slices_test with tf.string: strings slice and batch (here Python str
    elements and numpy string batches: torch has no string tensors)."""
    dataset = Dataset.from_tensor_slices((["a", "c", "e"], [1, 2, 3]))
    assert [(s, int(n)) for s, n in dataset] == [("a", 1), ("c", 2), ("e", 3)]
    words, numbers = next(iter(dataset.batch(2)))
    assert words.tolist() == ["a", "c"] and numbers.tolist() == [1, 2]
    assert dataset.element_spec[0] == sg.data.TensorSpec((), sg.data.string)
    assert list(Dataset.from_tensor_slices(["x"]).map(lambda s: s + "!")) == ["x!"]


# -- enumerate_test.py --------------------------------------------------------------------------


def test_enumerate():
    """enumerate_test.testEnumerate: (index, element) pairs, int64 indices from start."""
    components = (["a", "b"], [1, 2], [37.0, 38.0])
    dataset = Dataset.from_tensor_slices(components).enumerate(start=3)
    pairs = list(dataset)
    assert [int(i) for i, _ in pairs] == [3, 4]
    assert pairs[0][1] == ("a", torch.tensor(1), torch.tensor(37.0))
    assert dataset.element_spec[0] == sg.data.TensorSpec((), torch.int64)


# -- from_generator_test.py ---------------------------------------------------------------------


def test_from_generator_calls_the_generator_each_pass():
    """from_generator_test.testFromGeneratorUsingFunction: a callable, called for each pass."""
    dataset = Dataset.from_generator(
        lambda: iter(np.arange(3)), output_signature=sg.data.TensorSpec((), torch.int64)
    )
    assert [int(x) for x in dataset] == [0, 1, 2]
    assert [int(x) for x in dataset] == [0, 1, 2]
    assert dataset.cardinality() == Dataset.UNKNOWN


def test_from_generator_with_args_and_types():
    """from_generator_test.testFromGeneratorWithArgs and testFromGeneratorImplicitConversion:
    args are passed; values convert to output_types (float64 to float32)."""

    def gen(n):
        for i in range(n):
            yield np.full(4, float(i)), i

    dataset = Dataset.from_generator(
        gen, output_types=(torch.float32, torch.int64), output_shapes=((4,), ()), args=(2,)
    )
    x, i = list(dataset)[1]
    assert x.dtype == torch.float32 and x.tolist() == [1.0] * 4 and int(i) == 1
    assert dataset.element_spec == (
        sg.data.TensorSpec((4,), torch.float32),
        sg.data.TensorSpec((), torch.int64),
    )


def test_from_generator_checks_structure_and_shape():
    """from_generator_test.testGeneratorStructureMismatch / testFromGeneratorWrongShape: an
    element that does not match the declared structure or shape raises."""
    pairs = Dataset.from_generator(
        lambda: iter([(1, 2), (3,)]), output_types=(torch.int64, torch.int64)
    )
    with pytest.raises(InputError, match="does not match the declared structure"):
        list(pairs)
    shaped = Dataset.from_generator(
        lambda: iter([np.zeros(4), np.zeros(3)]),
        output_signature=sg.data.TensorSpec((4,), torch.float32),
    )
    with pytest.raises(InputError, match=r"shape \(3,\).*declared shape \(4,\)"):
        list(shaped)


def test_from_generator_needs_a_signature():
    """dataset_ops.from_generator: output_signature or output_types is required, not both."""
    with pytest.raises(TypeError, match="output_signature"):
        Dataset.from_generator(lambda: iter([]))
    with pytest.raises(TypeError, match="not both"):
        Dataset.from_generator(
            lambda: iter([]),
            output_types=torch.float32,
            output_signature=sg.data.TensorSpec((), torch.float32),
        )


# -- options_test.py ----------------------------------------------------------------------------


def test_options_default_and_with_options():
    """options_test.testOptionsDefault / testOptionsOnce / testOptionsTwiceSame: default
    options; with_options sets them for the whole pipeline, later transformations keep them."""
    assert Dataset.range(0).options() == sg.data.Options()
    options = sg.data.Options()
    options.experimental_distribute.auto_shard_policy = sg.data.experimental.AutoShardPolicy.OFF
    dataset = Dataset.range(4).with_options(options).batch(2)
    policy = dataset.options().experimental_distribute.auto_shard_policy
    assert policy == sg.data.experimental.AutoShardPolicy.OFF
    assert [b.tolist() for b in dataset] == [[0, 1], [2, 3]]


def test_options_merge():
    """options_test.testOptionsTwiceDifferentOptions / testOptionsMergeOptionsFromMultipleInputs:
    options set at different points merge; the later one wins."""
    first, second = sg.data.Options(), sg.data.Options()
    first.experimental_distribute.auto_shard_policy = sg.data.AutoShardPolicy.DATA
    second.deterministic = False
    dataset = Dataset.range(1).with_options(first).with_options(second)
    merged = dataset.options()
    assert merged.experimental_distribute.auto_shard_policy == sg.data.AutoShardPolicy.DATA
    assert merged.deterministic is False


def test_options_refuse_unknown_names():
    """tf.data.Options refuses attributes it does not define (options_lib's frozen options)."""
    with pytest.raises(AttributeError, match="no option 'not_an_option'"):
        sg.data.Options().not_an_option = 1
    with pytest.raises(ValueError, match="AutoShardPolicy"):
        sg.data.Options().experimental_distribute.auto_shard_policy = 9


# -- iterator_test.py / optional_test.py --------------------------------------------------------


def test_get_next_as_optional():
    """iterator_ops (get_next_as_optional) and optional_test.testFromValue / testEmpty: a
    value while there is one, then an empty Optional whose get_value raises."""
    iterator = iter(Dataset.range(2))
    assert iterator.get_next_as_optional().get_value().item() == 0
    assert iterator.get_next().item() == 1
    empty = iterator.get_next_as_optional()
    assert not empty.has_value()
    assert empty.element_spec == sg.data.TensorSpec((), torch.int64)
    with pytest.raises(InputError, match="empty Optional"):
        empty.get_value()


def test_element_spec_of_map():
    """map_test (element_spec of the result): the function's output spec, batch dim None."""
    dataset = Dataset.range(6).batch(4).map(lambda x: (x * 2, x.float()))
    assert dataset.element_spec == (
        sg.data.TensorSpec((None,), torch.int64),
        sg.data.TensorSpec((None,), torch.float32),
    )


# -- map_test.py: errors, names, namedtuples ------------------------------------------------------


def _check_numerics(x):
    if torch.isnan(x):
        raise FloatingPointError("message")  # tf.debugging.check_numerics's InvalidArgumentError
    return x


@pytest.mark.parametrize(
    "pipeline",
    [
        lambda d: d.map(_check_numerics),
        lambda d: d.map(_check_numerics, num_parallel_calls=2),
        lambda d: d.map(_check_numerics).prefetch(2),
        lambda d: d.map(_check_numerics, num_parallel_calls=2).prefetch(None),
    ],
    ids=["map", "parallel-map", "prefetch", "parallel-map-prefetch-autotune"],
)
def test_a_failed_element_raises_in_its_place_and_the_pass_goes_on(pipeline):
    """map_test.testParallelMapError, testPrefetchError (and the sequential map): the 4th
    element is NaN; next() raises for it, the 5th still comes, then the end."""
    components = torch.tensor([1.0, 2.0, 3.0, float("nan"), 5.0])
    iterator = iter(pipeline(Dataset.from_tensor_slices(components)))
    assert [float(next(iterator)) for _ in range(3)] == [1.0, 2.0, 3.0]
    with pytest.raises(FloatingPointError, match="message"):
        next(iterator)
    assert float(next(iterator)) == 5.0
    with pytest.raises(StopIteration):
        next(iterator)


def test_a_failed_element_drops_the_batch_it_was_for_and_filter_errors_are_elements_too():
    # TF's batch returns its input's error at once (the partial batch is dropped) and starts
    # the next batch with the next element; a filter predicate's error is the element's.
    def fail_on_2(x):
        if int(x) == 2:
            raise ValueError("bad 2")
        return x

    iterator = iter(Dataset.range(7).map(fail_on_2).batch(2))
    assert next(iterator).tolist() == [0, 1]
    with pytest.raises(ValueError, match="bad 2"):
        next(iterator)
    assert [b.tolist() for b in iterator] == [[3, 4], [5, 6]]
    iterator = iter(Dataset.range(4).filter(lambda x: bool(fail_on_2(x) % 2 == 0)))
    assert int(next(iterator)) == 0
    with pytest.raises(ValueError, match="bad 2"):
        next(iterator)
    assert list(iterator) == []  # 3 is odd: nothing after the error
    # A cache does not keep a pass that had a failed element: the next pass computes it again.
    cached = Dataset.range(3).map(fail_on_2).cache()
    for _ in range(2):
        iterator = iter(cached)
        assert [int(next(iterator)) for _ in range(2)] == [0, 1]
        with pytest.raises(ValueError, match="bad 2"):
            next(iterator)


def test_name_is_accepted_everywhere_tf_takes_it_and_prefetch_none_is_autotune():
    """TF 2.6+ takes name= on sources and transformations; prefetch(None) is AUTOTUNE."""
    d = Dataset.from_tensor_slices(torch.arange(8), name="s")
    d = (
        d.shuffle(4, seed=1, name="sh")
        .map(lambda x: x * 2, name="m")
        .filter(lambda x: x >= 0, name="f")
    )
    d = d.batch(2, name="b").repeat(1, name="r").take(3, name="t").skip(0, name="k")
    d = d.enumerate(name="e").shard(1, 0, name="sd").cache(name="c").prefetch(None, name="p")
    assert len(list(d)) == 3
    assert Dataset.from_tensors(torch.ones(2), name="one").cardinality() == 1
    assert "prefetch(AUTOTUNE)" in repr(Dataset.range(2).prefetch(None))


def test_a_namedtuple_element_is_one_argument_a_plain_tuple_is_unpacked():
    """map_test.testMapNamedtuple: TF unpacks only plain tuples into arguments."""
    import collections

    Example = collections.namedtuple("Example", "x y")
    d = Dataset.from_tensor_slices(Example(torch.arange(3), torch.arange(3) * 10))
    assert [int(v) for v in d.map(lambda e: e.x + e.y)] == [0, 11, 22]
    pairs = Dataset.from_tensor_slices((torch.arange(3), torch.arange(3) * 10))
    assert [int(v) for v in pairs.map(lambda x, y: x + y)] == [0, 11, 22]


@pytest.mark.parametrize("calls", [None, 2])
def test_preserve_cardinality_a_function_ending_the_iteration_is_an_element_error(calls):
    """TF's ``map_test.testPreserveCardinality``: a map function that raises StopIteration
    gives that element an error (TF's InvalidArgumentError), never a silent end of the data;
    as every element error here, the pass goes on."""

    def ends_at_two(x):
        if int(x) == 2:
            raise StopIteration
        return x

    iterator = iter(sg.data.Dataset.range(5).map(ends_at_two, num_parallel_calls=calls))
    assert [int(next(iterator)) for _ in range(2)] == [0, 1]
    with pytest.raises(InputError, match="raised StopIteration for an element"):
        next(iterator)
    assert [int(v) for v in iterator] == [3, 4]

    def always_ends(x):
        raise StopIteration

    with pytest.raises(InputError, match="always_ends raised StopIteration"):
        next(iter(sg.data.Dataset.from_tensors(0).filter(always_ends)))


def test_from_tensors_keeps_a_none_component():
    """TF's ``from_tensors((42, None))``: one element, the None kept as it is."""
    (element,) = list(sg.data.Dataset.from_tensors((42, None)))
    assert int(element[0]) == 42 and element[1] is None
    spec = sg.data.Dataset.from_tensors((42, None)).element_spec
    assert spec[1] is None
