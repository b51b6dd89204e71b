"""A ClusterCoordinator job: `stratagem run --chief -n 2 --ps 1 coordinator_job.py OUT [kill]`.

Workers and the ps serve (``sg.distribute.Server(...).join()``, TF's signature); the chief
schedules functions capturing tensors, plain data, modules and functions, reads worker indices,
uses a per-worker dataset, provokes each error, and writes what it saw to OUT/result.json.
With ``kill``, worker 1 kills itself (-9) inside a function at the end: that function runs
again on worker 0, and every function completes once.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

import stratagem as sg

OUT = Path(sys.argv[1])
KILL = "kill" in sys.argv[2:]
SCALE = torch.tensor([1.0, 2.0, 3.0])
CONFIG = {"offset": 10, "pair": (1, 2)}

resolver = sg.distribute.cluster_resolver.TFConfigClusterResolver()
if resolver.task_type in ("worker", "ps"):
    server = sg.distribute.Server(
        resolver.cluster_spec(),
        job_name=resolver.task_type,
        task_index=resolver.task_id,
        protocol="grpc",
        start=True,
    )
    server.join()
    sys.exit(0)


def helper(x: int) -> int:
    return x * 2


def step(x: torch.Tensor, factor: int = 3) -> dict:
    return {
        "sum": (SCALE * x).sum() + CONFIG["offset"],
        "helper": helper(factor),
        "pair": CONFIG["pair"],
        "sqrt": math.sqrt(16),
    }


def wait_for_both(path: str) -> int:
    """Blocks until both workers run one of these: each worker gets one (one in flight each)."""
    me = sg.distribute.coordinator.experimental_get_current_worker_index()
    Path(path, f"worker-{me}").touch()
    deadline = time.monotonic() + 120
    while len(list(Path(path).glob("worker-*"))) < 2:
        if time.monotonic() > deadline:
            raise TimeoutError("the other worker never ran its function")
        time.sleep(0.05)
    return me


def dataset_fn() -> list[torch.Tensor]:
    base = 1000 * sg.distribute.coordinator.experimental_get_current_worker_index()
    return [torch.tensor(float(base + i)) for i in range(50)]


def read(iterator) -> list:
    return [sg.distribute.coordinator.experimental_get_current_worker_index(), next(iterator)]


def failing_dataset_fn() -> list[int]:
    if sg.distribute.coordinator.experimental_get_current_worker_index() == 1:
        raise OSError("no data on this worker")
    return [1]


def opened(gate: str, never: str = "the chief never opened the gate") -> None:
    """Wait until the chief opens ``gate`` (a file); ``never``: the error if it does not."""
    deadline = time.monotonic() + 120
    while not Path(gate).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(never)
        time.sleep(0.02)


def hold(release: str) -> str:
    opened(release, "the chief never released this function")
    return "held"


def ignores(anything: object) -> str:
    return "ran"


def boom_at(gate: str) -> int:
    opened(gate)
    raise ValueError("boom 8")


class OpensTheGate(sg.shipping.Portable):
    """An argument whose description (on the chief, inside schedule) lets ``boom_at`` fail and
    waits until the chief has seen it fail."""

    def __init__(self, gate: str, failing: object) -> None:
        self.gate, self.failing = gate, failing

    def _sg_portable_state(self) -> dict:
        Path(self.gate).touch()
        try:
            self.failing.fetch()
        except sg.distribute.coordinator.FunctionError:
            pass
        return {"gate": self.gate}


def make_lock() -> object:
    return threading.Lock()


def boom(x: int, gate: str) -> int:
    raise ValueError(f"boom {x}") from opened(gate)  # fails once the chief opens the gate


def expect(error_type: type, call, *words: str) -> str:
    try:
        call()
    except error_type as e:
        text = str(e)
        missing = [w for w in words if w not in text]
        assert not missing, (missing, text)
        return text
    raise AssertionError(f"{call} raised no {error_type.__name__}")


def main() -> None:
    strategy = sg.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = sg.distribute.coordinator.ClusterCoordinator(strategy)
    result: dict = {}

    # Closures: a nested function reading a local (its cell), a default, a tensor argument.
    bias = torch.tensor(0.5)

    def with_closure(x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return x * scale + bias

    def on_worker_strategy() -> int:
        return strategy.num_replicas_in_sync + len(strategy.run(lambda: [1, 2]))

    values = [coordinator.schedule(step, args=(torch.tensor(float(i)),)) for i in range(4)]
    closure_value = coordinator.schedule(with_closure, args=(torch.ones(2),), kwargs={"scale": 3.0})
    strategy_value = coordinator.schedule(on_worker_strategy)
    both = [coordinator.schedule(wait_for_both, args=(str(OUT),)) for _ in range(2)]
    coordinator.join()
    assert coordinator.done()
    fetched = coordinator.fetch(values)
    result["sums"] = [float(v["sum"]) for v in fetched]
    result["helper"] = fetched[0]["helper"]
    result["pair"] = list(fetched[0]["pair"])
    result["pair_is_tuple"] = isinstance(fetched[0]["pair"], tuple)
    result["sqrt"] = fetched[0]["sqrt"]
    result["closure"] = closure_value.fetch().tolist()
    result["strategy"] = strategy_value.get()
    result["worker_indices"] = sorted(coordinator.fetch(both))

    # A per-worker dataset: each worker's own data, its own iterator.
    per_worker = coordinator.create_per_worker_dataset(dataset_fn)
    iterator = iter(per_worker)
    reads = [coordinator.schedule(read, args=(iterator,)) for _ in range(8)]
    coordinator.join()
    result["reads"] = [[w, float(v)] for w, v in coordinator.fetch(reads)]

    # Errors. Worker A holds `hold` until the chief lets it go, worker B runs `boom`, which
    # fails only once the chief opens its gate: `later` is queued by then, so it is cancelled
    # (no timing decides it; a boom free to fail at once could fail before `later` was
    # scheduled on a busy machine, and schedule() would raise its error).
    release, gate = OUT / "release", OUT / "boom-gate"
    holding = coordinator.schedule(hold, args=(str(release),))
    failed = coordinator.schedule(boom, args=(7, str(gate)))
    later = coordinator.schedule(helper, args=(1,))
    gate.touch()
    result["fetch_error"] = expect(
        sg.distribute.coordinator.FunctionError,
        failed.fetch,
        "boom (coordinator_job.py:",
        "ValueError",
        "boom 7",
        "The worker's traceback",
        f'line {boom.__code__.co_firstlineno + 1}, in boom\n    raise ValueError(f"boom {{x}}")',
    )
    result["cancelled"] = expect(
        sg.distribute.coordinator.CancelledError, later.fetch, "cancelled", "boom 7"
    )
    release.touch()
    result["join_error"] = expect(
        sg.distribute.coordinator.FunctionError, coordinator.join, "boom 7"
    )
    # `hold` was running when boom failed: cancelled (TF cancels in-flight functions); its
    # worker let it run to its end (it reads no iterator and takes no step), its value not taken.
    result["held_cancelled"] = expect(
        sg.distribute.coordinator.CancelledError, holding.fetch, "was cancelled while it ran"
    )
    assert coordinator.done()  # the error was raised once, then cleared

    # A function scheduled while another fails: the failure lands after schedule() checked for
    # one and before it queued the function (here, while its argument is described). It is
    # cancelled with the queued ones, not left behind the pending error where no worker takes
    # it (its fetch() hung). The argument's description opens the gate and waits for the failure.
    gate = OUT / "gate"
    failing = coordinator.schedule(boom_at, args=(str(gate),))
    raced = coordinator.schedule(ignores, args=(OpensTheGate(str(gate), failing),))
    result["raced_settled_at_once"] = raced._done.is_set()
    if result["raced_settled_at_once"]:
        result["raced"] = expect(sg.distribute.coordinator.CancelledError, raced.fetch, "boom 8")
        expect(sg.distribute.coordinator.FunctionError, coordinator.join, "boom 8")
    else:  # left in the queue: join raises and clears the error, then a worker runs it
        expect(sg.distribute.coordinator.FunctionError, coordinator.join, "boom 8")
        result["raced"] = f"ran: {raced.fetch()}"
    lock = threading.Lock()

    def unsendable() -> bool:
        return lock.locked()

    result["unsendable"] = expect(
        TypeError,
        lambda: coordinator.schedule(unsendable),
        "unsendable",
        "cannot be sent",
        "'lock'",
        "_thread.lock",
    )

    def schedules_from_a_worker() -> None:
        coordinator.schedule(helper, args=(1,))

    # A RemoteValue argument whose function failed (cancelled): the function does not run,
    # and join raises TF's ClosureInputError naming the input's failure.
    coordinator.schedule(helper, args=(holding,))
    result["remote_arg"] = expect(
        sg.distribute.coordinator.ClosureInputError,
        coordinator.join,
        "Input has an error",
        "was cancelled while it ran",
    )
    returns_a_lock = coordinator.schedule(make_lock)
    result["not_plain"] = expect(
        sg.distribute.coordinator.FunctionError,
        returns_a_lock.fetch,
        "make_lock (coordinator_job.py:",
        "raised TypeError",
        "the function's return value",
    )
    expect(sg.distribute.coordinator.FunctionError, coordinator.join, "make_lock")
    from_worker = coordinator.schedule(schedules_from_a_worker)
    result["from_worker"] = expect(
        sg.distribute.coordinator.FunctionError,
        from_worker.fetch,
        "ClusterCoordinator.schedule was called from a function running on worker",
        "only the chief",
    )
    # The next schedule raises the pending error (then it is cleared), as TF's does.
    expect(
        sg.distribute.coordinator.FunctionError,
        lambda: coordinator.schedule(helper, args=(1,)),
        "only the chief",
    )
    assert coordinator.done()
    coordinator.create_per_worker_dataset(failing_dataset_fn)
    result["dataset_error"] = expect(
        sg.distribute.coordinator.FunctionError,
        coordinator.join,
        "dataset_fn failing_dataset_fn (coordinator_job.py:",
        "failed on worker 1 (",
        "OSError: no data on this worker",
        "The worker's traceback",
    )
    coordinator.join()  # nothing left failing

    if KILL:
        # Worker 1 ends (-9) inside its first function; that function runs again on worker 0.
        marker = str(OUT / "killed")
        counted = [coordinator.schedule(dies_once_on_worker_1, args=(i, marker)) for i in range(6)]
        coordinator.join()
        result["after_kill"] = sorted(coordinator.fetch(counted))
        result["killed"] = Path(marker).exists()
    result["completed"] = coordinator.completed
    (OUT / "result.json").write_text(json.dumps(result))
    print("coordinator job done", flush=True)


def dies_once_on_worker_1(i: int, marker: str) -> int:
    me = sg.distribute.coordinator.experimental_get_current_worker_index()
    if me == 1 and not Path(marker).exists():
        Path(marker).touch()
        os.kill(os.getpid(), signal.SIGKILL)
    # Worker 0 holds its first function until worker 1 has taken one (one in flight each).
    deadline = time.monotonic() + 120
    while not Path(marker).exists():
        if time.monotonic() > deadline:
            raise TimeoutError("worker 1 never took a function")
        time.sleep(0.05)
    return i


main()
