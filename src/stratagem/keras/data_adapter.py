"""What ``fit``/``evaluate``/``predict`` accept, turned into an iterable of global batches.

- arrays or tensors ``x`` (and ``y``) with ``batch_size`` (the *global* batch, default 32): an
  ``sg.data.Dataset``, shuffled each epoch when asked (the distribute layer gives every worker
  the same shuffle, so slicing the global batch shards the data exactly once per epoch); a
  dict of arrays (``{"input_ids": ..., "attention_mask": ...}``, as Keras takes a model's named
  inputs) is batched and split across replicas key by key, each batch a dict;
- an ``sg.data.Dataset``, a DataLoader or any re-iterable of batches ``(x, y)`` or
  ``(x, y, sample_weight)``: used as is, each batch being a global batch.

``FitData`` is fit's side of it: the training batches by position (pass over the data, batch
within the pass), so that a backup taken mid-epoch resumes exactly where it was.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from stratagem import data as sg_data

if TYPE_CHECKING:
    from stratagem.distribute import Strategy

DEFAULT_BATCH_SIZE = 32


def _as_tensor(value: Any, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        if np.issubdtype(value.dtype, np.floating):
            # Keras converts floating NumPy arrays to floatx (float32): `np.ones((100, 1))`
            # feeds a float32 model (data_adapter._process_tensorlike).
            return torch.from_numpy(value).to(torch.float32)
        return torch.from_numpy(value)
    raise TypeError(f"{name} must be an array or a tensor here, got {type(value).__name__}")


def _check_batch_size(batch_size: Any) -> int:
    if batch_size is not None and (
        isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
    ):
        raise ValueError(f"batch_size must be a positive integer; got {batch_size!r}")
    return batch_size or DEFAULT_BATCH_SIZE


def _is_arrays(x: Any) -> bool:
    return isinstance(x, torch.Tensor | np.ndarray) or _is_dict_of_arrays(x)


def is_array_data(x: Any) -> bool:
    """Whether ``x`` is examples that fit batches itself (arrays, tensors, or a dict of them),
    rather than a dataset of batches."""
    return _is_arrays(x)


def _is_dict_of_arrays(x: Any) -> bool:
    return (
        isinstance(x, Mapping)
        and bool(x)
        and all(isinstance(v, torch.Tensor | np.ndarray) for v in x.values())
    )


def _as_tensors(value: Any, name: str) -> torch.Tensor | dict[str, torch.Tensor]:
    """An array as a tensor, or a dict of arrays as a dict of tensors (the same keys)."""
    if isinstance(value, Mapping):
        if not _is_dict_of_arrays(value):
            kinds = {str(k): type(v).__name__ for k, v in value.items()}
            raise TypeError(f"{name} as a dict must map names to arrays or tensors; got {kinds}")
        return {str(k): _as_tensor(v, f"{name}[{k!r}]") for k, v in value.items()}
    return _as_tensor(value, name)


def _count(values: torch.Tensor | dict[str, torch.Tensor], name: str) -> int:
    """How many examples ``values`` hold: its length, the same for every key of a dict."""
    if isinstance(values, torch.Tensor):
        return len(values)
    lengths = {key: len(v) for key, v in values.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(
            f"the arrays of {name} hold different numbers of examples: {lengths}; each key "
            "needs one row per example"
        )
    return next(iter(lengths.values()))


def _examples(x: Any, y: Any) -> tuple[sg_data.Dataset, int]:
    """Arrays ``x`` (and ``y``) as a dataset of examples, and how many there are."""
    xs = _as_tensors(x, "x")
    n = _count(xs, "x")
    if y is None:
        return sg_data.Dataset.from_tensor_slices(xs), n
    ys = _as_tensors(y, "y")
    if _count(ys, "y") != n:
        raise ValueError(f"x and y hold different numbers of examples: {n} and {_count(ys, 'y')}")
    return sg_data.Dataset.from_tensor_slices((xs, ys)), n


def global_batches(
    x: Any, y: Any, batch_size: int | None, *, what: str
) -> tuple[Iterable[Any], int | None]:
    """The global batches, in order, and, when known, how many there are."""
    if x is None:
        raise ValueError(f"{what} needs data: x is None")
    if _is_arrays(x):
        size = _check_batch_size(batch_size)
        examples, n = _examples(x, y)
        return examples.batch(size), math.ceil(n / size)
    if y is not None:
        raise ValueError(
            f"{what}: y must be None when x is a dataset or an iterable of batches "
            f"(got x of type {type(x).__name__}); the batches carry the targets"
        )
    if batch_size is not None:
        raise ValueError(
            f"{what}: batch_size applies to arrays; a dataset of type {type(x).__name__} is "
            "already batched (each of its batches is a global batch)"
        )
    if not isinstance(x, Iterable):
        raise TypeError(
            f"{what} takes arrays/tensors, an sg.data.Dataset, a DataLoader or an iterable of "
            f"batches; got {type(x).__name__}"
        )
    try:
        steps = len(x)  # type: ignore[arg-type]
    except TypeError:
        steps = None
    return x, steps


@dataclass(frozen=True)
class DataPosition:
    """Where fit is in its data: ``batch`` batches into pass ``pass_index``, shuffled from
    ``seed``. Plain integers, so that a backup can save it and a restarted fit seek to it."""

    seed: int = 0
    pass_index: int = 0
    batch: int = 0


class FitData:
    """fit's global batches, pass after pass, distributed by the strategy, with a position.

    Arrays are shuffled per pass with a seed derived from ``(seed, pass)``, ``seed`` drawn from
    torch's generator on the chief and broadcast. So every worker has the same order (slicing
    the global batch shards each pass exactly once), and a fit that seeks to a saved position
    sees the same order again: resuming mid-pass trains on exactly the batches an uninterrupted
    run would have. An ``sg.data.Dataset`` of the user's is iterated as given, and its
    iterator's state (``iterator_state``) restores its exact position. Another iterable (a
    DataLoader) has none: seeking to batch k of a pass skips its first k batches, exact when its
    order repeats (no shuffle, or seeded shuffles), the rest of a reshuffled pass otherwise.
    """

    def __init__(
        self, x: Any, y: Any, batch_size: int | None, *, shuffle: bool, strategy: Strategy
    ) -> None:
        self._strategy = strategy
        self._source = x
        self._examples: sg_data.Dataset | None = None
        self._distributed: Iterable[Any] | None = None
        self._batches: Iterable[Any] | None = None  # the user's global batches (not arrays)
        if _is_arrays(x):
            self._batch_size = _check_batch_size(batch_size)
            self._examples, n = _examples(x, y)
            self.steps: int | None = math.ceil(n / self._batch_size)
        else:
            self._batches, self.steps = global_batches(x, y, batch_size, what="fit")
            self._distributed = strategy.experimental_distribute_dataset(self._batches)
        self._shuffle = shuffle and self._examples is not None
        seed = torch.randint(0, 1 << 62, (1,), dtype=torch.int64) if self._shuffle else None
        if seed is not None and strategy.extended.communicator.world_size > 1:
            strategy.extended.communicator.broadcast(seed, 0, what="fit's shuffle seed")
        self.position = DataPosition(seed=0 if seed is None else int(seed.item()))
        self.empty_pass = False  # whether the last pass to end had no batch at all
        self._iterator: Iterator[Any] | None = None
        self._restored_state: dict[str, Any] | None = None
        self._ended: Iterator[Any] | None = None  # the last pass's iterator, once it ended

    @property
    def restores_anywhere(self) -> bool:
        """Whether the fit's position restores on any number of workers: arrays (``position``
        says it all) or an ``sg.data.Dataset`` that every worker reads as one global stream
        (its iterator's state is the job's)."""
        if self._examples is not None:
            return True
        return (
            isinstance(self._source, sg_data.Dataset)
            and self._source.position_saveable()
            and bool(getattr(self._distributed, "reads_one_stream", False))
        )

    def regroup(self) -> None:
        """After the job's workers changed in place: the user's dataset distributed again,
        over the workers now in the group (arrays are distributed anew as each pass opens)."""
        if self._examples is None:
            self._distributed = self._strategy.experimental_distribute_dataset(self._batches)

    def seek(self, position: DataPosition, iterator_state: dict[str, Any] | None = None) -> None:
        """Go on from ``position`` (a saved one) at the next ``next_batch``; for an
        ``sg.data.Dataset``, exactly where ``iterator_state`` (``iterator_state()``'s) stood."""
        self.position = position
        self._iterator = self._ended = None
        self._restored_state = iterator_state

    def iterator_state(self) -> dict[str, Any] | None:
        """Where an ``sg.data.Dataset`` of the user's stands: the state of the pass under way
        (its distributed iterator's ``state_dict``), or of the last pass to end (its seeds and
        pass counters: the next pass goes on from them). None for arrays (``position`` says it
        all) and other iterables (a seek skips batches). Raises ``InputError`` for a dataset
        whose position cannot be saved (a ``from_generator`` source)."""
        if not isinstance(self._source, sg_data.Dataset):
            return None
        for ended, iterator in ((False, self._iterator), (True, self._ended)):
            if iterator is not None:
                iterator.prepare_checkpoint()  # type: ignore[attr-defined]
                return {"pass_ended": ended, "iterator": iterator.state_dict()}  # type: ignore[attr-defined]
        return self._restored_state  # no pass since the seek

    def next_batch(self) -> Any | None:
        """The next global batch of the pass under way (starting one if none is), or None when
        that pass is over; the call after None starts the next pass."""
        if self._iterator is None:
            self._iterator = self._open_pass()
        batch = next(self._iterator, None)
        p = self.position
        if batch is None and p.batch == 0:
            raise ValueError(self._no_steps())
        if batch is None:
            self.empty_pass = p.batch == 0
            self.position = DataPosition(p.seed, p.pass_index + 1, 0)
            self._ended, self._iterator = self._iterator, None
            return None
        self.position = DataPosition(p.seed, p.pass_index, p.batch + 1)
        return batch

    def _no_steps(self) -> str:
        """Why a pass gave no step: the data, its batching and the replicas, named."""
        replicas = self._strategy.num_replicas_in_sync
        if self._examples is not None:
            what = (
                f"{self._examples.cardinality()} examples in global batches of {self._batch_size}"
            )
        else:
            what = repr(self._source)
        return (
            f"fit's data gives 0 steps for {replicas} replica(s) in sync: {what} yields no "
            "batch (empty data, or fewer examples than one batch with drop_remainder=True); "
            "give at least one batch of data"
        )

    def _open_pass(self) -> Iterator[Any]:
        p = self.position
        if self._examples is None:
            assert self._distributed is not None
            iterator = iter(self._distributed)
            restored, self._restored_state = self._restored_state, None
            if restored is not None:
                iterator.load_state_dict(restored["iterator"])  # type: ignore[attr-defined]
                if not restored["pass_ended"]:
                    return iterator
                iterator = iter(self._distributed)  # the next pass, from the restored counters
                self._ended = None
                return iterator
            for _ in range(p.batch):  # a saved position in the user's pass: skip what was done
                next(iterator, None)
            return iterator
        examples = self._examples
        if self._shuffle:
            seed = sg_data.derive_seed(p.seed, p.pass_index)
            examples = examples.shuffle(examples.cardinality(), seed=seed)
        # Batches are consecutive examples: skipping k batches is skipping k * size examples.
        batches = examples.skip(p.batch * self._batch_size).batch(self._batch_size)
        return iter(self._strategy.experimental_distribute_dataset(batches))


def unpack_x_y_sample_weight(data: Any) -> tuple[Any, Any, Any]:
    """``(x, y, sample_weight)`` from a batch that is ``x``, ``(x, y)`` or ``(x, y, w)``: what
    Keras-style training reads, whichever strategy runs it (Keras's
    ``keras.utils.unpack_x_y_sample_weight``)."""
    if isinstance(data, tuple | list):
        if len(data) == 2:
            return data[0], data[1], None
        if len(data) == 3:
            return data[0], data[1], data[2]
        if len(data) == 1:
            return data[0], None, None
        raise ValueError(f"a batch is x, (x, y) or (x, y, sample_weight); got {len(data)} parts")
    return data, None, None
