"""``sg.data.Dataset``: tf.data's input pipelines over in-memory tensors and arrays.

``Dataset.from_tensor_slices((x, y)).shuffle(60000).shard(n, i).batch(64)`` ports from
TensorFlow unchanged and yields torch tensors. Pipelines without ``map`` never touch elements
one by one: they move index arrays and read each batch with one vectorized index per component.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np
import torch

from stratagem.config.threading import usable_cpus
from stratagem.data import _structure
from stratagem.data._chunks import RangeSource, TensorSlices
from stratagem.data._generator import Generated, signature
from stratagem.data._interleave import Interleave
from stratagem.data._nodes import (
    INFINITE,
    SHARD_HINT,
    UNKNOWN,
    Batch,
    Node,
    Repeat,
    ShardNode,
    Skip,
    SourceNode,
    Take,
    WithOptions,
    fresh_copy,
)
from stratagem.data._parallel_map import ParallelMap
from stratagem.data._prefetch import AUTOTUNE_BUFFER, Prefetch
from stratagem.data._shuffle import Shuffle, scoped_seed
from stratagem.data._values import Cache, Enumerate, Filter, Map
from stratagem.data.iterator import DatasetIterator
from stratagem.data.options import Options
from stratagem.errors import InputError

AUTOTUNE = -1

# What a pipeline's recipe may name (``Dataset.recipe``): the sources, then the transformations.
RECIPE_SOURCES = frozenset({"from_tensor_slices", "from_tensors", "from_generator", "range"})
RECIPE_STEPS = frozenset(
    {
        "shuffle", "batch", "repeat", "shard", "take", "skip", "map", "enumerate", "filter",
        "prefetch", "cache", "with_options", "interleave",
    }
)  # fmt: skip


class Dataset:
    """A re-iterable, immutable pipeline: each transformation returns a new ``Dataset`` and each
    ``iter()`` starts a new pass. Build one with ``from_tensor_slices`` or ``range``.

    Every ``name=`` argument (TF names the op it builds) is accepted for porting and unused: no
    graph op is built here. An element whose ``map`` (or ``filter``) function raises is TF's
    failed element: the ``next()`` that asks for it raises that error, and the pass goes on with
    the next element.
    """

    INFINITE: ClassVar[int] = INFINITE
    UNKNOWN: ClassVar[int] = UNKNOWN

    __slots__ = ("_node", "_recipe")

    def __init__(self, node: Node) -> None:
        self._node = node
        # How this dataset was made: the dataset it transforms (None for a source), the
        # method and its arguments; None where it was made otherwise (``reseeded``).
        self._recipe: tuple[Dataset | None, str, tuple[Any, ...]] | None = None

    def _made(self, node: Node, method: str, *args: Any) -> Dataset:
        """A new dataset of ``node``, made by ``self.method(*args)`` (its recipe's last step)."""
        dataset = Dataset(node)
        dataset._recipe = (self, method, args)
        return dataset

    @staticmethod
    def _sourced(node: Node, method: str, *args: Any) -> Dataset:
        dataset = Dataset(node)
        dataset._recipe = (None, method, args)
        return dataset

    # -- sources ---------------------------------------------------------------------------

    @staticmethod
    def from_tensor_slices(tensors: Any, name: str | None = None) -> Dataset:
        """One element per slice along dim 0 of ``tensors``: a tensor or array, or a tuple, list
        or dict (nested) of them, all of the same first dimension.

        Elements keep the structure (a tuple stays a tuple) and numpy dtypes (uint8 stays uint8,
        float64 stays float64). Arrays are shared with torch, not copied, where torch allows it
        (as ``torch.from_numpy``): change them afterwards and the dataset sees the change.
        A list of plain numbers is data, as in TensorFlow: ``[1, 2, 3]`` gives three elements,
        and ``[]`` none (an empty float32 dataset). Strings (``["a", "b"]``, a numpy array of
        str) give string components: torch has no string tensors, so an element is a Python
        ``str`` and a batch a numpy array of them.
        """
        template = _structure.map_structure(_structure.to_tensor, tensors)
        leaves = _structure.flatten_with_paths(template)
        if not leaves:
            raise InputError(f"from_tensor_slices needs at least one component; got {tensors!r}")
        scalars = [path for path, t in leaves if _structure.rank(t) == 0]
        if scalars:
            raise InputError(
                "from_tensor_slices slices along the first dimension, but component(s) "
                f"{', '.join(scalars)} are scalars (shape ()); use at least 1-d tensors"
            )
        lengths = {int(t.shape[0]) for _, t in leaves}
        if len(lengths) > 1:
            shapes = ", ".join(f"{path}: {tuple(t.shape)}" for path, t in leaves)
            raise InputError(
                f"from_tensor_slices needs every component to have the same first dimension; "
                f"got shapes {shapes}"
            )
        source = TensorSlices(template, [t for _, t in leaves])
        node = SourceNode(source, f"from_tensor_slices({_shapes(template)})")
        return Dataset._sourced(node, "from_tensor_slices", template)

    @staticmethod
    def from_tensors(tensors: Any, name: str | None = None) -> Dataset:
        """One element: ``tensors`` itself (a tensor, array, number, string, or a structure of
        them), as ``tf.data.Dataset.from_tensors``; ``from_tensors(x).repeat(n)`` gives it n
        times. A ``None`` in the structure is kept as it is, through ``map`` and ``batch`` too,
        as TF keeps it (``from_tensors((42, None))``); its spec is ``None`` (TF's
        ``NoneTensorSpec``, which holds no tensor).
        """
        template = _structure.map_structure(_structure.to_tensor, tensors)
        leaves = _structure.flatten_with_paths(template)
        if not leaves:
            raise InputError(f"from_tensors needs at least one component; got {tensors!r}")
        # One slice along a new leading dim of each component: a view, no copy.
        stacked = [t[None] for _, t in leaves]
        source = TensorSlices(template, stacked)
        node = SourceNode(source, f"from_tensors({_shapes(template)})")
        return Dataset._sourced(node, "from_tensors", template)

    @staticmethod
    def from_generator(
        generator: Callable[..., Any],
        output_types: Any = None,
        output_shapes: Any = None,
        args: tuple[Any, ...] | None = None,
        output_signature: Any = None,
        name: str | None = None,
    ) -> Dataset:
        """The elements ``generator(*args)`` yields, called anew for each pass, as in TF.

        Declare them with ``output_signature`` (a structure of ``sg.data.TensorSpec``), or with
        ``output_types`` (torch or numpy dtypes, ``str`` for strings) and optional
        ``output_shapes`` (tuples, ``None`` for a size that varies). Each element is converted
        to the declared dtypes and checked against the declared structure and shapes; a
        mismatch raises at that element. The cardinality is ``UNKNOWN``. ``name`` is accepted
        for porting (TF names the op; there is no op here).
        """
        _require_callable("from_generator", generator)
        spec = signature(output_types, output_shapes, output_signature)
        call_args = () if args is None else tuple(args)
        return Dataset._sourced(
            Generated(generator, call_args, spec),
            "from_generator",
            generator,
            output_types,
            output_shapes,
            call_args,
            output_signature,
        )

    @staticmethod
    def range(*args: int) -> Dataset:
        """int64 scalars ``range(stop)``, ``range(start, stop)`` or ``range(start, stop, step)``,
        as Python's ``range``.
        """
        if not 1 <= len(args) <= 3:
            raise TypeError(f"Dataset.range takes 1 to 3 integers (as range does); got {args!r}")
        bounds = [_integer("Dataset.range argument", a) for a in args]
        numbers = range(*bounds)  # raises for step 0, as Python's range does
        source = RangeSource(numbers.start, numbers.step, len(numbers))
        node = SourceNode(source, f"range({', '.join(map(str, bounds))})")
        return Dataset._sourced(node, "range", *bounds)

    # -- transformations -------------------------------------------------------------------

    def shuffle(
        self,
        buffer_size: int,
        seed: int | None = None,
        reshuffle_each_iteration: bool | None = None,
        name: str | None = None,
    ) -> Dataset:
        """Elements in random order, drawn through a buffer of ``buffer_size`` as in tf.data.

        When the upstream is finite and fits in the buffer, each pass is a full random
        permutation; otherwise elements stream through the buffer (fill it, emit a random one,
        replace it with the next), so an element moves at most ``buffer_size - 1`` places
        earlier. With ``seed``, pass e uses an order fixed by ``(seed, e)``, e counting the
        passes started on this shuffle (each ``iter()``, and each round of a ``repeat`` after
        it). Without, a seed is drawn from torch's global generator at ``iter()`` time, so
        ``torch.manual_seed`` makes runs repeat (inside ``seed_scope``, the scope gives the
        seed). ``reshuffle_each_iteration=False`` uses the same order on every pass.
        """
        size = _integer("shuffle buffer_size", buffer_size)
        if size < 1:
            raise InputError(f"shuffle buffer_size must be >= 1; got {buffer_size!r}")
        # An unseeded shuffle created inside seed_scope gets its seed from there.
        seed = scoped_seed() if seed is None else _integer("shuffle seed", seed)
        reshuffle = True if reshuffle_each_iteration is None else bool(reshuffle_each_iteration)
        return self._made(
            Shuffle(self._node, size, seed, reshuffle), "shuffle", size, seed, reshuffle
        )

    def batch(
        self,
        batch_size: int,
        drop_remainder: bool = False,
        num_parallel_calls: int | None = None,
        deterministic: bool | None = None,
        name: str | None = None,
    ) -> Dataset:
        """Consecutive elements stacked into batches of ``batch_size`` (a new leading dim).

        The last, smaller batch is kept unless ``drop_remainder``. ``num_parallel_calls`` and
        ``deterministic`` are accepted for porting and ignored: batches are one index each.
        """
        size = _integer("batch_size", batch_size)
        if size < 1:
            raise InputError(f"batch_size must be >= 1; got {batch_size!r}")
        return self._made(
            Batch(self._node, size, bool(drop_remainder)), "batch", size, bool(drop_remainder)
        )

    def repeat(self, count: int | None = None, name: str | None = None) -> Dataset:
        """The dataset ``count`` times over, each time a new pass; ``None`` or -1: forever."""
        if count is not None:
            count = _integer("repeat count", count)
            if count < -1:
                raise InputError(f"repeat count must be >= 0, or -1/None for forever; got {count}")
        return self._made(
            Repeat(self._node, None if count in (None, -1) else count), "repeat", count
        )

    def shard(self, num_shards: int, index: int, name: str | None = None) -> Dataset:
        """Every ``num_shards``-th element starting at ``index`` (``i % num_shards == index``).

        ``shard(SHARD_HINT, SHARD_HINT)`` (``sg.data.experimental.SHARD_HINT``) is a placeholder
        that ``experimental_distribute_dataset`` under ``AutoShardPolicy.HINT`` fills in.
        """
        shards = _integer("shard num_shards", num_shards)
        position = _integer("shard index", index)
        if shards == SHARD_HINT and position == SHARD_HINT:
            return self._made(
                ShardNode(self._node, SHARD_HINT, SHARD_HINT), "shard", SHARD_HINT, SHARD_HINT
            )
        if shards < 1:
            raise InputError(f"shard num_shards must be >= 1; got {num_shards!r}")
        if not 0 <= position < shards:
            raise InputError(
                f"shard index must be in [0, {shards}) for num_shards={shards}; got {index!r}"
            )
        return self._made(ShardNode(self._node, shards, position), "shard", shards, position)

    def take(self, count: int, name: str | None = None) -> Dataset:
        """The first ``count`` elements (all of them for -1)."""
        n = _count("take", count)
        return self._made(Take(self._node, n), "take", n)

    def skip(self, count: int, name: str | None = None) -> Dataset:
        """All but the first ``count`` elements (none of them for -1)."""
        n = _count("skip", count)
        return self._made(Skip(self._node, n), "skip", n)

    def map(
        self,
        map_func: Callable[..., Any],
        num_parallel_calls: int | None = None,
        deterministic: bool | None = None,
        name: str | None = None,
    ) -> Dataset:
        """``map_func`` applied to each element, called as tf.data calls it: a tuple element's
        components are positional arguments, any other element is the one argument.

        Runs element by element (batch first for vectorized work). Results that are numpy
        arrays or numbers become tensors. ``num_parallel_calls=n`` (or ``AUTOTUNE``: one per
        usable core) runs up to ``n`` calls at once on a pool of threads, which pays where
        ``map_func`` leaves the GIL (torch and numpy operations, I/O); results keep the input's
        order, as tf.data's default ``deterministic=True``. ``deterministic=False`` allows any
        order in TF; the input's order is one of them.
        """
        _require_callable("map", map_func)
        if num_parallel_calls is None:
            return self._made(Map(self._node, map_func), "map", map_func)
        calls = _integer("map num_parallel_calls", num_parallel_calls)
        if calls == AUTOTUNE:
            calls = usable_cpus()
        if calls < 1:
            raise InputError(
                f"map num_parallel_calls must be >= 1 or sg.data.AUTOTUNE (-1); got "
                f"{num_parallel_calls!r}"
            )
        if calls == 1:
            return self._made(Map(self._node, map_func), "map", map_func)
        return self._made(ParallelMap(self._node, map_func, calls), "map", map_func, calls)

    def interleave(
        self,
        map_func: Callable[..., Dataset],
        cycle_length: int | None = None,
        block_length: int | None = None,
        num_parallel_calls: int | None = None,
        deterministic: bool | None = None,
        name: str | None = None,
    ) -> Dataset:
        """The elements of the datasets ``map_func`` makes from this one's elements,
        interleaved as tf.data's ``interleave``: ``cycle_length`` of them are open at once
        (``None`` or ``AUTOTUNE``: one per usable core, as TF), read ``block_length`` elements
        (default 1) at a time in turn; an exhausted one is replaced by the dataset of the next
        input element. ``num_parallel_calls`` and ``deterministic`` are accepted for porting;
        the datasets are read in this thread, in TF's deterministic order.
        """
        _require_callable("interleave", map_func)
        cycle = AUTOTUNE if cycle_length is None else _integer("cycle_length", cycle_length)
        cycle = usable_cpus() if cycle == AUTOTUNE else cycle
        block = 1 if block_length is None else _integer("block_length", block_length)
        if cycle < 1 or block < 1:
            raise InputError(
                f"interleave needs cycle_length >= 1 (or AUTOTUNE) and block_length >= 1; got "
                f"cycle_length={cycle_length!r}, block_length={block_length!r}"
            )
        node = Interleave(self._node, map_func, cycle, block, _iterator_of)
        return self._made(node, "interleave", map_func, cycle, block)

    def enumerate(self, start: int = 0, name: str | None = None) -> Dataset:
        """``(index, element)`` pairs, ``index`` an int64 scalar counting from ``start``, as in
        TensorFlow. Runs element by element, as ``map`` does."""
        first = _integer("enumerate start", start)
        return self._made(Enumerate(self._node, first), "enumerate", first)

    def filter(self, predicate: Callable[..., Any], name: str | None = None) -> Dataset:
        """The elements for which ``predicate`` (called as ``map_func`` is) returns true.

        The cardinality becomes ``UNKNOWN``, as in TensorFlow.
        """
        _require_callable("filter", predicate)
        return self._made(Filter(self._node, predicate), "filter", predicate)

    def prefetch(self, buffer_size: int | None, name: str | None = None) -> Dataset:
        """The same elements, made up to ``buffer_size`` ahead by a background thread while the
        caller's step runs, as tf.data's ``prefetch``.

        Every stage before it (a slow ``map``, reading batches) runs in that thread, one per
        pass; put ``prefetch`` last. ``sg.data.AUTOTUNE`` keeps two elements ready (TF tunes the
        size as it runs; with one producer and one consumer, two already overlap them).
        ``None`` is AUTOTUNE, as in TF. ``0`` prefetches nothing. An error in the background
        stages is raised by the step's ``next()`` with its original traceback (a failed
        element's, in its place, and the pass goes on); the thread ends with the pass, when the
        iterator is dropped (``break``) and at interpreter exit.
        """
        if buffer_size is None:
            buffer_size = AUTOTUNE  # as TF's prefetch(None)
        size = _integer("prefetch buffer_size", buffer_size)
        if size < AUTOTUNE:
            raise InputError(f"prefetch buffer_size must be >= -1 (AUTOTUNE); got {buffer_size}")
        size = AUTOTUNE_BUFFER if size == AUTOTUNE else size
        description = "prefetch(AUTOTUNE)" if buffer_size == AUTOTUNE else None
        return self._made(
            Prefetch(self._node, size, description=description), "prefetch", buffer_size
        )

    def apply(self, transformation_func: Callable[[Dataset], Dataset]) -> Dataset:
        """``transformation_func(self)``, which must return a ``Dataset``, as in tf.data (for
        ``sg.data.experimental.prefetch_to_device(...)`` and the like)."""
        _require_callable("apply", transformation_func)
        result = transformation_func(self)
        if not isinstance(result, Dataset):
            raise TypeError(
                f"apply: {transformation_func!r} must return an sg.data.Dataset; it returned "
                f"{type(result).__name__}"
            )
        return result

    def cache(self, filename: str = "", name: str | None = None) -> Dataset:
        """Keep the first complete pass in memory and replay it on later passes, as tf.data does.

        The data is already in memory, so for a pipeline without ``map`` this keeps only index
        arrays. What it changes, as in TensorFlow: a ``shuffle`` before ``cache`` is frozen to
        its first order, and ``map`` before it runs once (its results are stacked, so later
        passes are vectorized again). A pass abandoned midway keeps nothing, and an infinite
        upstream is passed through uncached. ``filename`` is accepted for porting; the cache
        stays in memory.
        """
        return self._made(Cache(self._node), "cache")

    def with_options(self, options: Options, name: str | None = None) -> Dataset:
        """This dataset with ``options`` (an ``sg.data.Options``) set; they hold for the whole
        pipeline and merge with options set upstream (later ones win), as in TF."""
        if not isinstance(options, Options):
            raise TypeError(
                f"with_options needs an sg.data.Options; got {options!r} ({type(options).__name__})"
            )
        return self._made(WithOptions(self._node, options), "with_options", options)

    def options(self) -> Options:
        """The options in effect: those set by ``with_options`` anywhere in the pipeline."""
        merged = Options()
        for stage in self._node.stages():
            if isinstance(stage, WithOptions):
                merged = merged.merge(stage.options)
        return merged

    # -- inspection ------------------------------------------------------------------------

    @property
    def element_spec(self) -> Any:
        """The element's structure with an ``sg.data.TensorSpec`` per component (its shape,
        ``None`` where sizes vary, and dtype), as TF's ``element_spec``."""
        return self._node.element_spec()

    def cardinality(self) -> int:
        """The number of elements, ``Dataset.INFINITE`` (-1) or ``Dataset.UNKNOWN`` (-2)."""
        return self._node.cardinality()

    def __len__(self) -> int:
        n = self.cardinality()
        if n == INFINITE:
            raise TypeError("the dataset is infinite (it repeats forever); it has no len()")
        if n == UNKNOWN:
            raise TypeError("the dataset's length is unknown (it is filtered); it has no len()")
        return n

    def __bool__(self) -> bool:
        return True  # not len(): an infinite dataset is no error in ``if dataset:``

    def __iter__(self) -> DatasetIterator:
        # open() runs now, not at the first next(): shuffle seeds are drawn at iter() time.
        return DatasetIterator(self._node)

    def as_numpy_iterator(self) -> Iterator[Any]:
        """The elements with numpy arrays in place of tensors, as in TensorFlow (string
        components are already numpy arrays or Python strings)."""
        for element in self:
            yield _structure.map_leaves(_numpy, element)

    def __repr__(self) -> str:
        stages = " -> ".join(node.describe() for node in self._node.stages())
        return f"<Dataset cardinality={self.cardinality()}: {stages}>"

    # -- for the distribute layer ----------------------------------------------------------

    def reseeded(self, seed: int) -> Dataset:
        """A copy of the whole pipeline in which every unseeded ``shuffle`` gets a seed derived
        from ``(seed, its position in the pipeline)``.

        For the distribute layer: ``experimental_distribute_dataset`` reseeds a user's dataset
        with a seed all workers share, so every worker shuffles identically and slicing a global
        batch gives each one distinct examples. Shuffles with a seed keep it; the copy starts
        with fresh pass counters and an empty cache. The data is shared, not copied.
        """
        base = _integer("reseeded seed", seed)
        return Dataset(fresh_copy(self._node, base))

    def static_batch_size(self) -> int | None:
        """For the distribute layer: the size of the full batches this dataset yields, as TF's
        ``compute_batch_size`` finds it: the ``batch`` stage's ``batch_size``, looking back
        through the stages that keep a batch whole (prefetch, options, cache, filter, repeat,
        shard, shuffle, skip, take). None where another stage (``map``, ``enumerate``...) comes
        after the last ``batch``, or there is none: TF then rebatches each batch by its own
        size (its legacy rebatch)."""
        node: Node | None = self._node
        while node is not None:
            if isinstance(node, Batch):
                return node.batch_size
            if not isinstance(node, _KEEP_BATCH_SIZE):
                return None
            node = node.upstream
        return None

    def recipe(self) -> list[tuple[str, tuple[Any, ...]]] | None:
        """How to make this pipeline again: its source method and each transformation, with the
        arguments they were given (checked and normalized), in order; None where a stage was
        made otherwise than by this class's public methods (``reseeded``,
        ``prefetch_to_device``).

        For the distribute layer: TF2's coordinator sends a dataset to its workers this way
        (``ClusterCoordinator.create_per_worker_dataset(dataset)``), and each worker makes its
        own copy with ``from_recipe``. A ``shuffle`` made without a seed has ``None`` there:
        each copy draws its own.
        """
        steps: list[tuple[str, tuple[Any, ...]]] = []
        dataset: Dataset | None = self
        while dataset is not None:
            if dataset._recipe is None:
                return None
            dataset, method, args = dataset._recipe
            steps.append((method, args))
        steps.reverse()
        return steps

    @staticmethod
    def from_recipe(steps: Any) -> Dataset:
        """The pipeline a ``recipe()`` describes, made anew (for the distribute layer). Only the
        sources and transformations of this class may be named; their own checks apply."""
        if not isinstance(steps, list | tuple) or not steps:
            raise InputError(f"a dataset recipe is a non-empty list of steps; got {steps!r}")
        dataset: Any = Dataset
        for position, step in enumerate(steps):
            if not (
                isinstance(step, list | tuple)
                and len(step) == 2
                and isinstance(step[0], str)
                and isinstance(step[1], list | tuple)
            ):
                raise InputError(
                    f"step {position} of a dataset recipe is not [method, args]: {step!r}"
                )
            method, args = step
            allowed = RECIPE_SOURCES if position == 0 else RECIPE_STEPS
            if method not in allowed:
                raise InputError(
                    f"step {position} of a dataset recipe names {method!r}, which is not one of "
                    f"{sorted(allowed)}"
                )
            dataset = getattr(dataset, method)(*args)
        assert isinstance(dataset, Dataset)
        return dataset

    def position_saveable(self) -> bool:
        """Whether an iterator's position over this pipeline can be saved: no ``from_generator``
        source, which refuses as TF refuses a ``py_function`` source (an ``interleave``'s
        datasets are made as it runs: an iterator's ``state_dict`` says for those)."""
        return not any(isinstance(s, Generated) for s in self._node.stages())

    def has_shard_hints(self) -> bool:
        """Whether the pipeline holds ``shard(SHARD_HINT, SHARD_HINT)`` placeholders."""
        return any(isinstance(s, ShardNode) and s.is_hint for s in self._node.stages())

    def with_shard_hints(self, num_shards: int, index: int) -> Dataset:
        """For the distribute layer (``AutoShardPolicy.HINT``): a copy in which every
        ``shard(SHARD_HINT, SHARD_HINT)`` is ``shard(num_shards, index)``. Other stages are
        copied with their state reset, as ``reseeded`` copies them."""
        node: Node | None = None
        for position, stage in enumerate(self._node.stages()):
            if isinstance(stage, ShardNode) and stage.is_hint:
                assert node is not None
                node = ShardNode(node, num_shards, index)
            else:
                node = stage.rebuilt(node, 0, position)
        assert node is not None
        return Dataset(node)


# TF's kPassThroughOps of compute_batch_size: stages that never change a batch's size.
_KEEP_BATCH_SIZE = (Prefetch, WithOptions, Cache, Filter, Repeat, ShardNode, Shuffle, Skip, Take)


def _iterator_of(dataset: Any) -> DatasetIterator:
    """An interleaved dataset's iterator; TypeError for anything but a Dataset."""
    if not isinstance(dataset, Dataset):
        raise TypeError(type(dataset).__name__)
    return iter(dataset)


def appended(dataset: Dataset, stage: Callable[[Node], Node]) -> Dataset:
    """For this package's transformations outside this module (``prefetch_to_device``):
    ``dataset`` with ``stage(its last node)`` as its new last stage."""
    return Dataset(stage(dataset._node))


def _numpy(value: Any) -> Any:
    return value.numpy(force=True) if isinstance(value, torch.Tensor) else value


def _integer(what: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be an integer; got the bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"{what} must be an integer; got {value!r} ({type(value).__name__})"
        ) from None


def _count(what: str, count: Any) -> int:
    value = _integer(f"{what} count", count)
    if value < -1:
        raise InputError(f"{what} count must be >= 0, or -1 for all; got {count!r}")
    return value


def _require_callable(what: str, fn: Any) -> None:
    if not callable(fn):
        raise TypeError(f"{what} needs a callable; got {fn!r} ({type(fn).__name__})")


def _shapes(template: Any) -> str:
    shaped = _structure.map_structure(lambda _, t: tuple(t.shape), template)
    return repr(shaped)
