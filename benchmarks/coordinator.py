"""TF2's ClusterCoordinator against between-graph parameter-server training, side by side.

Every job is a real cluster on this machine (``stratagem run``) with 1 ps, training an MLP on
digits (8x8, batch 32, SGD with momentum) for a fixed wall time. A step is the real forward and
backward plus an injected sleep standing for more compute (``--delay``), then the push to the
ps. Measured, per round (the variants' order rotating from round to round):

- ``empty``: a chief scheduling empty functions on 2 workers: functions/s (the dispatch cost);
- ``between``: 2 workers each running the training loop themselves (between-graph, async):
  updates/s the ps applied;
- ``coordinated``: a chief scheduling the same step on 2 workers (``ClusterCoordinator``, each
  function ``--steps-per-function`` steps, 1 by default, on the worker's per-worker iterator):
  updates/s. Target: >= 0.8x between;
- ``fit10`` and ``between_fit`` (by ``--variants`` only): ``Model.fit`` with
  ``steps_per_execution=10`` on the same model, on the chief of a coordinated job or on every
  worker of a between-graph one: updates/s. Target: fit10 >= 0.9x between_fit;
- ``between_waker`` (by ``--variants`` only): ``between`` beside a process that wakes and
  spins as a coordinated job's chief does, without its work (``--waker RATE,MICROSECONDS``):
  what a fourth process with the chief's pattern costs a between-graph job on this machine,
  the part of ``coordinated10 / between`` that is not a function's path;
- with ``--stragglers``, 3 workers of which worker 2 is three times slower: ``sync``
  (between-graph, every update the mean of the 3 workers' gradients, so each waits for the
  straggler) and ``coordinated3`` (functions go to whichever worker is free). Target:
  coordinated >= 1.8x sync.

The ratios are medians over rounds of the two variants measured in the same round.

    python benchmarks/coordinator.py --stragglers    # about 4 minutes on 2 cores
    python benchmarks/coordinator.py --delay 0 --steps-per-function 10   # dispatch-bound steps
    python benchmarks/coordinator.py --quick         # a smoke run
    python benchmarks/coordinator.py --delay 0 --tf-python /path/to/tf-venv/bin/python --load 2

``--tf-python`` adds TensorFlow's own coordinator on the same work (``coordinator_tf.py``, run
by that Python: TF is never stratagem's dependency): empty functions, one and ten training
steps per function, in the same rounds as ours, with the ratios ours/TF. ``--load N`` runs N
busy processes (a core each) beside every job: a machine that is not idle.

Each job also reports the CPU its processes used per update over the timed part (``/proc``;
``job_cpu.py``): other jobs on the machine change it far less than the rates, so it tells what
a change saved where the rates of one run differ by more than the change.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import median_round_ratio, rotated_rounds, run_launcher_job
from job_cpu import job_cpu_seconds, per_update_ms

BATCH = 32


def build(sg, torch, seed: int):
    """The model, optimizer and data every job trains (built in the strategy's scope)."""
    import numpy as np

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    (x, y), _ = sg.data.datasets.load_digits(image_size=8)
    return model, optimizer, torch.from_numpy(x / np.float32(255)), torch.from_numpy(y)


def own_work(compute: float, delay: float, slow: bool) -> None:
    """The injected part of a step's own work (3x the whole for the straggler)."""
    time.sleep(3 * delay + 2 * compute if slow else delay)


def between_task(args: argparse.Namespace) -> None:
    """A task of a between-graph job: every worker trains; worker 0 reports the ps's count."""
    import torch

    import stratagem as sg

    strategy = sg.distribute.ParameterServerStrategy(mode=args.mode)
    task = strategy.cluster_resolver.task_id
    with strategy.scope():
        model, optimizer, x, y = build(sg, torch, 0)
    generator = torch.Generator().manual_seed(task)

    def step() -> None:
        begin = time.perf_counter()
        rows = torch.randint(0, len(x), (BATCH,), generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        own_work(time.perf_counter() - begin, args.delay, args.stragglers and task == 2)
        optimizer.step()

    step()  # the first push connects and builds the ps's optimizer: not timed
    (before,) = strategy.ps_stats() if task == 0 else [{"steps": 0}]
    cpu_before = job_cpu_seconds()
    start = time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        step()
    if task == 0:
        (after,) = strategy.ps_stats()
        cpu_after = job_cpu_seconds()
        seconds = time.perf_counter() - start
        updates = after["steps"] - before["steps"]
        cpu_ms = per_update_ms(cpu_before, cpu_after, updates)
        print("RESULT " + json.dumps({"per_s": updates / seconds, "cpu_ms": cpu_ms}))


def fit_task(args: argparse.Namespace) -> None:
    """A task of a ``Model.fit`` job, ``steps_per_execution=10``: coordinated (the chief fits,
    the workers serve), or between-graph (every worker fits; worker 0 reports)."""
    import torch

    import stratagem as sg

    resolver = sg.distribute.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type in ("worker", "ps") and args.coordinated:
        sg.distribute.Server(resolver).join()
        return
    strategy = sg.distribute.ParameterServerStrategy(resolver)
    reports = resolver.task_type == "chief" or resolver.task_id == 0
    with strategy.scope():
        module, _, x, y = build(sg, torch, 0)
        model = sg.keras.Model(module)
        model.compile(
            sg.keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
            loss=sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=10,
        )
    window: dict = {}

    def mark() -> tuple[float, int, float | None]:
        (stats,) = strategy.ps_stats() if reports else [{"steps": 0}]
        return time.perf_counter(), stats["steps"], job_cpu_seconds()

    class Timed(sg.keras.callbacks.Callback):
        """The timed part: from the end of the first epoch (the workers' datasets made, each
        worker's first functions run: a coordinated fit makes them after it begins) until the
        end of the epoch that ends after ``--seconds`` (each epoch ends joining the workers)."""

        def on_epoch_end(self, epoch, logs=None):
            if "begin" not in window:
                window["begin"] = mark()
            elif time.perf_counter() - window["begin"][0] >= args.seconds:
                window["end"] = mark()
                self.model.stop_training = True

    fit = {"x": x, "y": y, "batch_size": BATCH, "verbose": 0}
    model.fit(**fit, epochs=1, steps_per_epoch=40)  # the connections, the ps's optimizer
    model.fit(**fit, epochs=1 << 20, steps_per_epoch=1000, callbacks=[Timed()])
    if reports:
        (t0, s0, c0), (t1, s1, c1) = window["begin"], window["end"]
        cpu_ms = per_update_ms(c0, c1, s1 - s0)
        print("RESULT " + json.dumps({"per_s": (s1 - s0) / (t1 - t0), "cpu_ms": cpu_ms}))


def coordinated_task(args: argparse.Namespace) -> None:
    """A task of a coordinated job: workers and the ps serve, the chief schedules."""
    import torch

    import stratagem as sg

    resolver = sg.distribute.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type in ("worker", "ps"):
        sg.distribute.Server(resolver).join()
        return
    strategy = sg.distribute.ParameterServerStrategy(resolver)
    coordinator = sg.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model, optimizer, x, y = build(sg, torch, 0)
    delay, stragglers = args.delay, args.stragglers
    steps_per_function = args.steps_per_function

    def batches():
        index = sg.distribute.coordinator.experimental_get_current_worker_index()
        generator = torch.Generator().manual_seed(index)
        while True:
            rows = torch.randint(0, len(x), (BATCH,), generator=generator)
            yield x[rows], y[rows]

    def step(iterator) -> None:
        for _ in range(steps_per_function):  # TF's steps_per_execution, in a custom loop
            begin = time.perf_counter()
            features, labels = next(iterator)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(features), labels).backward()
            index = sg.distribute.coordinator.experimental_get_current_worker_index()
            own_work(time.perf_counter() - begin, delay, stragglers and index == 2)
            optimizer.step()

    def empty() -> None:
        return None

    iterator = iter(coordinator.create_per_worker_dataset(batches))
    fn, fn_args = (empty, ()) if args.empty else (step, (iterator,))
    for _ in range(4):  # every worker's first call (its connections, the ps's optimizer)
        coordinator.schedule(fn, args=fn_args)
    coordinator.join()
    (before,) = strategy.ps_stats()
    cpu_before = job_cpu_seconds()
    outstanding: list = []
    done = 0
    start = time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        while len(outstanding) < 8:  # keep every worker busy: a few queued behind each
            outstanding.append(coordinator.schedule(fn, args=fn_args))
        outstanding.pop(0).fetch()
        done += 1
    coordinator.join()
    seconds = time.perf_counter() - start
    cpu_after = job_cpu_seconds()
    (after,) = strategy.ps_stats()
    done += len(outstanding)
    updates = done if args.empty else after["steps"] - before["steps"]
    cpu_ms = per_update_ms(cpu_before, cpu_after, updates)
    print("RESULT " + json.dumps({"per_s": updates / seconds, "cpu_ms": cpu_ms}), flush=True)


CPU_MS: dict[str, list[float]] = {}  # variant -> the job's CPU ms per update, per round


def job(variant: str, seconds: float, delay: float, steps_per_function: int) -> float:
    """One job's rate (its CPU per update kept in ``CPU_MS``). ``coordinated10`` is
    ``coordinated`` with ten steps per function; the ``tf_`` variants are TensorFlow's own
    coordinator on the same work (``coordinator_tf.py``, run by ``TF_PYTHON``)."""
    result = _job(variant, seconds, delay, steps_per_function)
    if result.get("cpu_ms") is not None:
        CPU_MS.setdefault(variant, []).append(float(result["cpu_ms"]))
    return float(result["per_s"])


def _job(variant: str, seconds: float, delay: float, steps_per_function: int) -> dict:
    if variant.endswith("10"):
        variant, steps_per_function = variant[:-2], 10
    if variant.startswith("tf_"):
        return tf_job(variant.removeprefix("tf_"), seconds, steps_per_function)
    if variant == "between_waker":
        with waking_process(*WAKER):
            return _job("between", seconds, delay, steps_per_function)
    common = ["--seconds", str(seconds), "--delay", str(delay)]
    common += ["--steps-per-function", str(steps_per_function)]
    if variant == "fit":  # fit10: Model.fit on the chief, steps_per_execution=10
        argv = ["--chief", "-n", "2", "--ps", "1", __file__, "--fit", "--coordinated"]
    elif variant == "between_fit":  # every worker runs Model.fit itself, the same arguments
        argv = ["-n", "2", "--ps", "1", __file__, "--fit"]
    elif variant == "empty":
        argv = ["--chief", "-n", "2", "--ps", "1", __file__, "--coordinated", "--empty"]
    elif variant == "between":
        argv = ["-n", "2", "--ps", "1", __file__, "--between", "--mode", "async"]
    elif variant == "coordinated":
        argv = ["--chief", "-n", "2", "--ps", "1", __file__, "--coordinated"]
    elif variant == "sync":
        argv = ["-n", "3", "--ps", "1", __file__, "--between", "--mode", "sync", "--stragglers"]
    else:  # coordinated3
        argv = ["--chief", "-n", "3", "--ps", "1", __file__, "--coordinated", "--stragglers"]
    return run_launcher_job(argv + common, timeout=seconds + 180)


TF_PYTHON: str | None = None  # --tf-python


def tf_job(variant: str, seconds: float, steps_per_function: int) -> dict:
    """TensorFlow's coordinator on the same work: ``coordinator_tf.py`` under ``TF_PYTHON``."""
    assert TF_PYTHON is not None
    argv = [TF_PYTHON, str(Path(__file__).with_name("coordinator_tf.py"))]
    argv += ["--seconds", str(seconds), "--steps-per-function", str(steps_per_function)]
    if variant == "empty":
        argv.append("--empty")
    # Its own process group, ended whole however this ends: the TF job's servers with it.
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out = proc.communicate(timeout=seconds + 300)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):  # the servers outlive the chief
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    found = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if not found:
        raise RuntimeError(f"{' '.join(argv)} printed no RESULT:\n{out}")
    return json.loads(found[-1].removeprefix("RESULT "))


