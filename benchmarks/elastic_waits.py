"""What an elastic job's way of waiting for collectives costs: MWMS jobs side by side in one
run, one with ``STRATAGEM_ELASTIC=1`` (collectives waited in slices, as under
``stratagem run -n MIN:MAX``), one with ``0`` (gloo's blocking wait).

Each pass starts one job of each (two workers each, TF_CONFIG on this machine); they run a
``fit`` pass of a small MLP (global batch 64), then 256 KiB all-reduces on the strategy's
communicator, taking turns step by step (all-reduce by all-reduce), who goes first alternating,
so that both meet the same load. Each worker times its step or all-reduce; the shorter counts
(the one that got the word last waited for no one). A pass's ratio is the median over its pairs
of elastic / blocking; the run's, the median over passes (new jobs each pass: a job's lasting
bias, where its processes run, varies as the load does). Target: at most 1.02. ``--control``
starts both jobs with ``STRATAGEM_ELASTIC=0``: what two identical jobs differ by here.

    python benchmarks/elastic_waits.py              # about 2 minutes on 2 cores
    python benchmarks/elastic_waits.py --control
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import STABLE_MALLOC, clean_env, free_port

GLOBAL_BATCH = 64
NAMES = ("blocking", "elastic")


# ----------------------------------------------------------------------------- a worker


def _mlp(sg):
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Linear(784, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
    model = sg.keras.Model(module)
    model.compile(
        sg.keras.optimizers.SGD(0.01),
        sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _go() -> None:
    """Wait for the driver's word to run the next step or all-reduce."""
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("expected go: the driver ended or lost its place")


def _answer(figures: dict) -> None:
    print(json.dumps(figures), flush=True)


def _fit_steps(sg, model, x, y) -> None:
    """One ``fit`` pass over ``x``, each step on the driver's word; its seconds answered."""

    class Clock(sg.keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
            _go()
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            _answer({"step_s": time.perf_counter() - self.start})

    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[Clock()])  # fmt: skip


def _all_reduces(comm, count: int, floats: int) -> None:
    """``count`` all-reduces of ``floats`` on the strategy's communicator (what ``fit``'s
    gradient buckets use), each on the driver's word; wall and main-thread CPU seconds."""
    value = torch.ones(floats)
    for _ in range(count):
        _go()
        wall, cpu = time.perf_counter(), time.thread_time()
        comm.all_reduce(value, what="the benchmark's tensor")
        _answer({"reduce_s": time.perf_counter() - wall, "cpu_s": time.thread_time() - cpu})


def worker(rank: int, port: int, steps: int, reduces: int, floats: int) -> None:
    """One worker of one job: runs each command on stdin (``fit``, ``reduce``, ``quit``), a
    step or an all-reduce per ``go``."""
    import stratagem as sg

    os.environ["TF_CONFIG"] = json.dumps(
        {
            "cluster": {"worker": [f"localhost:{port}", f"localhost:{port + 1}"]},
            "task": {"type": "worker", "index": rank},
        }
    )
    strategy = sg.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = _mlp(sg)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(steps * GLOBAL_BATCH, 784, generator=g)
    y = torch.randint(0, 10, (steps * GLOBAL_BATCH,), generator=g)
    print("READY", flush=True)
    while command := sys.stdin.readline().strip():
        if command == "fit":
            _fit_steps(sg, model, x, y)
        elif command == "reduce":
            _all_reduces(strategy.extended.communicator, reduces, floats)
        elif command == "quit":
            return
        else:
            raise SystemExit(f"unknown command {command!r}; expected fit, reduce or quit")


# ----------------------------------------------------------------------------- the run


