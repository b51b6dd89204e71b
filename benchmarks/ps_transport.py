"""Push + pull of a 4 MB gradient through ParameterServerStrategy vs raw torch.distributed.rpc.

One worker and one ps (``stratagem run -n 1 --ps 1``). In the same processes, alternating
blocks of 20 round trips:

- ours: ``optimizer.step()`` on one 4 MB parameter held by the ps: the worker pushes its 4 MB
  gradient over our transport (``comm.messages``: plain-data frames, authenticated), the ps
  applies SGD, the worker takes back the 4 MB of new values;
- raw: ``rpc.rpc_sync("ps:0", torch.mul, (gradient, 1.0))`` over ``torch.distributed.rpc``
  (TensorPipe, which the strategy used before; the benchmark starts it itself, beside the
  strategy): 4 MB there, 4 MB back.

Bytes/s counts 8 MB per round trip on both sides; the ratio is ours / raw (median of blocks,
then of runs). With ``--bf16`` ours is measured again sending bf16 (half the bytes), its
bytes/s counted in float32 bytes moved, to show what compression buys.

    python benchmarks/ps_transport.py            # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port, run_launcher_job

MB = 1 << 20
ELEMENTS = MB  # float32: 4 MB


def task(blocks: int, steps: int, port: int, bf16: bool) -> None:
    import os

    import torch
    import torch.distributed.rpc as rpc

    import stratagem as sg

    # The raw side's RPC world: the worker (rank 0) and the ps (rank 1), met on ``port``.
    me = json.loads(os.environ["TF_CONFIG"])["task"]
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rank = 1 if me["type"] == "ps" else 0
    rpc.init_rpc(
        f"{me['type']}:{me['index']}", rank=rank, world_size=2, rpc_backend_options=options
    )
    try:
        strategy = sg.distribute.ParameterServerStrategy(compression="bf16" if bf16 else None)
    except SystemExit:  # the ps: the worker is done
        rpc.shutdown()
        raise
    with strategy.scope():
        holder = torch.nn.Module()
        holder.weight = torch.nn.Parameter(torch.zeros(ELEMENTS))
        optimizer = torch.optim.SGD(holder.parameters(), lr=1e-6)
    gradient = torch.randn(ELEMENTS)

    def ours() -> None:
        for _ in range(steps):
            holder.weight.grad = gradient.clone()
            optimizer.step()

    def raw() -> None:
        for _ in range(steps):
            rpc.rpc_sync("ps:0", torch.mul, args=(gradient, 1.0))

    rates: dict[str, list[float]] = {"ours": [], "raw": []}
    for block in range(blocks + 1):  # block 0 warms both up
        sides = [("ours", ours), ("raw", raw)]
        for name, fn in sides if block % 2 else sides[::-1]:
            start = time.perf_counter()
            fn()
            if block:
                rates[name].append(steps * 8 * MB / (time.perf_counter() - start))
    print("RESULT " + json.dumps(rates), flush=True)
    strategy.extended.client.finish()  # the ps then leaves its Server.join for rpc.shutdown
    rpc.shutdown()


def run(blocks: int, steps: int, bf16: bool) -> dict[str, list[float]]:
    task = ["--task", str(blocks), str(steps), str(free_port())] + (["--bf16"] if bf16 else [])
    return run_launcher_job(["-n", "1", "--ps", "1", __file__, *task])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", nargs=3, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--bf16", action="store_true", help="also measure bf16 transfer")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    args = parser.parse_args()
    if args.task:
        task(*args.task, bf16=args.bf16)
        return
    runs, blocks, steps = (1, 2, 3) if args.quick else (args.runs, 6, 20)
    ratios, ours, raw, compressed = [], [], [], []
    for r in range(runs):
        got = run(blocks, steps, bf16=False)
        ours += got["ours"]
        raw += got["raw"]
        ratios.append(statistics.median(got["ours"]) / statistics.median(got["raw"]))
        line = f"run {r + 1}/{runs}: ours/raw {ratios[-1]:.3f}"
        if args.bf16:
            halved = run(blocks, steps, bf16=True)
            compressed.append(statistics.median(halved["ours"]) / statistics.median(halved["raw"]))
            line += f", ours with bf16 / raw fp32 {compressed[-1]:.3f}"
        print(line, flush=True)
    mb_s = statistics.median(ours) / MB, statistics.median(raw) / MB
    print(f"\nours: {mb_s[0]:.0f} MB/s, raw rpc: {mb_s[1]:.0f} MB/s")
    print(f"ours / raw rpc, median of {runs} runs: {statistics.median(ratios):.3f} (target >= 0.9)")
    if compressed:
        print(f"ours with bf16 / raw fp32: {statistics.median(compressed):.3f}")


if __name__ == "__main__":
    main()
