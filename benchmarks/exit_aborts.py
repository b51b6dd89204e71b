"""How often a gloo job's process aborts at its exit, without and with stratagem's drain.

Each round runs two 2-process jobs side by side in turn: both do 50 functional all-reduces on a
group they hold (as DTensor issues them, on a ``DeviceMesh``'s group) and exit at once; one
exits as plain torch does, the other first waits for gloo's worker threads
(``stratagem.comm.gloo_drain``, what a job's process does at exit). A process that dies with
SIGABRT ("terminate called without an active exception") is counted.

    python benchmarks/exit_aborts.py --rounds 40     # 80 exits each way
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import clean_env, free_port

SRC = Path(__file__).resolve().parents[1] / "src"


# What a script keeps at module level (its mesh, its last tensors) lives until the interpreter
# shuts down: a worker's group and results are kept here so that the exit meets them as it meets
# a script's.
_KEPT: list[object] = []


def worker(rank: int, port: int, drain: bool) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])  # held until exit, as a DeviceMesh holds its groups
    for i in range(50):
        # A temporary input, as DTensor's redistributions pass: its Python object dies first.
        y = fc.all_reduce(torch.ones(1000) * i, "sum", group) + 1
    assert float(y[0]) == 2 * 49 + 1
    # The last collective right before the exit, as a script's last step ends.
    y = fc.all_reduce(torch.ones(1000), "sum", group) * 1
    _KEPT.extend((group, y))
    if drain:
        from stratagem.comm.gloo_drain import wait_for_gloo_threads

        wait_for_gloo_threads()


def job(drain: bool) -> list[int]:
    port = free_port()
    env = clean_env({"PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"})
    argv = [sys.executable, __file__, "--worker", str(port), "drain" if drain else "plain"]
    procs = [
        subprocess.Popen([*argv, str(rank)], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
        for rank in range(2)
    ]  # fmt: skip
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=120))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            codes.append(p.wait())
    return codes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="2 rounds (a test's run)")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)  # port, mode, rank
    args = parser.parse_args()
    if args.worker:
        port, mode, rank = args.worker
        worker(int(rank), int(port), mode == "drain")
        return 0
    rounds = 2 if args.quick else args.rounds
    aborts = {"plain": 0, "drain": 0}
    other = {"plain": 0, "drain": 0}
    for r in range(rounds):
        order = ("plain", "drain") if r % 2 == 0 else ("drain", "plain")
        for way in order:
            for code in job(way == "drain"):
                if code == -signal.SIGABRT:
                    aborts[way] += 1
                elif code != 0:
                    other[way] += 1
        print(f"round {r + 1}/{rounds}: aborts {aborts}, other failures {other}", flush=True)
    exits = 2 * rounds
    print("\n| exit | processes | SIGABRT | other failures |\n| --- | --- | --- | --- |")
    print(f"| plain torch | {exits} | {aborts['plain']} | {other['plain']} |")
    print(f"| gloo threads drained first | {exits} | {aborts['drain']} | {other['drain']} |")
    return 1 if aborts["drain"] or other["drain"] or other["plain"] else 0


if __name__ == "__main__":
    sys.exit(main())
