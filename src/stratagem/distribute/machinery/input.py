"""Distributed datasets: global batches split across replicas, or per-worker pipelines.

``experimental_distribute_dataset(ds)``: ``ds`` yields *global* batches, cut as TensorFlow cuts
them by ``options().experimental_distribute.auto_shard_policy``. DATA (and AUTO, as no
``sg.data`` source reads files): every worker iterates the same batches, each cut into
``num_replicas_in_sync`` parts of ``ceil(n / replicas)``, the last smaller or empty, worker
``w``'s replica ``j`` taking part ``j * num_workers + w``; unseeded shuffles get the chief's
seed. OFF, HINT, and FILE on one worker (on several it raises: no source reads files): each
worker reads its own stream, re-cut into shares of the full batch where known
(``batch_sizes_for_worker``). Between-graph sync workers (``WorkerPart``) each take their part
of a DATA dataset's global batches, of any other the whole. With ``distribute_datasets_from_
function(fn)`` each worker's ``fn(InputContext)`` gives per-replica batches. An element is the
batch's structure with ``PerReplica`` leaves. With several workers every batch is agreed on (an
all-reduce one batch ahead): replicas without data get empty batches while others go on.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils import _pytree as pytree
from torch.utils.data import DataLoader, RandomSampler
from torch.utils.weak import WeakIdKeyDictionary

from stratagem import data as sg_data
from stratagem.comm.communicator import PendingOp
from stratagem.distribute.machinery.per_replica import PerReplica, regroup
from stratagem.errors import InputError

AutoShardPolicy = sg_data.AutoShardPolicy


class ExtendedLike(Protocol):
    """What distributed input reads of ``strategy.extended`` (``distribute/extended.py``'s
    class, above this module, is one)."""

    @property
    def communicator(self) -> Any: ...

    @property
    def num_replicas_in_sync(self) -> int: ...

    @property
    def replica_devices(self) -> tuple[torch.device, ...]: ...

    def split_sizes(self, total: int, parts: int, full: int | None = None) -> list[int]: ...


class InputContext:
    """What a dataset function needs to know to shard its input (``sg.distribute.InputContext``)."""

    def __init__(
        self,
        num_input_pipelines: int = 1,
        input_pipeline_id: int = 0,
        num_replicas_in_sync: int = 1,
    ) -> None:
        if not 0 <= input_pipeline_id < num_input_pipelines:
            raise ValueError(
                f"input_pipeline_id {input_pipeline_id} is outside [0, {num_input_pipelines})"
            )
        self.num_input_pipelines = num_input_pipelines
        self.input_pipeline_id = input_pipeline_id
        self.num_replicas_in_sync = num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The per-replica batch for a global batch; it must divide evenly, as in TF."""
        if global_batch_size % self.num_replicas_in_sync:
            raise InputError(
                f"the global batch size {global_batch_size} is not divisible by the "
                f"{self.num_replicas_in_sync} replicas in sync; use a multiple of "
                f"{self.num_replicas_in_sync}"
            )
        return global_batch_size // self.num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"InputContext(num_input_pipelines={self.num_input_pipelines}, input_pipeline_id="
            f"{self.input_pipeline_id}, num_replicas_in_sync={self.num_replicas_in_sync})"
        )

    def __str__(self) -> str:
        # TF's words, with sg. for tf. (distribute_lib_test.testStr).
        return (
            f"sg.distribute.InputContext(input pipeline id {self.input_pipeline_id}, "
            f"total: {self.num_input_pipelines})"
        )


@dataclass(frozen=True)
class WorkerPart:
    """Between-graph synchronous training (a sync parameter-server job: each worker its own
    process, without collectives, one step of the job per update): this worker is ``index`` of
    ``workers``. A dataset whose ``auto_shard_policy`` is DATA is read whole by every worker,
    its unseeded shuffles seeded with ``seed`` (the job's), and each global batch is cut as
    ``split_sizes`` cuts it, this worker taking part ``index``: the workers of one step consume
    one global batch, and the position of the stream is the job's."""

    index: int
    workers: int
    seed: int


@dataclass(frozen=True)
class InputOptions:
    """``sg.distribute.InputOptions``: ``experimental_fetch_to_device=False`` leaves batches
    where the dataset produced them instead of moving each replica's part to its device."""

    experimental_fetch_to_device: bool = True


# Input tensors handed to a replica → the size of the global batch they came from, so that
# ``compute_average_loss`` divides a last partial batch by its true size.
_global_batch_sizes: WeakIdKeyDictionary = WeakIdKeyDictionary()


