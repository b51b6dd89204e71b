"""What the benchmarks share: the seed CNN and its synthetic batches, and running measurements
in fresh processes (each in its own process group, killed whatever happens)."""

from __future__ import annotations

import json
import os
import re
import socket
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

# glibc keeps freed memory instead of handing it back to the kernel (see allreduce_strategies).
STABLE_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}


def seed_cnn() -> torch.nn.Module:
    from mnist import build_cnn_model

    return build_cnn_model()


def batches(n: int, size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.rand(size, 28, 28, generator=g), torch.randint(0, 10, (size,), generator=g))
        for _ in range(n)
    ]


def hand_written_step(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
    """One step of plain PyTorch training of ``module``: ``step(x, y)``. The optimizer defaults
    to RMSprop as the seed sets it."""
    if optimizer is None:
        optimizer = torch.optim.RMSprop(module.parameters(), lr=1e-3, alpha=0.9, eps=1e-7)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(module(x), y).backward()
        optimizer.step()

    return step


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    """This environment without any cluster of the caller's, plus ``extra``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
    for name in ("TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def run_processes(argvs: list[list[str]], env: dict[str, str], timeout: float = 600) -> list[str]:
    """Run one process per argv together; the last line each printed. Fails if any fails."""
    procs = [
        subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
        for argv in argvs
    ]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    for argv, p, out in zip(argvs, procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[1:])} exited {p.returncode}: {out}")
    return [out.strip().splitlines()[-1] for out in outs]


def run_in_own_group(argv: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """Run ``argv`` in its own process group, stdout and stderr merged; (exit code, output).
    The group is killed if it outlives ``timeout`` or this process is interrupted."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        out = proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    return proc.returncode, out


def run_launcher_job(launcher_args: list[str], timeout: float = 600) -> dict:
    """``stratagem run <launcher_args>`` in its own process group; the JSON its chief printed
    after ``RESULT `` (the launcher prefixes it with ``[worker 0]``). Fails if the job fails."""
    argv = [sys.executable, "-m", "stratagem.cli", "run", *launcher_args]
    code, out = run_in_own_group(argv, clean_env({}), timeout)
    found = re.search(r"RESULT (\{.*\})", out)
    if code != 0 or found is None:
        raise RuntimeError(f"{' '.join(launcher_args)} exited {code}:\n{out}")
    return json.loads(found.group(1))


def rotated_rounds(
    variants: dict[str, Callable[[], float]], rounds: int, unit: str
) -> dict[str, list[float]]:
    """Each variant measured once per round, side by side in this process, the order rotating
    from round to round (none always runs first, after the same neighbour); the samples, with
    each round printed as it ends."""
    names = list(variants)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            samples[name].append(variants[name]())
        print(
            f"round {r + 1}/{rounds}: "
            + ", ".join(f"{n} {samples[n][-1]:.1f}" for n in names)
            + f" {unit}",
            flush=True,
        )
    return samples


def median_round_ratio(samples: dict[str, list[float]], name: str, base: str) -> float:
    """The median over rounds of ``name``'s sample divided by ``base``'s in the same round."""
    return statistics.median(a / b for a, b in zip(samples[name], samples[base]))
