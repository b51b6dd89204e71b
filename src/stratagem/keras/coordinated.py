"""``Model.fit``/``evaluate`` on the chief of a TF2 parameter-server cluster (a coordinator).

As TF2: ``fit`` makes (or takes) the strategy's ``ClusterCoordinator`` and schedules its train
function on the workers, which read their own datasets; callbacks run on the chief.
``steps_per_epoch`` is required (a worker's dataset repeats). The data is an ``sg.data.Dataset``
(each worker makes its own copy from its recipe), a distributed dataset made on the chief, a
``DatasetCreator(dataset_fn)`` (each worker calls ``dataset_fn(input_context)``), or arrays,
which travel to every worker once. One scheduled function runs ``steps_per_execution`` batches.
``evaluate`` sends every batch of a finite dataset with its function, so each is visited
exactly once (a function lost with its worker runs again; its totals count once). The
scheduled functions (``train_steps``, ``test_batches``) are this module's: a worker runs its own
copy of them on the model rebuilt from the chief's state (``stratagem.shipping``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from stratagem import data as sg_data
from stratagem import shipping
from stratagem.distribute import InputContext, InputOptions
from stratagem.distribute.capabilities import ChiefCoordination
from stratagem.distribute.coordinator import (
    ClusterCoordinator,
    PerWorkerDistributedDataset,
    PerWorkerDistributedDatasetsFromFunction,
)
from stratagem.keras.data_adapter import DataPosition, _as_tensor

if TYPE_CHECKING:
    from stratagem.keras.callbacks import CallbackList


class DatasetCreator:
    """``tf.keras.utils.experimental.DatasetCreator(dataset_fn, input_options=None)``: what
    ``fit`` takes under a coordinator. ``dataset_fn(input_context)`` makes one worker's
    dataset; it runs on each worker (sent by reference, as any scheduled function)."""

    def __init__(
        self,
        dataset_fn: Callable[[InputContext], Any],
        input_options: InputOptions | None = None,
    ) -> None:
        if not callable(dataset_fn):
            raise TypeError(
                f"DatasetCreator takes a callable dataset_fn(input_context); got {dataset_fn!r}"
            )
        self.dataset_fn = dataset_fn
        self.input_options = input_options

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.dataset_fn(*args, **kwargs)


def coordinator_for(strategy: Any) -> ClusterCoordinator | None:
    """The strategy's ``ClusterCoordinator`` when this process is the chief of a cluster with
    a chief (TF2's coordinated training); None for every other strategy and task."""
    extended = strategy.extended
    if isinstance(extended, ChiefCoordination) and extended.coordinating:
        return ClusterCoordinator(strategy)
    return None


def worker_dataset_fn(
    strategy: Any, x: Any, y: Any, batch_size: int, shuffle: bool
) -> Callable[[], Any]:
    """The per-worker dataset of arrays ``x``, ``y``: the worker's shard of the examples,
    shuffled each pass when asked, in batches of its part of the global ``batch_size``,
    repeated (``steps_per_epoch`` ends an epoch). ``strategy`` (the chief's) is the worker's
    own there, whose input context (its index among the workers) picks the shard."""
    xs = _as_tensor(x, "x")
    ys = None if y is None else _as_tensor(y, "y")

    def pipeline(context: InputContext) -> Any:
        examples = sg_data.Dataset.from_tensor_slices(xs if ys is None else (xs, ys))
        examples = examples.shard(context.num_input_pipelines, context.input_pipeline_id)
        if shuffle:
            examples = examples.shuffle(len(xs))
        per_worker = context.get_per_replica_batch_size(batch_size)
        return examples.batch(per_worker).repeat()

    def dataset_fn() -> Any:
        return strategy.distribute_datasets_from_function(pipeline)

    return dataset_fn


def creator_dataset_fn(strategy: Any, creator: DatasetCreator) -> Callable[[], Any]:
    """The per-worker dataset of a ``DatasetCreator``: the worker's strategy calls its
    ``dataset_fn`` with the worker's input context (TF's
    ``distribute_datasets_from_function(dataset_fn, input_options)``)."""
    dataset_fn, options = creator.dataset_fn, creator.input_options
    # The options travel as their one field (plain data).
    fetch = None if options is None else options.experimental_fetch_to_device

    def made() -> Any:
        given = None if fetch is None else InputOptions(experimental_fetch_to_device=fetch)
        return strategy.distribute_datasets_from_function(dataset_fn, given)

    return made


def per_worker_dataset(strategy: Any, x: Any) -> Any:
    """What ``create_per_worker_dataset`` builds on every worker for fit's ``x`` when it is a
    dataset (as Keras's: a dataset is distributed first), or None for arrays and creators."""
    if isinstance(x, PerWorkerDistributedDataset | PerWorkerDistributedDatasetsFromFunction):
        return x
    if isinstance(x, sg_data.Dataset):
        return strategy.experimental_distribute_dataset(x)
    return None


class NoPosition:
    """fit's data as a backup (``BackupAndRestore``) sees it on a coordinated chief: no position
    to save or seek, since each worker's dataset repeats on its own and a restarted job's
    workers make theirs anew (as TF's); the backup keeps the epoch, step and weights."""

    position = DataPosition()

    def seek(self, position: DataPosition, iterator_state: Any = None) -> None:
        """Nothing to seek: the workers' datasets start again."""

    def iterator_state(self) -> None:
        return None


@dataclass(frozen=True)
class WorkerBatches:
    """``fit``'s data on the chief of a coordinated cluster: the per-worker iterator each
    scheduled function reads its batches from, and ``steps`` (``steps_per_epoch``) batches an
    epoch. It has no position a backup could save."""

    iterator: Iterator[Any]
    steps: int


class CoordinatedSteps:
    """The step runner (``step_runner.StepRunner``) of the chief of a coordinated cluster:
    each execution of ``steps_per_execution`` batches is a function scheduled on a free worker,
    which reads its own dataset; an epoch's end joins them, where the metrics are complete
    (their totals come back with each function). Batch hooks run once per function, without
    logs: as TF's, they would wait for the workers; the epoch's logs come at its end."""

    def __init__(
        self, model: Any, coordinator: ClusterCoordinator, data: WorkerBatches | None = None
    ) -> None:
        self._model = model
        self._coordinator = coordinator
        self._data = data

    @property
    def steps(self) -> int | None:
        return None if self._data is None else self._data.steps

    @property
    def fit_data(self) -> Any:
        # The workers' datasets repeat, with no position kept here (a fit's backup has none).
        return None if self._data is None else NoPosition()

    def batch_logs(self, wanted: bool) -> bool:
        return False

    def train(self, step: int, limit: int, one_pass: bool, cbs: CallbackList) -> tuple[int, bool]:
        assert self._data is not None, "CoordinatedSteps.train needs the fit's data"
        cbs.on_train_batch_begin(step)
        # The workers' steps count in optimizer.iterations as each function ends (its totals).
        self._coordinator.schedule(train_steps, args=(self._model, self._data.iterator, limit))
        return limit, False  # a worker's dataset repeats: it never ends

    def end_epoch(self) -> None:
        self._coordinator.join()

    def test(self, batches: Iterable[Any], cbs: CallbackList | None, batch_logs: bool) -> int:
        # Each batch goes with its function: every one is evaluated once, on a free worker.
        group: list[Any] = []
        count, size = 0, self._model.steps_per_execution
        for batch in batches:
            if not group and cbs is not None:
                cbs.on_test_batch_begin(count)
            group.append(batch)
            count += 1
            if len(group) == size:
                self._coordinator.schedule(test_batches, args=(self._model, group))
                group = []
                if cbs is not None:
                    cbs.on_test_batch_end(count - 1, {})
        if group:
            self._coordinator.schedule(test_batches, args=(self._model, group))
            if cbs is not None:
                cbs.on_test_batch_end(count - 1, {})
        self._coordinator.join()
        return count


@shipping.entry_point  # a worker calls it: the coordinator sends it
def train_steps(model: Any, iterator: Iterator[Any], steps: int) -> None:
    """Scheduled by ``fit``: ``steps`` batches of the worker's iterator, each a train step on
    the worker (its optimizer step pushes the gradients to the ps)."""
    strategy = model.distribute_strategy
    for _ in range(steps):
        strategy.run(model.train_step, args=(next(iterator),))


@shipping.entry_point  # a worker calls it: the coordinator sends it
def test_batches(model: Any, batches: list[Any]) -> None:
    """Scheduled by ``evaluate``: these batches (sent with the function) through test steps."""
    strategy = model.distribute_strategy
    for batch in batches:
        strategy.run(model.test_step, args=(batch,))


def check_fit(steps_per_epoch: int | None, x: Any, accumulation_steps: int | None) -> None:
    """What coordinated ``fit`` needs: TF's own requirements, said as TF says them, and no
    gradient accumulation (``accumulation_steps``, the optimizer's)."""
    if steps_per_epoch is None:
        raise ValueError(
            "`steps_per_epoch` must be specified with ParameterServerStrategy: each worker's "
            "dataset repeats, so the chief cannot see where an epoch ends"
        )
    datasets = (
        DatasetCreator,
        sg_data.Dataset,
        PerWorkerDistributedDataset,
        PerWorkerDistributedDatasetsFromFunction,
        torch.Tensor,
    )
    if not isinstance(x, datasets) and not hasattr(x, "__array__"):
        raise TypeError(
            "fit under a ClusterCoordinator takes an sg.data.Dataset or a distributed dataset "
            "(each worker makes its own copy), a "
            "sg.keras.utils.experimental.DatasetCreator(dataset_fn) (each worker makes its own "
            f"dataset) or arrays (sent to every worker); got {type(x).__name__}"
        )
    if accumulation_steps:
        raise ValueError(
            "gradient_accumulation_steps is not supported under a ClusterCoordinator: each "
            "worker applies its own gradients on the ps, asynchronously"
        )


__all__ = [
    "CoordinatedSteps",
    "DatasetCreator",
    "WorkerBatches",
    "check_fit",
    "coordinator_for",
    "creator_dataset_fn",
    "per_worker_dataset",
    "test_batches",
    "train_steps",
    "worker_dataset_fn",
]


# The dataset functions fit sends to create_per_worker_dataset: a worker calls them.
shipping.nested_entry_points(
    __name__, "worker_dataset_fn.<locals>.dataset_fn", "creator_dataset_fn.<locals>.made"
)
