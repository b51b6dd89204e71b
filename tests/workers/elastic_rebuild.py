"""One worker of an elastic job whose group is rebuilt in place: tests/test_elastic_rebuild.py.

torchrun's environment, with the store hosted by the test (as the agent hosts it) and
STRATAGEM_ELASTIC=1. VICTIM is the rank the test kills or stops; it comes late to the first
all-reduce and then waits outside collectives. The others all-reduce again, get
``MembershipChanged`` (a lost peer, or SIGUSR1: the agent's abandon), rebuild for round 1
without the victim and all-reduce; with NEWCOMER=1 they then admit one newcomer at round 2.
Each contributes 2**(its first rank); a newcomer (JOINING=1, started at round 2) contributes 8.
Lines: READY, LOST, REBUILT, SUM.
"""

import os
import signal
import sys
import time

import torch

from stratagem.cluster import TorchrunClusterResolver
from stratagem.comm.elastic_member import admit, continue_without
from stratagem.comm.process_group import ProcessGroupCommunicator, Timeouts
from stratagem.errors import MembershipChanged

op_timeout = float(os.environ["OP_TIMEOUT"])
comm = ProcessGroupCommunicator(
    TorchrunClusterResolver(), backend="gloo", timeouts=Timeouts(30.0, op_timeout)
)
first_rank = comm.rank
victim = int(os.environ.get("VICTIM", "-1"))
signal.signal(signal.SIGUSR1, lambda *_: comm.abandon(f"the agent declared rank {victim} lost"))


def total(value: float) -> float:
    t = torch.full((4,), value)
    comm.all_reduce(t, what="the step")
    return t[0].item()


def say(line: str) -> None:
    print(f"{line} round={comm.round} rank={comm.rank} of={comm.world_size}", flush=True)


if os.environ.get("JOINING") == "1":
    say(f"SUM {total(8.0)}")
    sys.exit(0)

print(f"READY {first_rank} {comm._liveness.address}", flush=True)
if first_rank == victim:
    time.sleep(0.3)  # late: the others' wait for the first all-reduce outlasts several slices
say(f"SUM {total(2.0**first_rank)}")
if first_rank == victim:
    time.sleep(op_timeout * 2)  # killed or stopped by the test first
    sys.exit(3)
start = time.monotonic()
try:
    total(2.0**first_rank)
except MembershipChanged as e:
    print(f"LOST after {time.monotonic() - start:.3f}s: {e}", flush=True)
else:
    sys.exit("the all-reduce without the victim completed")
start = time.monotonic()
continue_without(comm, round=1, lost=[victim])
say(f"REBUILT in {time.monotonic() - start:.3f}s")
say(f"SUM {total(2.0**first_rank)}")
if os.environ.get("NEWCOMER") == "1":
    start = time.monotonic()
    admit(comm, round=2, newcomers=1)
    say(f"REBUILT in {time.monotonic() - start:.3f}s")
    say(f"SUM {total(2.0**first_rank)}")
