"""One of two processes of a gloo group (a FileStore, no stratagem start-up) that run the job
secret's connection check, each with the secret in SECRET: tests/test_attacks_secret.py."""

import os
import sys

import torch.distributed as dist

from stratagem.comm.peer_check import check_peers
from stratagem.errors import RendezvousError

rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"file://{sys.argv[2]}", rank=rank, world_size=2)
try:
    check_peers(
        os.environ["SECRET"].encode(), rank=rank, world_size=2, peer_name=lambda r: f"task {r}"
    )
except RendezvousError as e:
    print(f"REFUSED {e}", flush=True)
else:
    print("CHECKED", flush=True)
dist.destroy_process_group()
