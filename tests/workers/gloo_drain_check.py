"""One of two processes (``test_gloo_drain.py``): ``wait_for_gloo_threads`` after collectives on
a group this process holds, and while a collective waits for a peer that has not come yet.

``gloo_drain_check.py OUT``: writes ``OUT/rank<r>.json`` with what it measured.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

from stratagem.comm.gloo_drain import _runloop_states, wait_for_gloo_threads

config = json.loads(__import__("os").environ["TF_CONFIG"])
rank = config["task"]["index"]
port = config["cluster"]["worker"][0].rsplit(":", 1)[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
store = dist.distributed_c10d._get_default_store()
group = dist.new_group([0, 1])  # held, as a DeviceMesh holds its groups
report: dict = {}

# 1. After collectives on temporaries: the threads settle, and the wait says so.
for i in range(20):
    y = fc.all_reduce(torch.ones(100) * i, "sum", group) + 1
report["after_collectives"] = wait_for_gloo_threads()
report["threads"] = len(_runloop_states())
report["states"] = _runloop_states()

# 2. Rank 0's collective waits for rank 1, which comes only once rank 0 has measured: a
# thread blocked inside a collective sleeps, so a job whose peer is gone is not held up.
if rank == 0:
    pending = dist.all_reduce(torch.ones(3), group=group, async_op=True)
    report["while_blocked"] = wait_for_gloo_threads()
    report["pending_done_then"] = pending.is_completed()
    store.set("measured", "1")
    pending.wait()
else:
    store.wait(["measured"])
    dist.all_reduce(torch.ones(3), group=group)
report["at_the_end"] = wait_for_gloo_threads()
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(report))