@contextlib.contextmanager
def busy_processes(n: int) -> Iterator[None]:
    """``n`` processes spinning on a core each beside the jobs (a machine that is not idle)."""
    spin = "import time\nwhile True:\n    time.perf_counter()\n"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(n)]
    try:
        yield
    finally:
        for proc in procs:  # only the processes started here, by their own handle
            proc.kill()
            proc.wait()


WAKER = (700.0, 80.0)  # --waker: wake-ups per second, microseconds of CPU each


@contextlib.contextmanager
def waking_process(rate: float, busy_us: float) -> Iterator[None]:
    """A process beside the job that wakes ``rate`` times a second and spins ``busy_us``
    microseconds each time: what a coordinated job's chief does to the machine, without its
    work (at ten steps per function on 2 workers its threads wake about 700 times a second
    and use about 5.5 % of a core, 80 us a wake-up)."""
    wake = (
        "import time\n"
        "while True:\n"
        f"    time.sleep({1.0 / rate!r})\n"
        "    t = time.thread_time()\n"
        f"    while time.thread_time() - t < {busy_us / 1e6!r}:\n"
        "        pass\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", wake])
    try:
        yield
    finally:
        proc.kill()  # the process started here, by its own handle
        proc.wait()


def main() -> None:
    global WAKER  # --waker, read before it is set
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--between", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--coordinated", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--empty", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fit", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="async", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=8.0, help="training time per job")
    parser.add_argument("--delay", type=float, default=0.03, help="injected step time, seconds")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every variant")
    parser.add_argument(
        "--steps-per-function", type=int, default=1, help="training steps per scheduled function"
    )
    parser.add_argument("--stragglers", action="store_true", help="also the straggler pair")
    parser.add_argument("--quick", action="store_true", help="1 short round")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--load", type=int, default=0, help="busy processes (one core each) beside the jobs"
    )
    parser.add_argument(
        "--variants",
        help="comma-separated subset of empty,between,coordinated (all by default), and "
        "coordinated10 (ten steps per function), fit10 and between_fit (Model.fit with "
        "steps_per_execution=10 on the chief of a coordinated job, or on every worker), "
        "between_waker (between beside a process that wakes and spins as a chief does: --waker)",
    )
    parser.add_argument(
        "--waker",
        default=",".join(f"{v:g}" for v in WAKER),
        help="the process beside between_waker: wake-ups per second, microseconds of CPU each",
    )
    parser.add_argument(
        "--tf-python",
        help="a Python with tensorflow-cpu: also TF's own coordinator on the same work, in "
        "the same rounds (empty, one and ten steps per function; --delay 0), ratios ours/TF",
    )
    args = parser.parse_args()
    if args.fit:
        fit_task(args)
        return
    if args.between:
        between_task(args)
        return
    if args.coordinated:
        coordinated_task(args)
        return
    rate, busy_us = (float(v) for v in args.waker.split(","))
    WAKER = (rate, busy_us)
    rounds, seconds = (1, 1.0) if args.quick else (args.rounds, args.seconds)
    names = ["empty", "between", "coordinated"]
    if args.tf_python:
        global TF_PYTHON
        TF_PYTHON = args.tf_python
        if args.delay != 0:
            parser.error("--tf-python compares the work itself: give --delay 0")
        names += ["coordinated10", "tf_empty", "tf_coordinated", "tf_coordinated10"]
    if args.stragglers:
        names += ["sync", "coordinated3"]
    if args.variants:
        wanted = args.variants.split(",")
        every = [*names, "coordinated10", "fit10", "between_fit", "between_waker"]
        names = [n for n in dict.fromkeys(every) if n in wanted]
    with busy_processes(args.load):
        samples = rotated_rounds(
            {n: (lambda n=n: job(n, seconds, args.delay, args.steps_per_function)) for n in names},
            rounds,
            "per s",
        )
    medians = {n: statistics.median(v) for n, v in samples.items()}
    ratios = {}
    if "coordinated" in samples and "between" in samples:
        ratios["coordinated / between"] = median_round_ratio(samples, "coordinated", "between")
    if args.tf_python:
        for name in ("empty", "coordinated", "coordinated10"):
            if name in samples and f"tf_{name}" in samples:  # --variants may pick a subset
                ratios[f"{name} / tf_{name}"] = median_round_ratio(samples, name, f"tf_{name}")
    if "coordinated10" in samples and "between" in samples:
        ratios["coordinated10 / between"] = median_round_ratio(samples, "coordinated10", "between")
    if "between_waker" in samples and "between" in samples:
        # What a process that wakes and spins as a coordinated job's chief does costs a
        # between-graph job here: the part of coordinated10 / between that is not the path
        # of a function through the chief, the worker and the ps.
        ratios["between_waker / between"] = median_round_ratio(samples, "between_waker", "between")
    if "fit10" in samples and "between_fit" in samples:
        ratios["fit10 / between_fit"] = median_round_ratio(samples, "fit10", "between_fit")
    if args.stragglers:
        ratios["coordinated3 / sync"] = median_round_ratio(samples, "coordinated3", "sync")
    if "empty" in medians:
        print(f"\nempty functions/s on 2 workers: {medians['empty']:.0f}")
    cpu = {n: statistics.median(v) for n, v in CPU_MS.items() if len(v) == len(samples[n])}
    print("| variant | updates/s (median) | CPU ms per update (median) |\n| --- | --- | --- |")
    for name in [n for n in names if n != "empty"]:
        print(f"| {name} | {medians[name]:.1f} | {cpu.get(name, float('nan')):.3f} |")
    # The CPU per update of every process of the job (/proc), a steadier figure than a rate
    # where other jobs share the machine: a job that needs less CPU per update is the faster
    # one on a machine it fills. Each ratio is the base's CPU over the variant's (higher is
    # better, as with the rates), the median over rounds.
    pairs = [
        ("coordinated10", "between"),
        ("coordinated10", "tf_coordinated10"),
        ("fit10", "between_fit"),
    ]
    for name, base in pairs:
        if name in cpu and base in cpu:
            ratio = statistics.median(b / a for a, b in zip(CPU_MS[name], CPU_MS[base]))
            print(f"CPU per update, {base} / {name}: {ratio:.2f}")
    targets = {"coordinated / between": 0.8, "coordinated3 / sync": 1.8}
    targets |= {"empty / tf_empty": 1.5, "coordinated / tf_coordinated": 1.2}
    targets |= {"coordinated10 / tf_coordinated10": 1.2, "coordinated10 / between": 0.9}
    targets |= {"fit10 / between_fit": 0.9}
    if args.delay == 0:
        # The 0.8 is for steps with work of their own (--delay): a step of about 1 ms is
        # mostly dispatch, which one step per function pays in full (docs/benchmarks.md).
        del targets["coordinated / between"]
    for what, ratio in ratios.items():
        if what not in targets:
            print(f"{what}: {ratio:.2f}")
            continue
        met = "met" if ratio >= targets[what] else "NOT met"
        print(f"{what}: {ratio:.2f} (target >= {targets[what]}): {met}")
    print(f"load average at the end: {os.getloadavg()[0]:.1f} (--load {args.load})")
    if args.json:
        results = {"samples": samples, "ratios": ratios, "cpu_ms": CPU_MS}
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
