"""Distributed datasets: global batches split across replicas, or per-worker pipelines.

``experimental_distribute_dataset(ds)``: ``ds`` yields *global* batches (an ``sg.data.Dataset``,
a DataLoader, or any re-iterable of batches). Every worker iterates the same global batches and
keeps its replicas' slices — TF's auto-sharding by data — so each example is seen exactly once
per epoch. For that, shuffles must agree across workers: unseeded ``sg.data`` shuffles and a
DataLoader's unseeded RandomSampler get a seed broadcast from the chief.

``distribute_datasets_from_function(fn)``: each worker calls ``fn(InputContext)`` once and gets
its own pipeline of *per-replica* batches (sharded by the user, as in the seeds); local replicas
take consecutive batches.

With several workers, every batch is agreed on: "does every worker have one?" (a one-element
all-reduce), so an uneven end of data stops every worker at the same step instead of leaving
one waiting in a collective. The agreement on batch N+1 is started, asynchronously, when batch N
is handed out, so it completes while step N computes instead of delaying every step.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils import _pytree as pytree
from torch.utils.data import DataLoader, RandomSampler
from torch.utils.weak import WeakIdKeyDictionary

from stratagem import data as sg_data
from stratagem.comm.communicator import PendingOp
from stratagem.distribute.machinery.values import PerReplica
from stratagem.errors import InputError

if TYPE_CHECKING:
    from stratagem.distribute.extended import StrategyExtended


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
    return pytree.tree_map(
        lambda x: torch.from_numpy(x) if isinstance(x, np.ndarray) else x, structure
    )


def batch_size_of(structure: Any) -> int:
    """The leading dimension shared by every tensor of a batch."""
    sizes = {
        tuple(t.shape[:1]) for t in pytree.tree_leaves(structure) if isinstance(t, torch.Tensor)
    }
    if not sizes:
        raise InputError(f"a batch holds no tensors: {type(structure).__name__}")
    if len(sizes) != 1 or () in sizes:
        raise InputError(
            f"the tensors of one batch must share their first dimension; got sizes {sorted(sizes)}"
        )
    return next(iter(sizes))[0]


def split_sizes(total: int, parts: int) -> list[int]:
    """As even as possible, the larger parts first (a last partial batch)."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def chunk_sizes(total: int, parts: int) -> list[int]:
    """``torch.chunk``'s cut, which DTensor's ``Shard`` uses: parts of ``ceil(total / parts)``,
    the last ones smaller or empty."""
    size = -(-total // parts)
    return [max(0, min(size, total - i * size)) for i in range(parts)]


def record_global_batch_size(tensor: torch.Tensor, size: int) -> None:
    """Remember that ``tensor`` is part of a global batch of ``size`` examples."""
    _global_batch_sizes[tensor] = size


def _to_device(structure: Any, device: torch.device) -> Any:
    return pytree.tree_map(
        lambda t: (
            t.to(device, non_blocking=True)
            if isinstance(t, torch.Tensor) and t.device != device
            else t
        ),
        structure,
    )


def shared_seed(extended: StrategyExtended) -> int:
    """A seed drawn on the chief and known to every worker (one broadcast)."""
    seed = torch.tensor([random.getrandbits(62)], dtype=torch.int64)
    extended.communicator.broadcast(seed, 0, what="the input shuffle seed")
    return int(seed.item())


class _Distributor:
    """Places each replica's batch on its device and agrees on the end of data."""

    def __init__(self, extended: StrategyExtended, options: InputOptions | None) -> None:
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
        return parts[0] if len(parts) == 1 else PerReplica(parts)


_END = object()  # what a source yields when it has no more batches


class _AgreedIterator:
    """Hands out batches for as long as every worker has one (see the module docstring)."""

    def __init__(self, extended: StrategyExtended, distributor: _Distributor) -> None:
        self._extended = extended
        self._distributor = distributor
        self._comm = extended.communicator
        self._ahead: tuple[Any, torch.Tensor, PendingOp] | None = None
        self._done = False

    def _produce(self) -> Any:
        """This worker's next raw batch, or ``_END``."""
        raise NotImplementedError

    def _deliver(self, raw: Any) -> Any:
        """A raw batch as the replicas of this worker receive it."""
        raise NotImplementedError

    def __iter__(self) -> _AgreedIterator:
        return self

    def _fetch_ahead(self) -> None:
        raw = self._produce()
        missing = torch.tensor([1 if raw is _END else 0], dtype=torch.int32)
        pending = self._comm.all_reduce_async(missing, what="'is there another batch' of the input")
        self._ahead = (raw, missing, pending)

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        if self._comm.world_size == 1:
            raw = self._produce()
        else:
            if self._ahead is None:
                self._fetch_ahead()
            assert self._ahead is not None
            raw, missing, pending = self._ahead
            pending.wait()
            if missing.item():
                raw = _END
            else:
                self._fetch_ahead()  # agreed on while the caller runs its step
        if raw is _END:
            self._done, self._ahead = True, None
            raise StopIteration
        return self._deliver(raw)

    get_next = __next__


class DistributedDataset:
    """Global batches split across all replicas (``strategy.experimental_distribute_dataset``).

    With ``split=False`` every process receives each whole global batch instead (a pipeline's
    stages: the first uses the inputs, the last the targets).
    """

    def __init__(
        self,
        extended: StrategyExtended,
        dataset: Iterable[Any],
        options: InputOptions | None = None,
        *,
        split: bool = True,
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
        if extended.communicator.world_size > 1:
            seed = shared_seed(extended)
            if isinstance(dataset, sg_data.Dataset):
                dataset = dataset.reseeded(seed)
            elif (
                isinstance(dataset, DataLoader)
                and isinstance(dataset.sampler, RandomSampler)
                and dataset.sampler.generator is None
            ):
                dataset.sampler.generator = torch.Generator().manual_seed(seed)
        self._dataset = dataset

    def __iter__(self) -> Iterator[Any]:
        return _SplittingIterator(
            self._extended, iter(self._dataset), self._distributor, self._split
        )


class _SplittingIterator(_AgreedIterator):
    def __init__(
        self,
        extended: StrategyExtended,
        source: Iterator[Any],
        distributor: _Distributor,
        split: bool,
    ) -> None:
        super().__init__(extended, distributor)
        self._source = source
        self._split = split
        self._nominal: int | None = None

    def _produce(self) -> Any:
        batch = next(self._source, _END)
        return batch if batch is _END else _as_tensors(batch)

    def _deliver(self, batch: Any) -> Any:
        if not self._split:
            return self._distributor.deliver([batch], None)
        size = batch_size_of(batch)
        replicas = self._extended.num_replicas_in_sync
        if self._nominal is None:
            self._nominal = size
        if size % replicas and size >= self._nominal:
            raise InputError(
                f"a global batch of {size} examples does not split evenly over {replicas} "
                f"replicas; use a global batch size divisible by {replicas} (only a last, "
                "smaller batch may be uneven)"
            )
        if replicas == 1:  # one replica in all: the global batch is its batch
            return self._distributor.deliver([batch], size)
        sizes = self._extended.split_sizes(size, replicas)
        local = len(self._extended.replica_devices)
        first = self._comm.rank * local
        starts = [sum(sizes[:i]) for i in range(replicas + 1)]
        parts = [
            pytree.tree_map(
                lambda t, a=starts[first + j], b=starts[first + j + 1]: (
                    t[a:b] if isinstance(t, torch.Tensor) else t
                ),
                batch,
            )
            for j in range(local)
        ]
        return self._distributor.deliver(parts, size)


class DistributedDatasetFromFunction:
    """Per-worker pipelines of per-replica batches (``distribute_datasets_from_function``)."""

    def __init__(
        self,
        extended: StrategyExtended,
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
        self._distributor = _Distributor(extended, options)

    def __iter__(self) -> Iterator[Any]:
        return _PerReplicaIterator(self._extended, iter(self._dataset), self._distributor)


class _PerReplicaIterator(_AgreedIterator):
    def __init__(
        self, extended: StrategyExtended, source: Iterator[Any], distributor: _Distributor
    ) -> None:
        super().__init__(extended, distributor)
        self._source = source

    def _produce(self) -> Any:
        # Local replicas take consecutive batches; a worker short of one for any has none.
        parts = [next(self._source, _END) for _ in self._extended.replica_devices]
        return _END if any(p is _END for p in parts) else [_as_tensors(p) for p in parts]

    def _deliver(self, parts: Any) -> Any:
        return self._distributor.deliver(parts, None)
