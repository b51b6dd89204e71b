"""Stragglers named: a worker persistently slower than the others is named once, with its
figures, in the chief's log, fit's progress bar and TensorBoard; clean runs name no one.

The rule (``stratagem.comm.stragglers``): over the last 5 steps, a worker's median own work (its
step time less its wait in collectives) above 1.5x the median of the other workers' medians,
and 5 ms above it. The rule and the watch's bookkeeping are checked in one process against
hand-computed figures; one real 3-worker job, made slow by a sleep, checks the timing itself.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

import stratagem as sg
from cluster_utils import WORKERS, Cluster
from keras_utils import compiled as _compiled
from stratagem.comm.communicator import LocalCommunicator
from stratagem.comm.reduce_op import ReduceOp
from stratagem.comm.stragglers import Straggler, StragglerWatch, find_stragglers
from workers.common import keras_data

MS = 1e-3


# ------------------------------------------------------------------ the rule, by hand


def test_the_rule_names_a_worker_above_1_5x_the_median_of_the_others():
    # Medians 30, 31, 90 ms: worker 2's 90 > 1.5 x median(30, 31) = 45.75; the others are not
    # above 1.5 x median(31, 90) = 91.5 or median(30, 90) = 90.
    work = [[30 * MS] * 5, [31 * MS] * 5, [90 * MS] * 5]
    ((rank, mine, others),) = find_stragglers(work)
    assert rank == 2 and mine == pytest.approx(0.090) and others == pytest.approx(0.0305)


@pytest.mark.parametrize(
    "work",
    [
        [[90 * MS] * 5] * 3,  # a load that slows every worker alike
        [[30 * MS] * 5, [30 * MS] * 5, [42 * MS] * 5],  # 1.4x: under the ratio
        [[30 * MS] * 5, [30 * MS] * 5, [30 * MS] * 3 + [300 * MS] * 2],  # two slow steps of 5
        [[0.2 * MS] * 5, [0.2 * MS] * 5, [0.9 * MS] * 5],  # 4.5x, but 0.7 ms: jitter
    ],
    ids=["uniform-load", "1.4x", "two-slow-steps", "sub-millisecond"],
)
def test_the_rule_names_no_one_without_a_persistent_relative_slowness(work):
    assert find_stragglers(work) == []


# ------------------------------------------------------------------ the watch, one process


class _SimulatedJob(LocalCommunicator):
    """Rank 0 of a 3-worker job whose steps are scripted: ``own[r](step)`` is rank r's own work
    in a step. A step lasts as long as the slowest worker's work (the all-reduce waits for it);
    the watch's all-reduce of figures gets the other ranks' from the script."""

    def __init__(self, own: list) -> None:
        super().__init__()
        self.world_size = 3
        self.own = own
        self.now = 0.0
        self.step = 0
        self.unshared: list[int] = []  # steps timed by the watch, not yet exchanged

    def run_step(self, watch: StragglerWatch) -> None:
        self.step += 1
        works = [own(self.step) for own in self.own]
        period = max(works) + 1 * MS  # + the all-reduce itself
        self.now += period
        self.traffic.seconds_waiting += period - works[0]
        self.traffic.collectives += 1  # the gradients' all-reduce
        if self.step > 1:  # the first step starts the watch's clock
            self.unshared.append(self.step)
        watch.step_done()

    def all_reduce(self, tensor, op=ReduceOp.SUM, *, what):
        assert op is ReduceOp.SUM and tensor.shape == (3, 3, 2)
        for r in (1, 2):
            for i, step in enumerate(self.unshared):
                works = [own(step) for own in self.own]
                tensor[r, i] = torch.tensor([max(works) + 1 * MS, works[r]], dtype=torch.float64)
        self.traffic.bytes_sent += 999  # undone by the watch: control figures are no traffic
        self.unshared = []


def _watched(own: list, steps: int) -> tuple[StragglerWatch, _SimulatedJob]:
    job = _SimulatedJob(own)
    watch = StragglerWatch(job, clock=lambda: job.now)
    for _ in range(steps):
        job.run_step(watch)
    return watch, job


def _slow_from(first: int, last: int, rank: int):
    return [
        (lambda s, r=r: (90 if r == rank and first <= s <= last else 30) * MS) for r in range(3)
    ]


@pytest.mark.parametrize("first", [14, 15, 16], ids=lambda f: f"from-step-{f}")
def test_a_3x_slower_worker_is_named_once_within_5_steps_with_its_figures(first):
    """Whatever step the slowness starts at (the exchange is every 3 steps), the window that
    names it ends within its first 5 slow steps; 20 slow steps name it once."""
    watch, job = _watched(_slow_from(first, first + 19, rank=2), steps=45)
    (named,) = watch.named
    assert named.rank == 2 and first + 2 <= named.step <= first + 4
    assert named.own_work_s == pytest.approx(0.090) and named.others_s == pytest.approx(0.030)
    assert named.step_s == pytest.approx(0.091)
    assert "is a straggler" in named.describe() and "3.0x" in named.describe()
    assert job.traffic.bytes_sent == 0  # the exchanges are not counted as data traffic


def test_a_clean_simulated_run_and_a_slow_start_name_no_one():
    noisy = [(lambda s, r=r: (30 + (7 * s * (r + 1)) % 11) * MS) for r in range(3)]  # 30-40 ms
    assert _watched(noisy, steps=60)[0].named == []
    # One slow first step (warm-up) on one worker only: the median ignores it.
    warm_up = [lambda s: 30 * MS, lambda s: 30 * MS, lambda s: (500 if s == 2 else 30) * MS]
    assert _watched(warm_up, steps=30)[0].named == []


# ------------------------------------------------------------------ fit's progress bar, TensorBoard


class _Watch:
    def __init__(self) -> None:
        self.named: list[Straggler] = []


@pytest.fixture
def named_during_fit(monkeypatch):
    """A watch on the default strategy that names worker 2 after fit's second batch."""
    watch = _Watch()
    found = Straggler(2, "worker 2 (localhost:1)", 6, 0.090, 0.030, 0.091)
    extended = sg.distribute.get_strategy().extended
    monkeypatch.setattr(extended, "straggler_watch", watch, raising=False)

    class NameIt(sg.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1 and not watch.named:
                watch.named.append(found)

    return NameIt(), found


def test_fit_s_progress_bar_names_a_straggler_once(named_during_fit):
    name_it, found = named_during_fit
    x, y = keras_data(48)
    stream = io.StringIO()
    bar = sg.keras.callbacks.ProgbarLogger(verbose=2, stream=stream)
    _compiled().fit(x, y, batch_size=16, epochs=2, callbacks=[name_it, bar], verbose=2)
    lines = stream.getvalue().splitlines()
    assert lines.count(f"straggler: {found.describe()}") == 1, lines


def test_tensorboard_names_a_straggler_once_at_its_step(tmp_path, named_during_fit):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    name_it, found = named_during_fit
    x, y = keras_data(48)
    board = sg.keras.callbacks.TensorBoard(str(tmp_path / "logs"), update_freq="batch")
    _compiled().fit(x, y, batch_size=16, epochs=2, callbacks=[name_it, board], verbose=0)
    events = EventAccumulator(str(tmp_path / "logs" / "train"), size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors("stragglers/text_summary")
    assert [(t.step, t.tensor_proto.string_val[0].decode()) for t in texts] == [
        (2, found.describe())
    ]


# ------------------------------------------------------------------ a real job


def _start(workdir: Path, *, slow: int, steps: int) -> Cluster:
    env = {"STEPS": str(steps), "WORK": "0.03", "SLOW": str(slow)}
    env.update({"SLOW_FROM": "14", "SLOW_TO": "33"})
    return Cluster(WORKERS / "stragglers.py", 3, workdir, env=env, args=[str(workdir)])


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, tuple[list[list[dict]], list[str]]]:
    """The slow job and a clean one, run at the same time (the rule is relative: each job's
    workers share the machine's load alike); what each worker named, and its stderr."""
    dirs = {kind: tmp_path_factory.mktemp(kind) for kind in ("slow", "clean")}
    started = {"slow": _start(dirs["slow"], slow=2, steps=40)}
    out = {}
    try:
        started["clean"] = _start(dirs["clean"], slow=-1, steps=30)
        for kind, job in started.items():
            results = [r.check(f"{kind} worker {i}") for i, r in enumerate(job.wait(timeout=240))]
            named = [json.loads((dirs[kind] / f"rank{r}.json").read_text()) for r in range(3)]
            out[kind] = (named, [r.stderr for r in results])
    finally:
        for job in started.values():
            job.__exit__(None, None, None)
    return out


@pytest.mark.multiprocess
def test_a_worker_made_3x_slower_for_20_steps_is_named_within_5_steps(jobs):
    """Worker 2 sleeps 90 ms instead of 30 in steps 14-33 of 40 (its own work 3x the
    others'): every worker names it, once, by step 18, none before step 14; the chief logs
    it once with its figures."""
    named, stderr = jobs["slow"]
    assert named[0] == named[1] == named[2], named  # the same verdict on every worker
    ((straggler,),) = named[:1]
    assert straggler["rank"] == 2 and 14 <= straggler["step"] <= 18, straggler
    # The figures: its own work includes its 90 ms sleep; the others' their 30 ms one.
    assert straggler["own"] >= 0.090 and straggler["others"] >= 0.030
    assert straggler["own"] > 1.5 * straggler["others"]
    logged = [line for line in stderr[0].splitlines() if "is a straggler" in line]
    assert logged == [f"[stratagem] {straggler['line']}"], stderr[0]
    assert not any("is a straggler" in e for e in stderr[1:])  # the chief's log only


@pytest.mark.multiprocess
def test_a_clean_run_names_no_one(jobs):
    named, stderr = jobs["clean"]
    assert named == [[], [], []]
    assert not any("is a straggler" in e for e in stderr)
