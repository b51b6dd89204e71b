"""A worker restarted alone rejoins a ClusterCoordinator job.

`stratagem run --chief -n 2 --ps 1 --restart-workers 3 coordinator_restart_job.py OUT`

Worker 1 kills itself (-9) inside a function; the launcher restarts it (incarnation 2); the
chief reconnects, the new worker remakes the per-worker dataset and iterator, and takes work
again. Then the chief kills worker 1 (-9) while it is idle, between two joins: the chief
finds the loss when it next sends it a function, and incarnation 3 takes work again. Last,
the chief kills both workers while idle: with no worker left it waits for a restarted one
(``--restart-workers``) instead of failing, and both come back. No step
waits on a clock: worker 0 holds each of its functions until worker 1 has done what the step
is about (a marker file), so a worker that never comes back fails the job with a
named TimeoutError instead of passing. The chief writes what it saw to OUT/result.json.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

import stratagem as sg

OUT = sys.argv[1]  # a str: a scheduled function may capture plain data
WAIT_S = 120  # a bound on each hold, far above the few seconds a restart takes

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


def me() -> int:
    return sg.distribute.coordinator.experimental_get_current_worker_index()


def wait_for(path: Path, why: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker {me()} waited {WAIT_S} s for {why}")
        time.sleep(0.05)


def dataset_fn() -> list[torch.Tensor]:
    # Each incarnation builds its dataset afresh: worker 1's starts again at 1000.
    return [torch.tensor(float(1000 * me() + i)) for i in range(50)]


def read(iterator, i: int) -> list:
    """Before the kill: one read on each worker (each holds until the other has read)."""
    value = float(next(iterator))
    Path(OUT, f"read-{me()}").touch()
    wait_for(Path(OUT, f"read-{1 - me()}"), f"worker {1 - me()}'s first read")
    return [i, me(), value]


def dies_once_on_worker_1(i: int) -> list:
    """Worker 1 ends (-9) inside its first one (it runs again elsewhere, once)."""
    killed = Path(OUT, "killed")
    if me() == 1 and not killed.exists():
        killed.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    wait_for(killed, "worker 1 to take a function")
    return [i, me()]


def after_restart(i: int, iterator) -> list:
    """After the kill: worker 0 holds until the restarted worker 1 has run one of these."""
    value = float(next(iterator))
    Path(OUT, f"after-{me()}-{i}").touch()
    if me() == 0 and not list(Path(OUT).glob("after-1-*")):
        wait_for_any(Path(OUT), "after-1-*", "the restarted worker 1 to take a function")
    return [i, me(), value, os.getpid()]


def after_idle_kill(i: int, iterator) -> list:
    """After worker 1 was killed idle: worker 0 holds until incarnation 3 has run one."""
    value = float(next(iterator))
    Path(OUT, f"idle-{me()}-{i}").touch()
    if me() == 0:
        wait_for_any(Path(OUT), "idle-1-*", "worker 1's third incarnation to take a function")
    return [i, me(), value, os.getpid()]


def after_all_lost(i: int) -> list:
    """After both workers were killed: each new incarnation holds until the other has one."""
    Path(OUT, f"all-{me()}").touch()
    wait_for(Path(OUT, f"all-{1 - me()}"), f"worker {1 - me()} to come back too")
    return [i, me(), os.getpid()]


def wait_for_any(folder: Path, pattern: str, why: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not list(folder.glob(pattern)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker {me()} waited {WAIT_S} s for {why}")
        time.sleep(0.05)


def wait_until_dead(pid: int) -> None:
    """Until ``pid`` has exited (gone, or a zombie its launcher has not reaped yet)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return
        time.sleep(0.02)
    raise TimeoutError(f"worker 1 (pid {pid}) did not die of SIGKILL in {WAIT_S} s")


def main() -> None:
    strategy = sg.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = sg.distribute.coordinator.ClusterCoordinator(strategy)
    per_worker = coordinator.create_per_worker_dataset(dataset_fn)
    iterator = iter(per_worker)
    reads = [coordinator.schedule(read, args=(iterator, i)) for i in range(2)]
    coordinator.join()
    killed = [coordinator.schedule(dies_once_on_worker_1, args=(i,)) for i in range(4)]
    coordinator.join()
    after = [coordinator.schedule(after_restart, args=(i, iterator)) for i in range(4)]
    coordinator.join()
    # Worker 1 (its second incarnation, whose pid the chief's view now holds) dies idle.
    second_pid = strategy.extended.world.pid("worker", 1)
    os.kill(second_pid, signal.SIGKILL)
    wait_until_dead(second_pid)  # so no function reaches it: it is lost while idle
    idle = [coordinator.schedule(after_idle_kill, args=(i, iterator)) for i in range(4)]
    coordinator.join()
    # Both workers die idle: the coordinator has none left until the launcher restarts them.
    all_killed = [strategy.extended.world.pid("worker", w) for w in (0, 1)]
    for pid in all_killed:
        os.kill(pid, signal.SIGKILL)
    for pid in all_killed:
        wait_until_dead(pid)
    all_lost = [coordinator.schedule(after_all_lost, args=(i,)) for i in range(4)]
    coordinator.join()
    result = {
        "reads": coordinator.fetch(reads),
        "killed": coordinator.fetch(killed),
        "after": coordinator.fetch(after),
        "second_pid": second_pid,
        "idle": coordinator.fetch(idle),
        "all_killed": all_killed,
        "all_lost": coordinator.fetch(all_lost),
        "completed": coordinator.completed,
        "chief_pid": os.getpid(),
    }
    Path(OUT, "result.json").write_text(json.dumps(result))
    print("restart job done", flush=True)


main()
