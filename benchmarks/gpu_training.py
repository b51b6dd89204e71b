"""GPT-style decoder training: tokens/s and MFU of raw PyTorch, raw DDP and stratagem, in one run.

The same model (a GPT-2-small-shaped decoder: 12 layers, width 768, 12 heads, sequence 1024,
vocabulary 50304, ``scaled_dot_product_attention`` with a causal mask, forward in bf16
autocast, AdamW) trained four ways on the same synthetic tokens (made here, no download):

- ``raw``: a hand-written loop on one device (zero_grad, forward, cross-entropy, backward, step);
- ``ddp``: torch's ``DistributedDataParallel``, one device per process;
- ``fit``: ``sg.keras.Model.fit`` under ``OneDeviceStrategy``;
- ``mwms``: a custom loop under ``MultiWorkerMirroredStrategy`` (``strategy.run``), one device
  per process.

One process per device (``--nprocs``, default every GPU), started here with free ports (no
torchrun): MWMS starts the process group (NCCL on CUDA, gloo on CPU) and DDP uses it; with one
process DDP gets a group of one of its own. The four take turns in blocks of ``--steps`` steps,
in an order that rotates every block, so all meet the same machine state; the first block of
each is warm-up. Every process runs ``raw`` and ``fit`` on its own device at the same time (the
processes are alike); figures are process 0's. A block is timed from a synchronized start
(all processes, the device drained) to the device drained again; tokens/s per way is the
median over blocks, and a ratio of two ways the median over blocks of the ratio within each
block (the two ran minutes apart at most, so a clock or a neighbour that drifts over the run
moves both: a shared GPU machine's blocks have ranged 255k-311k tokens/s for the same way).

FLOPs per token (PaLM, appendix B; nanoGPT's ``estimate_mfu``): ``6·N + 12·L·T·d``, N the
parameters that take part in matrix products (all but the token and position embedding tables;
the output layer is not tied, so it counts), L layers, T the sequence length, d the width; the
attention term counts the full T×T scores (no saving for the causal mask), as is conventional.
MFU = tokens/s per device × FLOPs per token / the device's peak dense bf16 FLOP/s, from the
table below by GPU name, or ``--peak-tflops``. On the CPU there is no peak, hence no MFU
(the ratios are still printed: fit's MFU over raw's is the ratio of their tokens/s).

    python benchmarks/gpu_training.py                        # every GPU, the full model
    python benchmarks/gpu_training.py --device cpu --tiny    # 2 layers, width 64, seq 32
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import clean_env

CLUSTER_VARS = ("TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

WAYS = ("raw", "ddp", "fit", "mwms")

# Peak dense (no sparsity) bf16 tensor-core FLOP/s from NVIDIA's data sheets, matched against
# torch.cuda.get_device_name() in this order (the first fragment found wins).
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989.4),
    ("GH200", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10", 125.0),
)


@dataclass(frozen=True)
class Config:
    layers: int = 12
    width: int = 768
    heads: int = 12
    seq: int = 1024
    vocab: int = 50304
    batch: int = 8  # sequences per device per step


TINY = Config(layers=2, width=64, heads=4, seq=32, vocab=256, batch=4)


# ---------------------------------------------------------------------------------- the model


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.fc = nn.Linear(cfg.width, 4 * cfg.width)
        self.out = nn.Linear(4 * cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """Token ids (B, T) → float32 logits (B, T, V); the body runs in bf16 autocast."""

    def __init__(self, cfg: Config, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.wte = nn.Embedding(cfg.vocab, cfg.width)
        self.wpe = nn.Embedding(cfg.seq, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # Autocast inside the module, so that every way (Model.fit included) computes alike.
        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.ln_f(x))
        return logits.float()


def matmul_params(model: GPT) -> int:
    tables = {id(model.wte.weight), id(model.wpe.weight)}
    return sum(p.numel() for p in model.parameters() if id(p) not in tables)


def flops_per_token(cfg: Config, n_matmul: int) -> float:
    return 6.0 * n_matmul + 12.0 * cfg.layers * cfg.seq * cfg.width


def peak_flops(device: torch.device, override_tflops: float | None) -> tuple[float | None, str]:
    if override_tflops:
        return override_tflops * 1e12, f"--peak-tflops {override_tflops:g}"
    if device.type != "cuda":
        return None, "no peak for the CPU (give --peak-tflops)"
    name = torch.cuda.get_device_name(device)
    for fragment, tflops in PEAK_BF16_TFLOPS:
        if fragment in name:
            return tflops * 1e12, f"{name}: {tflops:g} TFLOP/s bf16 dense ({fragment})"
    return None, f"{name}: not in the peak table (give --peak-tflops)"


def plain_step(model: nn.Module, opt: torch.optim.Optimizer, vocab: int, scale: float) -> Callable:
    """One hand-written step: zero_grad, forward, cross-entropy, backward (``scale``d), step."""

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).view(-1, vocab), y.view(-1))
        (loss * scale if scale != 1.0 else loss).backward()
        opt.step()

    return step


def _adamw(params, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1, fused=device.type == "cuda")


# ---------------------------------------------------------------------------------- a worker


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(torch.zeros(1))  # a CPU tensor: gloo, beside NCCL on CUDA


def worker(rank: int, world: int, ports: list[int], args: argparse.Namespace) -> dict | None:
    """Run every way in interleaved blocks in this process; rank 0 returns the results."""
    cfg = TINY if args.tiny else Config(batch=args.batch)
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    if world > 1:
        os.environ["TF_CONFIG"] = json.dumps(
            {
                "cluster": {"worker": [f"localhost:{p}" for p in ports]},
                "task": {"type": "worker", "index": rank},
            }
        )
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import stratagem as sg

    def say(text: str) -> None:
        if rank == 0:
            print(f"[gpu_training] {text}", file=sys.stderr, flush=True)

    say(f"{world} process(es) on {device.type}, {cfg}")
    options = sg.distribute.experimental.CommunicationOptions(
        bytes_per_pack=int(args.bucket_mb * (1 << 20)) if args.bucket_mb else 0
    )
    mwms = sg.distribute.MultiWorkerMirroredStrategy(options)  # starts the group when world > 1
    own_group = not dist.is_initialized()
    if own_group:  # a world of one: DDP needs a group of its own
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)

    def build() -> GPT:
        torch.manual_seed(0)
        return GPT(cfg, device.type)

    ways = args.ways
    counted = build()  # the parameters, counted once
    n_matmul = matmul_params(counted)
    n_params = sum(p.numel() for p in counted.parameters())
    del counted
    say(f"{n_params / 1e6:.1f}M parameters, {n_matmul / 1e6:.1f}M in matrix products")
    steps: dict[str, Callable] = {}
    if "raw" in ways:
        raw = build().to(device)
        steps["raw"] = plain_step(raw, _adamw(raw.parameters(), device), cfg.vocab, 1.0)
    if "ddp" in ways:
        ddp = DistributedDataParallel(
            build().to(device), device_ids=[rank] if device.type == "cuda" else None
        )
        steps["ddp"] = plain_step(ddp, _adamw(ddp.parameters(), device), cfg.vocab, 1.0)
    if "fit" in ways:
        one = sg.distribute.OneDeviceStrategy(str(device) if device.type == "cuda" else "cpu:0")
        with one.scope():
            fit_model = sg.keras.Model(build())
            fit_model.compile(
                _adamw(fit_model.module.parameters(), device),
                sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
    if "mwms" in ways:
        with mwms.scope():
            mwms_model = build()
            mwms_opt = _adamw(mwms_model.parameters(), device)
        # The seeds' convention: MWMS sums the replicas' gradients, so each loss is a global
        # mean.
        mwms_inner = plain_step(mwms_model, mwms_opt, cfg.vocab, 1.0 / world)
        steps["mwms"] = lambda x, y: mwms.run(mwms_inner, args=(x, y))

    # Synthetic tokens: a few batches on the device, used in turn (input cost is not measured).
    g = torch.Generator().manual_seed(1234 + rank)
    pool = [
        torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g).to(device) for _ in range(4)
    ]
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in pool]

    # fit's data for one block: the same batches, in the same turn.
    fit_x = torch.cat([batches[i % len(batches)][0] for i in range(args.steps)])
    fit_y = torch.cat([batches[i % len(batches)][1] for i in range(args.steps)])

    def run_block(way: str) -> None:
        if way == "fit":
            fit_model.fit(fit_x, fit_y, batch_size=cfg.batch, epochs=1, shuffle=False, verbose=0)
            return
        step = steps[way]
        for i in range(args.steps):
            step(*batches[i % len(batches)])

    tokens = {way: cfg.batch * cfg.seq * args.steps * (world if way in ("ddp", "mwms") else 1)
              for way in ways}  # fmt: skip
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    for block in range(args.blocks + 1):
        order = ways[block % len(ways) :] + ways[: block % len(ways)]
        line = []
        for way in order:
            _sync(device)
            _barrier()
            start = time.perf_counter()
            run_block(way)
            _sync(device)
            elapsed = time.perf_counter() - start
            if block:  # block 0 warms every way up
                seconds[way].append(elapsed)
            line.append(f"{way} {tokens[way] / elapsed:,.0f}")
        say(f"block {block}/{args.blocks}{' (warm-up)' if block == 0 else ''}: tokens/s "
            + ", ".join(line))  # fmt: skip
    _barrier()
    if own_group:  # MWMS ends the group it started; this one is the script's (NCCL warns)
        dist.destroy_process_group()
    if rank:
        return None
    peak, peak_source = peak_flops(device, args.peak_tflops)
    fpt = flops_per_token(cfg, n_matmul)
    rows = {}
    for way in ways:
        per_s = [tokens[way] / s for s in seconds[way]]
        median = statistics.median(per_s)
        per_device = median / (world if way in ("ddp", "mwms") else 1)
        rows[way] = {
            "tokens_per_s": per_s,
            "median_tokens_per_s": median,
            "mfu": per_device * fpt / peak if peak else None,
        }
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "processes": world,
        "config": asdict(cfg),
        "steps_per_block": args.steps,
        "mwms_bucket_mb": args.bucket_mb,
        "blocks": args.blocks,
        "parameters": n_params,
        "matmul_parameters": n_matmul,
        "flops_per_token": fpt,
        "flops_formula": "6*N + 12*L*T*d",
        "peak_flops": peak,
        "peak_source": peak_source,
        "rows": rows,
        "mwms_over_ddp": _ratio(rows, "mwms", "ddp"),
        # Same model, same device: the ratio of MFUs is the ratio of tokens/s.
        "fit_mfu_over_raw_mfu": _ratio(rows, "fit", "raw"),
        "torch": torch.__version__,
    }


def _ratio(rows: dict, a: str, b: str) -> float | None:
    """The median over blocks of ``a``'s tokens/s over ``b``'s in the same block."""
    if a not in rows or b not in rows:
        return None
    pairs = zip(rows[a]["tokens_per_s"], rows[b]["tokens_per_s"], strict=True)
    return statistics.median(x / y for x, y in pairs)


# ---------------------------------------------------------------------------------- the driver


def _free_ports(count: int) -> list[int]:
    socks, ports = [], []
    try:
        while len(ports) < count:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def _report(results: dict) -> None:
    world = results["processes"]
    print(f"\n{results['device']}, {world} process(es), {results['parameters'] / 1e6:.1f}M "
          f"parameters, {results['config']}; FLOPs/token {results['flops_per_token']:.3e} "
          f"(6·N + 12·L·T·d); peak: {results['peak_source']}")  # fmt: skip
    print("\n| way | tokens/s (median of blocks) | MFU |\n| --- | --- | --- |")
    names = {
        "raw": "raw PyTorch loop, one device",
        "ddp": f"raw DDP, {world} process(es)",
        "fit": "stratagem OneDeviceStrategy Model.fit",
        "mwms": f"stratagem MWMS custom loop, {world} process(es)",
    }
    for way, row in results["rows"].items():
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a"
        print(f"| {names[way]} | {row['median_tokens_per_s']:,.0f} | {mfu} |")
    print("\n| ratio (median of the blocks' ratios) | measured | target |\n| --- | --- | --- |")
    for key, name, target in (
        ("mwms_over_ddp", "MWMS / DDP tokens/s", "≥ 0.98"),
        ("fit_mfu_over_raw_mfu", "OneDevice fit MFU / raw MFU", "≥ 0.95"),
    ):
        value = results[key]
        print(f"| {name} | {f'{value:.3f}' if value is not None else 'n/a'} | {target} |")
    if world == 1 and results["mwms_over_ddp"] is not None:
        print("(one process: MWMS has no all-reduce to do; DDP still runs its own over a group "
              "of one)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="default: cuda when available")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="2 layers, width 64, seq 32")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 blocks of 2 steps")
    parser.add_argument(
        "--nprocs", type=int, default=None, help="one device each (default: every GPU; CPU: 2)"
    )
    parser.add_argument("--batch", type=int, default=8, help="sequences per device per step")
    parser.add_argument("--steps", type=int, default=None, help="steps per block")
    parser.add_argument("--blocks", type=int, default=None, help="measured blocks per way")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's peak bf16 TFLOP/s, instead of the table's")  # fmt: skip
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=None,
        help="MWMS's gradient buckets in MiB (default: stratagem's; DDP's are 25)",
    )
    parser.add_argument(
        "--ways",
        default=",".join(WAYS),
        help=f"which to run, comma-separated (default: all of {','.join(WAYS)})",
    )
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--worker", nargs=2, type=int, help=argparse.SUPPRESS)  # rank, world
    parser.add_argument("--ports", help=argparse.SUPPRESS)
    args = parser.parse_args()
    asked = [w.strip() for w in args.ways.split(",") if w.strip()]
    unknown = sorted(set(asked) - set(WAYS))
    if unknown or not asked:
        parser.error(f"--ways {args.ways!r}: expected some of {', '.join(WAYS)}")
    args.ways = tuple(w for w in WAYS if w in asked)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this machine has no CUDA device (use --device cpu --tiny)")
    if args.steps is None:
        args.steps = 2 if args.quick else 4 if args.tiny else 20
    if args.blocks is None:
        args.blocks = 2 if args.quick else 5 if args.tiny else 9

    if args.worker:
        rank, world = args.worker
        ports = [int(p) for p in args.ports.split(",")]
        worker(rank, world, ports, args)
        return

    if args.nprocs is None:
        args.nprocs = torch.cuda.device_count() if args.device == "cuda" else 2
    if args.device == "cuda" and args.nprocs > torch.cuda.device_count():
        parser.error(f"--nprocs {args.nprocs}: one GPU per process, and there are "
                     f"{torch.cuda.device_count()}")  # fmt: skip
    ports = _free_ports(args.nprocs)
    passed = [a for a in sys.argv[1:] if a != "--json" and a != args.json]
    argvs = [
        [sys.executable, __file__, *passed, "--device", args.device, "--worker", str(r),
         str(args.nprocs), "--ports", ",".join(map(str, ports))]
        for r in range(1, args.nprocs)
    ]  # fmt: skip
    extra = {"OMP_NUM_THREADS": "1"} if args.device == "cpu" else {}
    # Rank 0 is this process (one interpreter fewer to start); the others are children, each
    # in its own process group, stopped whatever happens.
    children = [
        subprocess.Popen(argv, env=clean_env(extra), start_new_session=True) for argv in argvs
    ]
    try:
        for name in (*CLUSTER_VARS, "STRATAGEM_CONFIG", "LOCAL_RANK"):
            os.environ.pop(name, None)
        if args.device == "cpu":
            torch.set_num_threads(1)
        results = worker(0, args.nprocs, ports, args)
        for argv, child in zip(argvs, children):
            if child.wait(timeout=600) != 0:
                raise RuntimeError(f"{' '.join(argv[1:])} exited {child.returncode}")
    finally:
        for child in children:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
    assert results is not None
    _report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
