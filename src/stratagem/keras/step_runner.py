"""Where ``fit``'s and ``evaluate``'s steps run: the ``StepRunner`` the one loop drives.

``Model.fit`` and ``evaluate`` are written once over a runner: ``LocalSteps`` runs the steps in
this process over the strategy (``strategy.run``, or on a pipeline its stages' schedule), and
``coordinated.CoordinatedSteps`` schedules them on a ``ClusterCoordinator``'s workers. A runner
says how many batches an epoch has when known, runs one execution (up to
``steps_per_execution`` batches between the batch hooks), whether batch-end logs can be had,
what an epoch's end waits for, and runs an evaluation's batches. The data it runs on comes
checked and converted from ``epoch_iterator``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from stratagem.distribute import ReduceOp

if TYPE_CHECKING:
    from stratagem.distribute import Strategy
    from stratagem.keras.callbacks import CallbackList
    from stratagem.keras.data_adapter import FitData


class StepRunner(Protocol):
    """What the one fit loop and evaluate ask of where their steps run."""

    @property
    def steps(self) -> int | None:
        """The batches of an epoch of the training data, when known."""

    @property
    def fit_data(self) -> FitData | None:
        """The training data by position (for a backup of a fit), or None where it has none."""

    def batch_logs(self, wanted: bool) -> bool:
        """Whether batch-end hooks get the running logs, given whether a callback wants them."""

    def train(self, step: int, limit: int, one_pass: bool, cbs: CallbackList) -> tuple[int, bool]:
        """One execution of up to ``limit`` batches from ``step`` on, ``on_train_batch_begin``
        called before its first: the batches run, and whether the data ended (the pass, when
        ``one_pass``)."""

    def end_epoch(self) -> None:
        """Wait for the epoch's steps (their metrics complete)."""

    def test(self, batches: Iterable[Any], cbs: CallbackList | None, batch_logs: bool) -> int:
        """Test steps on ``batches``, with the batch hooks; the number of batches."""


@dataclass(frozen=True)
class BatchSteps:
    """A model's steps on one distributed global batch, as ``LocalSteps`` runs them, and its
    running logs."""

    train: Callable[[Any], None]
    test: Callable[[Any], None]
    logs: Callable[[], dict[str, float]]


def agreed_batch_logs(strategy: Strategy, mine: bool) -> bool:
    """Whether any worker's callbacks need the per-step logs: computing them is a collective
    per step under a multi-worker strategy, so every worker must compute them or none, and
    workers' callbacks may differ (the chief's progress bar on a terminal, a ``verbose`` of
    0 on the others). One tiny all-reduce per fit or evaluate, on every worker alike. (A
    coordinating chief runs ``CoordinatedSteps``, whose batch hooks get no logs.)"""
    extended = strategy.extended
    communicator = getattr(extended, "communicator", None)
    if communicator is None or getattr(communicator, "world_size", 1) <= 1:
        return mine
    flag = torch.tensor([1.0 if mine else 0.0])
    communicator.all_reduce(flag, ReduceOp.SUM, what="whether any worker needs step logs")
    return bool(flag.item() > 0)


class LocalSteps:
    """The steps run in this process, each on a global batch the strategy distributes."""

    def __init__(self, strategy: Strategy, steps: BatchSteps, data: FitData | None = None) -> None:
        self._strategy = strategy
        self._steps = steps
        self._data = data

    @property
    def steps(self) -> int | None:
        return None if self._data is None else self._data.steps

    @property
    def fit_data(self) -> FitData | None:
        return self._data

    def batch_logs(self, wanted: bool) -> bool:
        return agreed_batch_logs(self._strategy, wanted)

    def train(self, step: int, limit: int, one_pass: bool, cbs: CallbackList) -> tuple[int, bool]:
        data = self._data
        assert data is not None, "LocalSteps.train needs the fit's data"
        done = 0
        while done < limit:
            batch = data.next_batch()
            if batch is None:  # the pass is over
                if one_pass or data.empty_pass:
                    return done, True
                continue  # steps_per_epoch goes on into the next pass over the data
            if done == 0:
                cbs.on_train_batch_begin(step)
            self._steps.train(batch)
            done += 1
        return done, False

    def end_epoch(self) -> None:
        pass  # every step ran here, in order

    def test(self, batches: Iterable[Any], cbs: CallbackList | None, batch_logs: bool) -> int:
        count = 0
        for batch in self._strategy.experimental_distribute_dataset(batches):
            if cbs is not None:
                cbs.on_test_batch_begin(count)
            self._steps.test(batch)
            if cbs is not None:
                cbs.on_test_batch_end(count, self._steps.logs() if batch_logs else {})
            count += 1
        return count


__all__ = ["BatchSteps", "LocalSteps", "StepRunner", "agreed_batch_logs"]