def recorded_global_batch_size(structure: Any) -> int | None:
    for leaf in pytree.tree_leaves(structure, is_leaf=lambda x: isinstance(x, PerReplica)):
        if isinstance(leaf, PerReplica):
            leaf = leaf.values[0]
        for t in pytree.tree_leaves(leaf):
            if isinstance(t, torch.Tensor):
                size = _global_batch_sizes.get(t)
                if size is not None:
                    return size
    return None


def _as_tensors(structure: Any) -> Any:
    # Numeric arrays become tensors; string arrays stay numpy (torch has no string tensors).
    return pytree.tree_map(lambda x: torch.from_numpy(x) if _is_numeric_array(x) else x, structure)


def _is_numeric_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) and x.dtype.kind in "biufc"


def _is_component(x: Any) -> bool:
    return isinstance(x, torch.Tensor | np.ndarray)


def batch_size_of(structure: Any) -> int:
    """The leading dimension shared by every tensor (and string array) of a batch."""
    sizes = {tuple(t.shape[:1]) for t in pytree.tree_leaves(structure) if _is_component(t)}
    if not sizes:
        raise InputError(f"a batch holds no tensors: {type(structure).__name__}")
    if len(sizes) != 1 or () in sizes:
        raise InputError(
            f"the tensors of one batch must share their first dimension; got sizes {sorted(sizes)}"
        )
    return next(iter(sizes))[0]


def split_sizes(total: int, parts: int, full: int | None = None) -> list[int]:
    """TF's cut of one shared global batch (AUTO/DATA, its legacy rebatch): ``parts`` parts of
    ``ceil(total / parts)``, the last ones smaller or empty, whatever the batch's place in the
    dataset (``full`` is accepted for the strategies' hook and unused):
    ``split_sizes(4, 3) == [2, 2, 0]``, ``split_sizes(2, 2) == [1, 1]``.
    """
    return chunk_sizes(total, parts)


