"""What a MultiWorkerMirroredStrategy start costs in messages, counted (not timed) at N processes.

Each task of a ``stratagem run -n N`` job (with the job secret the launcher gives it, so every
store request goes through the sealed store, torch's gloo set-up included) counts, from process
start to the end of its first all-reduce:

- its requests to the rendezvous store (round trips), by kind (``set``, ``get``, ``check``,
  ``multi_get``, ``compare_set``, ``wait``, ...): all of them land on the one process that
  hosts the store (worker 0), so their sum over the tasks is that process's load. The
  ``check`` count includes the roll call's polls while peers are still starting, so it
  depends on how the processes' starts spread (load); the rest does not;
- the TCP connections it holds afterwards (gloo's full mesh, the store client, its liveness
  server's listener);
- the peers it challenges with the job secret (``comm.peer_check``: one all-to-all out and one
  back).

Liveness probes are not part of a start: each survivor of a failure probes every peer once
(``probe_all``), N - 1 connections, so N(N - 1) over a job that loses one task.

The model these counts check is in docs/architecture.md ("Start-up at scale").

    python benchmarks/startup_counts.py                  # N = 2, 4, 8, 16, 32
    python benchmarks/startup_counts.py --sizes 2 4      # a smoke run
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import clean_env, run_in_own_group

_STORE_CALLS = (
    "set",
    "get",
    "check",
    "multi_get",
    "multi_set",
    "add",
    "compare_set",
    "append",
    "wait",
    "delete_key",
    "num_keys",
)


def _sockets() -> int:
    """The TCP sockets this process holds (Linux: the socket entries of /proc/self/fd)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            continue
    return count


def task() -> None:
    """One task: count what the strategy's start and one all-reduce cost; print ``RESULT``."""
    import torch

    from stratagem.comm import peer_check, sealed_store

    calls: collections.Counter[str] = collections.Counter()

    class Counted:
        """The sealed store's TCPStore, each request counted: one round trip each (the sealed
        store's ``add`` is a get, a check and a compare_set of its base, counted as such)."""

        def __init__(self, base):
            self._base = base

        def __getattr__(self, name):
            attr = getattr(self._base, name)
            if name not in _STORE_CALLS:
                return attr

            def call(*args, **kwargs):
                calls[name] += 1
                return attr(*args, **kwargs)

            return call

        def clone(self):
            return Counted(self._base.clone())

    sealed_init = sealed_store.SealedStore.__init__

    def counted_init(self, base, secret, *, where):
        sealed_init(self, Counted(base), secret, where=where)

    sealed_store.SealedStore.__init__ = counted_init
    challenged = []
    check_peers = peer_check.check_peers

    def counted_check(secret, *, rank, world_size, **kwargs):
        challenged.append(world_size - 1)
        return check_peers(secret, rank=rank, world_size=world_size, **kwargs)

    peer_check.check_peers = counted_check
    import stratagem.comm.process_group as process_group

    process_group.check_peers = counted_check  # bound by name at import
    before = _sockets()

    import stratagem as sg

    strategy = sg.distribute.MultiWorkerMirroredStrategy()
    total = strategy.reduce("SUM", strategy.run(lambda: torch.ones(1)), axis=None)
    assert int(total.item()) == strategy.num_replicas_in_sync
    result = {
        "rank": strategy.cluster_resolver.task_id,
        "store": dict(calls),
        "sockets": _sockets() - before,
        "challenged": sum(challenged),
    }
    print("RESULT " + json.dumps(result), flush=True)


def job(n: int) -> list[dict]:
    """Every task's counts for one job of ``n`` tasks."""
    argv = [sys.executable, "-m", "stratagem.cli", "run", "-n", str(n), "--quiet"]
    argv += [__file__, "--task"]
    env = clean_env({"OMP_NUM_THREADS": "1"})
    for name in ("STRATAGEM_INSECURE", "STRATAGEM_JOB_SECRET", "STRATAGEM_JOB_SECRET_FILE"):
        env.pop(name, None)
    code, out = run_in_own_group(argv, env, timeout=900)
    rows = [json.loads(m) for m in re.findall(r"RESULT (\{.*\})", out)]
    if code != 0 or len(rows) != n:
        raise RuntimeError(f"job of {n} exited {code}:\n{out[-4000:]}")
    return sorted(rows, key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--task", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.task:
        task()
        return
    table = []
    for n in args.sizes:
        rows = job(n)
        per = [sum(r["store"].values()) for r in rows]
        kinds: collections.Counter[str] = collections.Counter()
        for r in rows:
            kinds.update(r["store"])
        row = {
            "n": n,
            "store_requests_rank0": per[0],
            "store_requests_other_max": max(per[1:]),
            "store_requests_total": sum(per),
            "store_by_kind_total": dict(sorted(kinds.items())),
            "sockets_max": max(r["sockets"] for r in rows),
            "challenged_per_task": max(r["challenged"] for r in rows),
        }
        print(json.dumps(row), flush=True)
        table.append(row)
    print("| N | store requests: worker 0 | another task (max) | all tasks (at the store) "
          "| sockets per task (max) | peers challenged per task |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['n']} | {r['store_requests_rank0']} | {r['store_requests_other_max']} "
              f"| {r['store_requests_total']} | {r['sockets_max']} "
              f"| {r['challenged_per_task']} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"rows": table}, indent=1))


if __name__ == "__main__":
    main()
