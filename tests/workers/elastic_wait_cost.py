"""What an elastic job's wait for a collective (in slices) costs against gloo's blocking wait,
in the same two processes: run by hand, ``python tests/workers/elastic_wait_cost.py``.

Each rank runs ``PAIRS`` pairs of all-reduces on one communicator, one waited each way (which
goes first alternating), and prints the median over pairs of sliced / blocking, beside the same
figure for two blocking waits (what identical waits differ by here), for a tiny tensor (one
float) and a small one (64 Ki floats, 256 KiB). Pair by pair, both ways meet the same load;
``benchmarks/elastic_waits.py`` measures whole jobs with ``STRATAGEM_ELASTIC=1`` and ``0``.
"""

import os
import statistics
import subprocess
import sys
import time

PAIRS = 3000


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

    def seconds(t: torch.Tensor, sliced: bool) -> float:
        comm._elastic = sliced  # the wait's way; nothing else differs per all-reduce
        start = time.perf_counter()
        comm.all_reduce(t, what="the measurement")
        return time.perf_counter() - start

    for numel in (1, 1 << 16):
        t = torch.ones(numel)
        ratios: dict[str, list[float]] = {"sliced / blocking": [], "blocking / blocking": []}
        for i in range(PAIRS):
            for name, a in (("sliced / blocking", True), ("blocking / blocking", False)):
                if i % 2:
                    b_s, a_s = seconds(t, False), seconds(t, a)
                else:
                    a_s, b_s = seconds(t, a), seconds(t, False)
                ratios[name].append(a_s / b_s)
        comm._elastic = True
        print(
            f"rank {rank} {numel} floats, {PAIRS} pairs: "
            + ", ".join(f"{k} {statistics.median(v):.4f}" for k, v in ratios.items()),
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
