"""What an elastic job's wait for a collective (in slices) costs against gloo's blocking wait:
run by hand, ``python tests/workers/elastic_wait_cost.py`` (two gloo processes on this machine).

Each rank alternates blocks of ``BLOCK`` all-reduces waited one way, then the other (the
order alternating too), on one group, and prints the median seconds per all-reduce of each
way, and the median of the rounds' ratios, for a tiny tensor (one float) and a small one
(64 Ki floats, 256 KiB).
"""

import os
import statistics
import subprocess
import sys
import time

BLOCK, ROUNDS = 50, 41


def worker(rank: int, port: int) -> None:
    import torch

    from stratagem.cluster import TorchrunClusterResolver
    from stratagem.comm.process_group import ProcessGroupCommunicator, Timeouts

    os.environ["STRATAGEM_ELASTIC"] = "1"
    env = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(port)
    comm = ProcessGroupCommunicator(
        TorchrunClusterResolver(environ=env), backend="gloo", timeouts=Timeouts(30.0, 30.0)
    )
    for numel in (1, 1 << 16):
        t = torch.ones(numel)
        times: dict[bool, list[float]] = {True: [], False: []}
        for i in range(ROUNDS):
            for sliced in (True, False) if i % 2 else (False, True):
                comm._elastic = sliced  # the wait's way; nothing else differs in the loop
                start = time.perf_counter()
                for _ in range(BLOCK):
                    comm.all_reduce(t, what="the measurement")
                times[sliced].append((time.perf_counter() - start) / BLOCK)
        comm._elastic = True
        blocking, sliced = (statistics.median(times[k]) for k in (False, True))
        # Side by side in each round: a shared machine's load moves both alike.
        ratio = statistics.median(s / b for s, b in zip(times[True], times[False]))
        print(
            f"rank {rank} {numel} floats: blocking wait {blocking * 1e6:.0f} us, sliced "
            f"{sliced * 1e6:.0f} us per all-reduce (medians); median ratio of the rounds "
            f"{(ratio - 1) * 100:+.1f}%",
            flush=True,
        )
    comm.shutdown()


if __name__ == "__main__":
    if len(sys.argv) == 3:
        worker(int(sys.argv[1]), int(sys.argv[2]))
    else:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
        from cluster_utils import free_ports

        port = free_ports(1)[0]
        children = [
            subprocess.Popen([sys.executable, __file__, str(r), str(port)]) for r in range(2)
        ]
        sys.exit(max(c.wait(timeout=600) for c in children))
