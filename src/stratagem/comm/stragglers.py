"""Stragglers: a worker persistently slower than the others, named once with its figures.

At the end of each step that synchronised the workers, every process records the step's time
(since the previous one ended) and the seconds it waited in collectives meanwhile
(``Traffic.seconds_waiting``): its own work is the difference. Every ``EXCHANGE_EVERY`` steps
the processes share their figures in one small all-reduce; each applies the same rule to them:

    a worker straggles when, over the last ``WINDOW`` steps, the median of its own work is more
    than ``RATIO`` times the median of the other workers' medians, and ``MIN_EXCESS_S`` above it.

Relative (a load that slows every worker alike names no one); the medians ignore a single slow
step (a checkpoint). Each straggler is named once per run, alike on every worker: in ``named``
(fit's progress bar and TensorBoard read it) and in the chief's log (``[stratagem] ...`` on
stderr). A world of one has nothing to compare. ``STRATAGEM_STRAGGLERS=0`` turns it off.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from stratagem.cluster import progress
from stratagem.comm.communicator import Communicator

RATIO = 1.5
WINDOW = 5
EXCHANGE_EVERY = 3
MIN_EXCESS_S = 0.005
SWITCH_VARIABLE = "STRATAGEM_STRAGGLERS"


@dataclass(frozen=True)
class Straggler:
    """A worker the rule named: its median own work per step and the others' median."""

    rank: int
    name: str
    step: int  # the last step of the window that named it (1 = the first step)
    own_work_s: float
    others_s: float
    step_s: float  # the job's median step time over the window

    def describe(self) -> str:
        return (
            f"{self.name} is a straggler: over steps {self.step - WINDOW + 1}-{self.step} its "
            f"own work took {self.own_work_s * 1e3:.1f} ms a step (median), "
            f"{self.own_work_s / self.others_s:.1f}x the other workers' "
            f"{self.others_s * 1e3:.1f} ms; a step took {self.step_s * 1e3:.1f} ms"
        )


def find_stragglers(
    own_work: list[list[float]], *, ratio: float = RATIO, min_excess_s: float = MIN_EXCESS_S
) -> list[tuple[int, float, float]]:
    """The rule on one window: ``own_work[r]`` is rank r's own work in each step of it.
    Returns ``(rank, its median, the others' median)`` for each straggler, in rank order."""
    medians = [statistics.median(w) for w in own_work]
    named = []
    for rank, mine in enumerate(medians):
        others = statistics.median(medians[:rank] + medians[rank + 1 :])
        if mine > ratio * others and mine - others > min_excess_s:
            named.append((rank, mine, others))
    return named


def enabled() -> bool:
    """Whether the watch runs (``STRATAGEM_STRAGGLERS``: on unless ``0``)."""
    return os.environ.get(SWITCH_VARIABLE, "").strip() != "0"


class StragglerWatch:
    """Times one process's steps and names stragglers (call ``step_done`` after each step;
    every process must call it after the same steps)."""

    def __init__(self, comm: Communicator, *, clock: Callable[[], float] = time.perf_counter):
        self._comm = comm
        self._clock = clock
        self._steps = 0  # steps done; the first one is not timed (it starts the clock)
        self._ended: float | None = None
        self._waited_at_end = 0.0
        self._pending: list[tuple[float, float]] = []  # this process's (step, own work) s
        # Every rank's (step, own work) per step, the last WINDOW steps.
        self._window: deque[list[tuple[float, float]]] = deque(maxlen=WINDOW)
        self.named: list[Straggler] = []

    def step_done(self) -> None:
        """A step that synchronised the workers has ended: record it; share when due."""
        now = self._clock()
        self._steps += 1
        if self._ended is not None:
            waited = self._comm.traffic.seconds_waiting - self._waited_at_end
            step = now - self._ended
            self._pending.append((step, max(step - waited, 0.0)))
        if len(self._pending) == EXCHANGE_EVERY:
            self._exchange()
            now = self._clock()  # the exchange is no step's time
        self._ended = now
        self._waited_at_end = self._comm.traffic.seconds_waiting

    def _exchange(self) -> None:
        n, k = self._comm.world_size, EXCHANGE_EVERY
        figures = torch.zeros(n, k, 2, dtype=torch.float64)
        figures[self._comm.rank] = torch.tensor(self._pending, dtype=torch.float64)
        self._pending = []
        # Control figures, not data: not counted as traffic (as barriers are not).
        traffic = self._comm.traffic
        counted = (traffic.bytes_sent, traffic.all_reduces, traffic.collectives)
        self._comm.all_reduce(figures, what="the step times of the straggler watch")
        traffic.bytes_sent, traffic.all_reduces, traffic.collectives = counted
        for i in range(k):
            self._window.append([(float(s), float(w)) for s, w in figures[:, i].tolist()])
        if len(self._window) == WINDOW:
            self._judge(last_step=self._steps)

    def _judge(self, last_step: int) -> None:
        own = [[step[r][1] for step in self._window] for r in range(self._comm.world_size)]
        step_s = statistics.median(max(s for s, _ in step) for step in self._window)
        known = {s.rank for s in self.named}
        for rank, mine, others in find_stragglers(own):
            if rank in known:
                continue
            found = Straggler(rank, self._comm.peer_name(rank), last_step, mine, others, step_s)
            self.named.append(found)
            if self._comm.is_chief:
                progress.logger().warning(found.describe())