def even_sizes(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` as even as possible, the larger parts first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def batch_sizes_for_worker(
    global_batch_size: int, num_workers: int, replicas_per_worker: int, worker_index: int
) -> list[int]:
    """TF's ``batch_sizes_for_worker``: the sizes worker ``worker_index`` rebatches its own
    stream into (OFF/HINT), one per replica of the job: ``global_batch_size`` as even as
    possible, the larger first, rotated by the worker's first replica so that the replicas of
    one step, across all workers, add up to ``global_batch_size`` (G=7, 2 workers of 2
    replicas: worker 0 ``[2, 2, 2, 1]``, worker 1 ``[2, 1, 2, 2]``)."""
    worker_0 = even_sizes(global_batch_size, num_workers * replicas_per_worker)
    offset = worker_index * replicas_per_worker
    return worker_0[offset:] + worker_0[:offset]


def cut(batch: Any, sizes: list[int]) -> list[Any]:
    """``batch`` cut along its first dimension into consecutive parts of ``sizes``."""
    starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return [
        pytree.tree_map(
            lambda t, a=starts[i], b=starts[i + 1]: t[a:b] if _is_component(t) else t, batch
        )
        for i in range(len(sizes))
    ]


def chunk_sizes(total: int, parts: int) -> list[int]:
    """``torch.chunk``'s cut, which DTensor's ``Shard`` and TF's legacy rebatch use: parts of
    ``ceil(total / parts)``, the last ones smaller or empty."""
    size = -(-total // parts)
    return [max(0, min(size, total - i * size)) for i in range(parts)]


def record_global_batch_size(tensor: torch.Tensor, size: int) -> None:
    """Remember that ``tensor`` is part of a global batch of ``size`` examples."""
    _global_batch_sizes[tensor] = size


def _to_device(structure: Any, device: torch.device) -> Any:
    # Non-blocking only towards a CUDA device, where the step that reads the batch runs on the
    # same stream after the copy; a non-blocking copy to the CPU could be read before it lands.
    non_blocking = device.type == "cuda"
    return pytree.tree_map(
        lambda t: (
            t.to(device, non_blocking=non_blocking)
            if isinstance(t, torch.Tensor) and t.device != device
            else t
        ),
        structure,
    )


def shared_seed(extended: ExtendedLike) -> int:
    """A seed drawn on the chief and known to every worker (one broadcast)."""
    seed = torch.tensor([random.getrandbits(62)], dtype=torch.int64)
    extended.communicator.broadcast(seed, 0, what="the input shuffle seed")
    return int(seed.item())


class _Distributor:
    """Places each replica's batch on its device and agrees on the end of data."""

    def __init__(self, extended: ExtendedLike, options: InputOptions | None) -> None:
        self.devices = extended.replica_devices
        self.fetch = options.experimental_fetch_to_device if options else True

    def deliver(self, parts: list[Any], global_size: int | None) -> Any:
        if self.fetch:
            parts = [_to_device(p, d) for p, d in zip(parts, self.devices)]
        if global_size is not None:
            for p in parts:
                for t in pytree.tree_leaves(p):
                    if isinstance(t, torch.Tensor):
                        record_global_batch_size(t, global_size)
                        break
        # As TF: the batch's structure with PerReplica leaves, so `x, y = element` unpacks.
        return regroup(parts)


_END = object()  # what a source yields when it has no more batches


class _AgreedIterator:
    """Hands out batches for as long as every worker has one (see the module docstring)."""

    def __init__(self, extended: ExtendedLike, distributor: _Distributor) -> None:
        self._extended = extended
        self._distributor = distributor
        self._comm = extended.communicator
        self._ahead: tuple[Any, torch.Tensor, PendingOp] | None = None
        self._done = False
        self._restored: list[Any] = []  # a restored iterator's batch read ahead, handed out first
        self._gathered: list[Any] | None = None  # every worker's position (prepare_checkpoint)

    def _produce(self) -> Any:
        """This worker's next raw batch, or ``_END``."""
        raise NotImplementedError

    def _next_raw(self) -> Any:
        """The batch a restored iterator had read ahead, then ``_produce``'s."""
        return self._restored.pop() if self._restored else self._produce()

    def _deliver(self, raw: Any, examples: int | None) -> Any:
        """A raw batch as the replicas of this worker receive it; ``examples``: the step's
        examples over all workers, as ``_examples`` counted them."""
        raise NotImplementedError

    def __iter__(self) -> _AgreedIterator:
        return self

    def _stand_in(self) -> Any:
        """What this worker's replicas get once its data ended while another worker's goes
        on; ``_END`` where it cannot go on (global batches end for everyone at once)."""
        return _END

    def _examples(self, raw: Any) -> int:
        """How many examples this worker's replicas get from ``raw`` (summed over the workers
        with the agreement, for a step whose global size no worker knows alone)."""
        return 0

    def _fetch_ahead(self) -> None:
        raw = self._next_raw()
        if raw is _END:
            raw = self._stand_in()  # empty batches: no examples
            # [no batch of its own, cannot go on, examples of this step]
            counts = torch.tensor([1, 1 if raw is _END else 0, 0], dtype=torch.int32)
        else:
            counts = torch.tensor([0, 0, self._examples(raw)], dtype=torch.int32)
        pending = self._comm.all_reduce_async(counts, what="'is there another batch' of the input")
        self._ahead = (raw, counts, pending)

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        if self._comm.world_size == 1:
            raw = self._next_raw()
            examples = None if raw is _END else self._examples(raw)
        else:
            if self._ahead is None:
                self._fetch_ahead()
            assert self._ahead is not None
            raw, counts, pending = self._ahead
            pending.wait()
            without, stuck, examples = (int(c) for c in counts)
            if stuck or without == self._comm.world_size:
                raw = _END  # some worker cannot go on, or none has data left
            else:
                self._fetch_ahead()  # agreed on while the caller runs its step
        if raw is _END:
            self._done, self._ahead = True, None
            raise StopIteration
        return self._deliver(raw, examples)

    def get_next(self) -> Any:
        """The next distributed element; ``StopIteration`` at the end (TF: OutOfRangeError)."""
        return next(self)

    def get_next_as_optional(self) -> sg_data.experimental.Optional:
        """The next element as an ``Optional``, empty at the end, as TF's distributed iterator
        gives it (every worker agrees on whether there is one)."""
        try:
            return sg_data.experimental.Optional.from_value(next(self))
        except StopIteration:
            return sg_data.experimental.Optional.empty(lambda: self.element_spec)

    @property
    def element_spec(self) -> Any:
        return self._element_spec()

    def _element_spec(self) -> Any:
        raise NotImplementedError

    # -- checkpoints (``sg.train.Checkpoint(iterator=it)``) --------------------------------
    #
    # Where every worker reads one shared global stream, the chief's position is the job's and
    # restores on any number of workers. Where each worker reads its own, every worker's
    # position is gathered to the chief first (``prepare_checkpoint``, collective, called by
    # the checkpoint on every process) and each worker restores its own: same number only.

    def _stateful_source(self) -> Any:
        """The iterator of batches whose position is this iterator's (``InputError`` where it
        cannot be saved)."""
        raise NotImplementedError

    def _shared_stream(self) -> bool:
        """Whether every worker reads the same global batches (its position is the job's)."""
        return False

    def _worker_state(self) -> dict[str, Any]:
        ahead = self._restored[0] if self._restored else None
        if self._ahead is not None and self._ahead[0] is not _END:
            ahead = self._ahead[0]
        return {
            "source": _source_state(self._stateful_source()),
            "ahead": ahead,
            "done": self._done,
            **self._own_state(),
        }

    def _own_state(self) -> dict[str, Any]:
        return {}

    def _check_own_state(self, state: dict[str, Any]) -> None:
        """Refuse a state that is not this iterator's (before anything changes)."""

    def _load_own_state(self, state: dict[str, Any]) -> None:
        pass

    def prepare_checkpoint(self) -> None:
        """On every process, before a save: gather each worker's position to every process
        (a collective) where the workers read streams of their own."""
        if self._shared_stream() or self._comm.world_size == 1:
            return
        self._gathered = self._comm.all_gather_object(
            self._worker_state(), what="the input iterators' positions for a checkpoint"
        )

    def state_dict(self) -> dict[str, Any]:
        """Where this iterator stands: its source's position and the batch it read ahead;
        one state for the job where the workers share one stream, else every worker's."""
        if self._shared_stream():
            return {"format": DISTRIBUTED_STATE_FORMAT, **self._worker_state()}
        if self._comm.world_size == 1:
            workers = [self._worker_state()]
        else:
            workers = self._gathered
            if workers is None:
                raise InputError(
                    "the workers of this distributed iterator read their own streams: saving "
                    "its position gathers every worker's, so save it through "
                    "sg.train.Checkpoint (which calls prepare_checkpoint on every worker)"
                )
            self._gathered = None
        return {"format": DISTRIBUTED_STATE_FORMAT, "per_worker": workers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on where the iterator that saved ``state`` stood: on any number of workers for
        a shared stream; on as many as saved it for streams of their own."""
        if not isinstance(state, dict) or state.get("format") != DISTRIBUTED_STATE_FORMAT:
            raise InputError(f"not a saved {DISTRIBUTED_STATE_FORMAT} state: {str(state)[:200]}")
        if "per_worker" in state:
            workers = state["per_worker"]
            if self._shared_stream() or len(workers) != self._comm.world_size:
                raise InputError(
                    f"the saved input position is {len(workers)} worker(s)' own streams; this "
                    f"job has {self._comm.world_size} worker(s) "
                    f"{'sharing one stream' if self._shared_stream() else 'reading their own'}:"
                    " a position per worker restores only on as many workers reading their own"
                )
            state = workers[self._comm.rank]
        elif not self._shared_stream():
            raise InputError(
                "the saved input position is one shared global stream's; this iterator's "
                "workers read their own streams"
            )
        self._check_own_state(state)
        source = self._stateful_source()
        if self._ahead is not None:
            # The 'is there another batch' agreement under way: every worker waits for it, so
            # the collectives stay in step, and its batch is dropped for the restored one.
            self._ahead[2].wait()
            self._ahead = None
        source.load_state_dict(state["source"])
        self._restored = [] if state["ahead"] is None else [state["ahead"]]
        self._done = bool(state["done"])
        self._load_own_state(state)


def _source_state(source: Any) -> Any:
    if not (
        callable(getattr(source, "state_dict", None))
        and callable(getattr(source, "load_state_dict", None))
    ):
        raise InputError(
            f"cannot checkpoint the position of a distributed iterator over a "
            f"{type(source).__name__}: it has no state_dict()/load_state_dict(); an "
            "sg.data.Dataset's iterator has (so has torchdata's StatefulDataLoader)"
        )
    return source.state_dict()


DISTRIBUTED_STATE_FORMAT = "stratagem distributed iterator"


class DistributedDataset:
    """Global batches split across all replicas (``strategy.experimental_distribute_dataset``).

    With ``split=False`` every process receives each whole global batch instead (a pipeline's
    stages: the first uses the inputs, the last the targets).
    """

    def __init__(
        self,
        extended: ExtendedLike,
        dataset: Iterable[Any],
        options: InputOptions | None = None,
        *,
        split: bool = True,
        worker_part: WorkerPart | None = None,
    ) -> None:
        if not isinstance(dataset, Iterable):
            raise InputError(
                f"experimental_distribute_dataset needs an iterable of global batches (an "
                f"sg.data.Dataset, a DataLoader, a list...), got {type(dataset).__name__}"
            )
        if isinstance(dataset, Iterator):
            raise InputError(
                "experimental_distribute_dataset needs a re-iterable dataset (each iter() a new "
                f"pass), got a one-shot iterator {type(dataset).__name__}; pass the dataset "
                "itself, or a list"
            )
        self._extended = extended
        self._split = split
        self._distributor = _Distributor(extended, options)
        comm = extended.communicator
        self._policy = _policy(dataset)
        # OFF and HINT (and FILE on one worker, where TF shards nothing): each worker reads
        # its own stream, rebatched by TF's rebatch; AUTO and DATA: shared global batches.
        self._own_stream = split and (
            self._policy in (AutoShardPolicy.OFF, AutoShardPolicy.HINT)
            or (self._policy is AutoShardPolicy.FILE and comm.world_size == 1)
        )
        self._full_batch = _full_batch_size(dataset)
        # Between-graph sync: only an explicit DATA cuts (AUTO keeps TF's whole batch per worker).
        self._part = worker_part if split and self._policy is AutoShardPolicy.DATA else None
        if split and comm.world_size > 1 and self._policy is AutoShardPolicy.FILE:
            raise InputError(
                "auto_shard_policy is AutoShardPolicy.FILE, which shards a dataset by the files "
                "it reads, but no sg.data source reads files (the data is in memory); use "
                "AutoShardPolicy.DATA (or AUTO, which falls back to it), or OFF, or shard "
                f"yourself with HINT; dataset: {dataset!r}"
            )
        if isinstance(dataset, sg_data.Dataset) and dataset.has_shard_hints():
            if self._policy is not AutoShardPolicy.HINT:
                raise InputError(
                    "the dataset holds shard(SHARD_HINT, SHARD_HINT), which only "
                    "AutoShardPolicy.HINT fills in; its auto_shard_policy is "
                    f"{self._policy.name}; dataset: {dataset!r}"
                )
            dataset = dataset.with_shard_hints(comm.world_size, comm.rank)
        if self._part is not None or (
            comm.world_size > 1 and self._policy is not AutoShardPolicy.OFF
        ):
            seed = self._part.seed if self._part is not None else shared_seed(extended)
            if isinstance(dataset, sg_data.Dataset):
                dataset = dataset.reseeded(seed)
            elif (
                isinstance(dataset, DataLoader)
                and isinstance(dataset.sampler, RandomSampler)
                and dataset.sampler.generator is None
            ):
                dataset.sampler.generator = torch.Generator().manual_seed(seed)
        self._dataset = dataset

    @property
    def reads_one_stream(self) -> bool:
        """Whether every worker reads the same global batches (AUTO, DATA): then its
        iterators' position is the job's and restores on any number of workers."""
        return not self._own_stream

    @property
    def auto_shard_policy(self) -> sg_data.AutoShardPolicy:
        """The policy in effect across workers (the dataset's option; AUTO for non-sg.data)."""
        return self._policy

    def __iter__(self) -> _SplittingIterator:
        source = iter(self._dataset)
        if self._own_stream:
            return _OwnStreamIterator(
                self._extended,
                _Rebatched(self._extended, source, self._full_batch),
                self._distributor,
                lambda: self.element_spec,
            )
        return _SplittingIterator(
            self._extended,
            source,
            self._distributor,
            self._split,
            lambda: self.element_spec,
            self._part,
        )

    @property
    def element_spec(self) -> Any:
        """The spec of one element: each component's ``TensorSpec`` with a ``None`` batch
        dimension, in a ``PerReplica`` (one per local replica) where there are several, as
        TF's ``DistributedDataset.element_spec``. Needs an ``sg.data.Dataset``."""
        if not isinstance(self._dataset, sg_data.Dataset):
            raise TypeError(
                "element_spec needs the distributed dataset to be an sg.data.Dataset; this one "
                f"distributes a {type(self._dataset).__name__}"
            )
        spec = self._dataset.element_spec
        if self._split:
            spec = pytree.tree_map(_varying_leading, spec)
        return _per_replica_spec(spec, len(self._extended.replica_devices))

    def __repr__(self) -> str:
        return f"<DistributedDataset of {self._dataset!r}>"


def _policy(dataset: Any) -> sg_data.AutoShardPolicy:
    if isinstance(dataset, sg_data.Dataset):
        return sg_data.AutoShardPolicy(dataset.options().experimental_distribute.auto_shard_policy)
    return AutoShardPolicy.AUTO


def _varying_leading(spec: sg_data.TensorSpec) -> sg_data.TensorSpec:
    if spec.shape:
        return spec.inner().with_leading(None)
    return spec


def _per_replica_spec(spec: Any, local: int) -> Any:
    if local == 1:
        return spec
    return pytree.tree_map(lambda s: PerReplica([s] * local), spec)


def _full_batch_size(dataset: Any) -> int | None:
    """The dataset's full batch size where it is known (TF's ``compute_batch_size``): an
    ``sg.data.Dataset``'s last ``batch``; else None. (Only an ``sg.data.Dataset`` has a
    policy other than AUTO, so only it reads its own stream.)"""
    if isinstance(dataset, sg_data.Dataset):
        return dataset.static_batch_size()
    return None


def joined(batches: list[Any]) -> Any:
    """Batches of one structure concatenated along their first dimension."""
    if len(batches) == 1:
        return batches[0]
    flats = [pytree.tree_flatten(b) for b in batches]
    spec = flats[0][1]
    leaves = []
    for parts in zip(*(leaves for leaves, _ in flats)):
        first = parts[0]
        if isinstance(first, torch.Tensor):
            leaves.append(torch.cat(parts))
        elif isinstance(first, np.ndarray):
            leaves.append(np.concatenate(parts))
        else:
            leaves.append(first)
    return pytree.tree_unflatten(leaves, spec)


class _Rebatched:
    """A worker's own stream of global batches as TF's rebatch hands out replica batches.

    With the full batch size known, ``rebatch(batch_sizes_for_worker(full, ...))``: the
    examples re-cut, across the input's batch boundaries, into batches of those sizes in
    turn, the last one smaller (``range(12).batch(8)`` for 2 replicas: ``[0..3]``, ``[4..7]``,
    ``[8..11]``). Without, TF's legacy rebatch: each batch cut into ``num_replicas_in_sync``
    parts as ``split_sizes`` cuts a shared one, empty parts included. Its state (for a
    checkpoint) is the source's and the rows read and not handed out.
    """

    def __init__(self, extended: ExtendedLike, source: Iterator[Any], full: int | None) -> None:
        self.source = source
        self._extended = extended
        self._full = full
        self._pending: list[Any] = []  # rows read and not handed out, as batch pieces
        self._turn = 0
        self._exhausted = False
        if full is not None:
            local = len(extended.replica_devices)
            workers = extended.num_replicas_in_sync // local
            self._sizes = batch_sizes_for_worker(full, workers, local, extended.communicator.rank)

    def __iter__(self) -> _Rebatched:
        return self

    def state(self) -> dict[str, Any]:
        return {"pending": list(self._pending), "turn": self._turn, "exhausted": self._exhausted}

    def load_state(self, state: dict[str, Any]) -> None:
        self._pending, self._turn = list(state["pending"]), int(state["turn"])
        self._exhausted = bool(state["exhausted"])

    def __next__(self) -> Any:
        if self._full is None:
            while not self._pending:
                batch = next(self.source)  # StopIteration ends the stream
                batch = _as_tensors(batch)
                replicas = self._extended.num_replicas_in_sync
                self._pending = cut(
                    batch, self._extended.split_sizes(batch_size_of(batch), replicas)
                )
            return self._pending.pop(0)
        want = self._sizes[self._turn % len(self._sizes)]
        rows = sum(batch_size_of(p) for p in self._pending)
        # Read until this batch is whole, or one row is there to tell a 0-sized batch in the
        # middle (TF hands those out) from the end of the data.
        while not self._exhausted and rows < max(want, 1):
            batch = next(self.source, _END)
            if batch is _END:
                self._exhausted = True
                break
            batch = _as_tensors(batch)
            size = batch_size_of(batch)
            if size:
                self._pending.append(batch)
                rows += size
        if not rows:
            raise StopIteration
        merged = joined(self._pending)
        take = min(want, rows)
        head, rest = cut(merged, [take, rows - take])
        self._pending = [rest] if rows > take else []
        self._turn += 1
        return head


class _SplittingIterator(_AgreedIterator):
    """Shared global batches (AUTO/DATA), each cut as ``split_sizes`` cuts it; worker ``w``'s
    local replica ``j`` gets part ``j * num_workers + w`` (TF's data shard of the parts)."""

    def __init__(
        self,
        extended: ExtendedLike,
        source: Iterator[Any],
        distributor: _Distributor,
        split: bool,
        element_spec: Callable[[], Any],
        part: WorkerPart | None = None,
    ) -> None:
        super().__init__(extended, distributor)
        self._source = source
        self._split = split
        self._spec = element_spec
        self._part = part

    def _element_spec(self) -> Any:
        return self._spec()

    def _produce(self) -> Any:
        batch = next(self._source, _END)
        return batch if batch is _END else _as_tensors(batch)

    def _stateful_source(self) -> Any:
        return self._source

    def _shared_stream(self) -> bool:
        return True

    def _deliver(self, batch: Any, examples: int | None) -> Any:
        if not self._split:
            return self._distributor.deliver([batch], None)
        replicas = self._extended.num_replicas_in_sync
        size = batch_size_of(batch)
        if self._part is not None:
            # This worker's part; its loss is its part's mean (the ps averages the workers').
            part = cut(batch, self._extended.split_sizes(size, self._part.workers))
            mine = part[self._part.index]
            return self._distributor.deliver([mine], batch_size_of(mine))
        if replicas == 1:  # one replica in all: the global batch is its batch
            return self._distributor.deliver([batch], size)
        parts = cut(batch, self._extended.split_sizes(size, replicas))
        workers, worker = self._comm.world_size, self._comm.rank
        local = len(self._extended.replica_devices)
        return self._distributor.deliver([parts[j * workers + worker] for j in range(local)], size)


class _OwnStreamIterator(_AgreedIterator):
    """A worker's own rebatched stream (OFF/HINT): its local replicas take consecutive
    batches; where the stream ends within a step, or has ended while another worker's goes on,
    replicas get empty batches shaped like the last one (TF's dummy batches)."""

    def __init__(
        self,
        extended: ExtendedLike,
        parts: _Rebatched,
        distributor: _Distributor,
        element_spec: Callable[[], Any],
    ) -> None:
        super().__init__(extended, distributor)
        self._parts = parts
        self._spec = element_spec
        self._empty: Any = None

    def _element_spec(self) -> Any:
        return self._spec()

    def _stateful_source(self) -> Any:
        return self._parts.source

    def _own_state(self) -> dict[str, Any]:
        return {"rebatch": self._parts.state(), "empty": self._empty}

    def _load_own_state(self, state: dict[str, Any]) -> None:
        self._parts.load_state(state["rebatch"])
        self._empty = state["empty"]

    def _produce(self) -> Any:
        local = len(self._extended.replica_devices)
        taken = []
        for _ in range(local):
            part = next(self._parts, _END)
            if part is _END:
                break
            taken.append(part)
        if not taken:
            return _END
        self._empty = cut(taken[-1], [0])[0]
        return taken + [self._empty] * (local - len(taken))

    def _stand_in(self) -> Any:
        if self._empty is None:
            return _END  # never had a batch: nothing to shape an empty one on
        return [self._empty] * len(self._extended.replica_devices)

    def _examples(self, parts: Any) -> int:
        return sum(batch_size_of(part) for part in parts)

    def _deliver(self, parts: Any, examples: int | None) -> Any:
        # The step's examples over all workers: the global batch that compute_average_loss
        # divides by when it is not told one.
        return self._distributor.deliver(parts, examples)


class DistributedDatasetFromFunction:
    """Per-worker pipelines of per-replica batches (``distribute_datasets_from_function``)."""

    def __init__(
        self,
        extended: ExtendedLike,
        dataset_fn: Callable[[InputContext], Iterable[Any]],
        ctx: InputContext,
        options: InputOptions | None = None,
    ) -> None:
        comm = extended.communicator
        seed = shared_seed(extended) if comm.world_size > 1 else None
        if seed is None:
            dataset = dataset_fn(ctx)
        else:
            # Unseeded shuffles agree across workers, so shuffle-then-shard gives disjoint shards.
            with sg_data.seed_scope(seed):
                dataset = dataset_fn(ctx)
        if not isinstance(dataset, Iterable) or isinstance(dataset, Iterator):
            raise InputError(
                "the dataset function must return a re-iterable of per-replica batches (an "
                f"sg.data.Dataset, a DataLoader, a list...), got {type(dataset).__name__}"
            )
        self._extended = extended
        self._dataset = dataset
        self._ctx = ctx
        self._distributor = _Distributor(extended, options)

    def __iter__(self) -> _PerReplicaIterator:
        return _PerReplicaIterator(
            self._extended,
            iter(self._dataset),
            self._distributor,
            lambda: self.element_spec,
            (self._ctx.input_pipeline_id, self._ctx.num_input_pipelines),
        )

    @property
    def element_spec(self) -> Any:
        """The per-replica batches' spec (in a ``PerReplica`` where there are several local
        replicas), as TF's ``DistributedDataset.element_spec``. Needs an ``sg.data.Dataset``."""
        if not isinstance(self._dataset, sg_data.Dataset):
            raise TypeError(
                "element_spec needs the dataset function to return an sg.data.Dataset; it "
                f"returned a {type(self._dataset).__name__}"
            )
        spec = self._dataset.element_spec
        return _per_replica_spec(spec, len(self._extended.replica_devices))


class _PerReplicaIterator(_AgreedIterator):
    def __init__(
        self,
        extended: ExtendedLike,
        source: Iterator[Any],
        distributor: _Distributor,
        element_spec: Callable[[], Any],
        pipeline: tuple[int, int],
    ) -> None:
        super().__init__(extended, distributor)
        self._source = source
        self._spec = element_spec
        self._empty: Any = None  # an empty replica batch shaped like the last one
        self._pipeline = pipeline  # (input_pipeline_id, num_input_pipelines)

    def _element_spec(self) -> Any:
        return self._spec()

    def _stateful_source(self) -> Any:
        return self._source

    def _own_state(self) -> dict[str, Any]:
        return {"empty": self._empty, "pipeline": list(self._pipeline)}

    def _check_own_state(self, state: dict[str, Any]) -> None:
        # A parameter server's chief saves alone: its position is input pipeline 0's, which no
        # other worker's pipeline may take for its own.
        saved = tuple(state.get("pipeline", ()))
        if saved != self._pipeline:
            raise InputError(
                f"the saved input position is input pipeline {saved[0]} of {saved[1]}'s; this "
                f"iterator reads pipeline {self._pipeline[0]} of {self._pipeline[1]}: a "
                "pipeline's position restores only into the same pipeline of a job of as many"
                if len(saved) == 2
                else f"the saved input position names no input pipeline: {saved!r}"
            )

    def _load_own_state(self, state: dict[str, Any]) -> None:
        self._empty = state["empty"]

    def _produce(self) -> Any:
        # Local replicas take consecutive batches. At the end of the data, replicas left
        # without one get an empty batch shaped like the others' (TF's dummy batches).
        parts = []
        for _ in self._extended.replica_devices:
            part = next(self._source, _END)
            if part is _END:
                break
            parts.append(_as_tensors(part))
        if not parts:
            return _END
        empty = cut(parts[0], [0])[0]
        self._empty = empty
        return parts + [empty] * (len(self._extended.replica_devices) - len(parts))

    def _stand_in(self) -> Any:
        # Another worker still has data (TF goes on): empty batches shaped like our last one.
        if self._empty is None:
            return _END  # never had a batch: nothing to shape an empty one on
        return [self._empty] * len(self._extended.replica_devices)

    def _deliver(self, parts: Any, examples: int | None) -> Any:
        return self._distributor.deliver(parts, None)


class PerWorkerDistributedDataset:
    """``strategy.experimental_distribute_dataset(dataset)`` on a coordinator (the chief of a
    cluster with a chief, TF2's ``ParameterServerStrategy``): not built here, as TF's
    ``DistributedDataset`` made outside a function is not; ``create_per_worker_dataset`` builds
    it on every worker (each ``strategy.experimental_distribute_dataset`` of its own copy of
    ``dataset``). The chief computes on no worker's data: ``iter()`` here is a ``ValueError``,
    as in TF."""

    def __init__(self, dataset: Iterable[Any], options: InputOptions | None) -> None:
        self.dataset = dataset
        self.options = options

    def __iter__(self) -> Iterator[Any]:
        raise ValueError(
            "To use this dataset, you need to pass this dataset to "
            "ClusterCoordinator.create_per_worker_dataset. (iter() of a distributed dataset on "
            "the coordinator, the chief: it is built on every worker, not here; got "
            f"{self!r})"
        )

    def __repr__(self) -> str:
        return f"<DistributedDataset, not built on the coordinator, of {self.dataset!r}>"


class PerWorkerDistributedDatasetsFromFunction:
    """``strategy.distribute_datasets_from_function(dataset_fn)`` on a coordinator: not built
    here (``dataset_fn`` is not called on the chief); ``create_per_worker_dataset`` builds it on
    every worker, with that worker's input context. ``iter()`` here is a ``ValueError``, as in
    TF."""

    def __init__(
        self, dataset_fn: Callable[[InputContext], Iterable[Any]], options: InputOptions | None
    ) -> None:
        self.dataset_fn = dataset_fn
        self.options = options

    def __iter__(self) -> Iterator[Any]:
        raise ValueError(
            "You need to use this dataset in ClusterCoordinator.create_per_worker_dataset. "
            "(iter() of distribute_datasets_from_function's dataset on the coordinator, the "
            f"chief: {self.dataset_fn!r} runs on every worker, not here)"
        )

    def __repr__(self) -> str:
        fn = self.dataset_fn
        return f"<DistributedDatasetsFromFunction, not built on the coordinator, of {fn!r}>"
