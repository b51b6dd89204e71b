"""The one owner of ``fit``'s and ``evaluate``'s data (Keras's ``EpochIterator``).

``x``, ``y``, ``batch_size``, ``shuffle``, ``steps_per_epoch`` and ``validation_data`` come
here once, are checked, and leave as what the loops consume:

- ``training_data``: ``FitData`` (this process's global batches by position,
  ``data_adapter``), or on the chief of a coordinated cluster ``WorkerBatches`` (an iterator
  over every worker's own dataset, made by ``coordinated``'s dataset functions);
- ``evaluation_data`` / ``validation_data``: ``EvaluationData``, the global batches (at most
  ``steps`` of them) and how many there are when known; ``prediction_data``: the batches.

Nothing here runs a step: the step runners (``step_runner``, ``coordinated``) do.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from stratagem.keras import coordinated
from stratagem.keras.coordinated import WorkerBatches
from stratagem.keras.data_adapter import FitData, global_batches, is_array_data

if TYPE_CHECKING:
    from stratagem.distribute import Strategy
    from stratagem.distribute.coordinator import ClusterCoordinator


@dataclass(frozen=True)
class EvaluationData:
    """``evaluate``'s (or fit's validation's) global batches, and their number when known."""

    batches: Iterable[Any]
    count: int | None


def training_data(
    x: Any, y: Any, batch_size: int | None, *, shuffle: bool, steps_per_epoch: int | None,
    validation_data: Any, strategy: Strategy, coordinator: ClusterCoordinator | None,
    accumulation_steps: int | None = None,
) -> FitData | WorkerBatches:  # fmt: skip
    """``fit``'s training data, checked: ``WorkerBatches`` under a coordinator (which refuses
    gradient accumulation, ``accumulation_steps``), else ``FitData``."""
    if coordinator is not None:
        coordinated.check_fit(steps_per_epoch, x, accumulation_steps)
        assert steps_per_epoch is not None
        return _worker_batches(coordinator, strategy, x, y, batch_size, shuffle, steps_per_epoch)
    _check_validation_shape(x, validation_data)
    return FitData(x, y, batch_size, shuffle=shuffle, strategy=strategy)


def evaluation_data(x: Any, y: Any, batch_size: int | None, steps: int | None) -> EvaluationData:
    """``evaluate``'s data: ``x`` and ``y``, or ``x`` alone as ``(x, y)`` of arrays or a
    dataset of batches; at most ``steps`` batches (None: until the data ends)."""
    return _evaluation_data((x, y) if y is not None else x, batch_size, steps)


def validation_data(data: Any, batch_size: int | None) -> EvaluationData:
    """``fit``'s ``validation_data``: ``batch_size`` applies to validation arrays; a
    validation dataset comes batched."""
    size = batch_size if is_array_data(_split_xy(data)[0]) else None
    return _evaluation_data(data, size, None)


def prediction_data(x: Any, batch_size: int | None) -> Iterable[Any]:
    """``predict``'s global batches: of arrays ``x``, or ``x`` itself, a dataset of batches."""
    batches, _ = global_batches(x, None, batch_size, what="predict")
    return batches


def _evaluation_data(data: Any, batch_size: int | None, steps: int | None) -> EvaluationData:
    x, y = _split_xy(data)
    batches, count = global_batches(x, y, batch_size, what="evaluate")
    if steps is not None:
        batches = _FirstBatches(batches, steps)
        count = None if count is None else min(steps, count)
    return EvaluationData(batches, count)


def _worker_batches(
    coordinator: ClusterCoordinator, strategy: Strategy, x: Any, y: Any,
    batch_size: int | None, shuffle: bool, steps_per_epoch: int,
) -> WorkerBatches:  # fmt: skip
    """What the workers read under a coordinator: ``x`` distributed to every worker (a
    dataset), made there (a ``DatasetCreator``), or sent there (arrays)."""
    dataset = coordinated.per_worker_dataset(strategy, x)
    is_dataset = isinstance(x, coordinated.DatasetCreator) or dataset is not None
    if is_dataset and (y is not None or batch_size is not None):
        raise ValueError(
            f"fit({type(x).__name__}): y and batch_size must be None; the dataset "
            "carries the targets and is batched"
        )
    if dataset is None:
        if isinstance(x, coordinated.DatasetCreator):
            dataset = coordinated.creator_dataset_fn(strategy, x)
        else:
            size = batch_size or 32
            dataset = coordinated.worker_dataset_fn(strategy, x, y, size, shuffle)
    return WorkerBatches(iter(coordinator.create_per_worker_dataset(dataset)), steps_per_epoch)


def _check_validation_shape(x: Any, validation_data: Any) -> None:
    if validation_data is None or not _is_one_array(x):
        return  # a dict of arrays is checked key by key when its batches are made
    x_val, _ = _split_xy(validation_data)
    if _is_one_array(x_val) and tuple(x_val.shape[1:]) != tuple(x.shape[1:]):
        raise ValueError(
            f"validation_data examples have shape {list(x_val.shape[1:])}, the training "
            f"examples {list(x.shape[1:])}"
        )


def _split_xy(data: Any) -> tuple[Any, Any]:
    """``validation_data=(x_val, y_val)`` of arrays, or a dataset of batches."""
    if isinstance(data, tuple) and len(data) in (2, 3) and is_array_data(data[0]):
        return data[0], data[1]
    return data, None


def _is_one_array(value: Any) -> bool:
    return isinstance(value, torch.Tensor | np.ndarray)


class _FirstBatches:
    """The first ``steps`` batches of ``batches`` (evaluate's ``steps``), re-iterable as the
    data is: each ``iter()`` starts a new pass."""

    def __init__(self, batches: Iterable[Any], steps: int) -> None:
        self.batches, self.steps = batches, steps

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.batches), self.steps)


__all__ = [
    "EvaluationData",
    "evaluation_data",
    "prediction_data",
    "training_data",
    "validation_data",
]