class Job:
    """Two worker processes with one value of ``STRATAGEM_ELASTIC``, driven line by line."""

    def __init__(self, elastic: str, worker_args: list[str]) -> None:
        port = free_port()
        # One intra-op thread, as the launcher gives its tasks: on a loaded machine a torch op's
        # thread pool waits for threads the scheduler has not run yet, tens of ms a time.
        env = clean_env({**STABLE_MALLOC, "OMP_NUM_THREADS": "1", "STRATAGEM_ELASTIC": elastic})
        argv = [sys.executable, __file__, *worker_args]
        self.procs = [
            subprocess.Popen(
                [*argv, "--worker", str(rank), str(port)],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            for rank in range(2)
        ]

    def _line(self, proc: subprocess.Popen) -> str:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a worker ended (exit code {proc.wait()}) before answering")
        return line.strip()

    def ready(self) -> None:
        for proc in self.procs:
            while (line := self._line(proc)) != "READY":
                print(line, flush=True)  # whatever the worker printed while starting

    def say(self, line: str) -> None:
        for proc in self.procs:
            proc.stdin.write(line + "\n")
            proc.stdin.flush()

    def tick(self) -> dict:
        """One step or all-reduce of both workers: the shorter wall time (the worker that got
        the word last waited for no one) and the mean main-thread CPU."""
        self.say("go")
        answers = [json.loads(self._line(proc)) for proc in self.procs]
        return {
            key: (min if key != "cpu_s" else statistics.fmean)(a[key] for a in answers)
            for key in answers[0]
        }

    def end(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.stdin.write("quit\n")
                    proc.stdin.close()
                except OSError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def one_pass(p: int, args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Two new jobs: a fit pass of ``args.steps`` steps, then ``args.reduces`` all-reduces,
    the jobs taking turns step by step (all-reduce by all-reduce), who goes first alternating;
    each job's samples."""
    worker_args = [f"--{k}={getattr(args, k)}" for k in ("steps", "reduces", "floats")]
    jobs = {
        "blocking": Job("0", worker_args),
        "elastic": Job("0" if args.control else "1", worker_args),
    }
    samples: dict[str, dict[str, list[float]]] = {n: {} for n in NAMES}
    try:
        for job in jobs.values():
            job.ready()
        for command, count in (("fit", args.steps), ("reduce", args.reduces)):
            for job in jobs.values():
                job.say(command)
            for i in range(count):
                for name in NAMES if (i + p) % 2 == 0 else NAMES[::-1]:
                    for key, value in jobs[name].tick().items():
                        samples[name].setdefault(key, []).append(value)
    finally:
        for job in jobs.values():
            job.end()
    return samples


def measure(args: argparse.Namespace) -> dict:
    """``args.passes`` passes, each with new jobs: a job's own lasting bias (where its
    processes run, how their memory fell) differs from pass to pass, as the load does."""
    medians: dict[str, dict[str, list[float]]] = {n: {} for n in NAMES}
    ratios: dict[str, list[float]] = {}
    for p in range(args.passes):
        samples = one_pass(p, args)
        for key in samples["blocking"]:
            for n in NAMES:
                medians[n].setdefault(key, []).append(statistics.median(samples[n][key]))
            pairs = zip(samples["elastic"][key], samples["blocking"][key])
            ratios.setdefault(key, []).append(statistics.median(e / b for e, b in pairs))
        print(
            f"pass {p + 1}/{args.passes}: median step "
            + ", ".join(f"{n} {medians[n]['step_s'][-1] * 1e3:.2f}" for n in NAMES)
            + " ms; median all-reduce "
            + ", ".join(f"{n} {medians[n]['reduce_s'][-1] * 1e6:.0f}" for n in NAMES)
            + " us; ratios "
            + ", ".join(f"{k} {v[-1]:.3f}" for k, v in ratios.items()),
            flush=True,
        )
    return {
        "control": args.control,
        "floats": args.floats,
        "pass_medians": medians,
        "pass_ratios": ratios,
        "medians": {n: {k: statistics.median(v) for k, v in medians[n].items()} for n in NAMES},
        "ratios": {k: statistics.median(v) for k, v in ratios.items()},
    }


def report(results: dict) -> None:
    m, ratio = results["medians"], results["ratios"]
    other = "STRATAGEM_ELASTIC=0 (control)" if results["control"] else "STRATAGEM_ELASTIC=1"
    print(f"\n| measure | STRATAGEM_ELASTIC=0 | {other} | ratio (median of the passes) |")
    print("| --- | --- | --- | --- |")
    nbytes = results["floats"] * 4
    size = f"{nbytes // 1024} KiB" if nbytes >= 1024 else f"{nbytes} bytes"
    rows = (
        ("MWMS fit step, MLP 270k params, batch 64", "step_s", 1e3, "ms"),
        (f"all-reduce of {size}", "reduce_s", 1e6, "us"),
        (f"main-thread CPU per all-reduce of {size}", "cpu_s", 1e6, "us"),
    )
    for label, key, scale, unit in rows:
        b, e = m["blocking"][key] * scale, m["elastic"][key] * scale
        print(f"| {label} | {b:.2f} {unit} | {e:.2f} {unit} | {ratio[key]:.3f} |")
    print(
        f"\nratio elastic / blocking: fit step {ratio['step_s']:.3f}, all-reduce "
        f"{ratio['reduce_s']:.3f} (target <= 1.02)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40, help="fit steps per pass")
    parser.add_argument("--reduces", type=int, default=200, help="all-reduces per pass")
    parser.add_argument("--floats", type=int, default=1 << 16, help="per all-reduce (256 KiB)")
    parser.add_argument("--control", action="store_true", help="both jobs STRATAGEM_ELASTIC=0")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for the whole run")
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument(
        "--worker", nargs=2, type=int, metavar=("RANK", "PORT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker, steps=args.steps, reduces=args.reduces, floats=args.floats)
        return
    # Whatever happens (a hung worker), the run ends: the workers are in their own groups,
    # ended by Job.end; this ends the run itself.
    watchdog = threading.Timer(args.timeout, lambda: os.kill(os.getpid(), signal.SIGINT))
    watchdog.daemon = True
    watchdog.start()
    results = measure(args)
    watchdog.cancel()
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
