"""``sg.config.threading``: the CPU thread pools (TF's intra-op and inter-op parallelism).

Intra-op threads split one operation (a matrix product) across cores; inter-op threads run
independent operations side by side. torch fixes the inter-op pool at its first parallel
work, so setting it later is an error that says so instead of a silent no-op.
"""

from __future__ import annotations

import os

import torch


def usable_cpus() -> int:
    """The cores this process may run on (its affinity mask: taskset, cgroup cpusets), not the
    machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _check(num_threads: int, what: str) -> int:
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 0:
        raise ValueError(
            f"{what} must be an int >= 0 (0 = the system default), got {num_threads!r}"
        )
    return num_threads


def set_intra_op_parallelism_threads(num_threads: int) -> None:
    """Threads used inside one operation; 0 keeps torch's default."""
    if _check(num_threads, "intra-op parallelism threads"):
        torch.set_num_threads(num_threads)


def get_intra_op_parallelism_threads() -> int:
    return torch.get_num_threads()


def set_inter_op_parallelism_threads(num_threads: int) -> None:
    """Threads running independent operations; must be set before any parallel work starts."""
    if not _check(num_threads, "inter-op parallelism threads"):
        return
    if torch.get_num_interop_threads() == num_threads:
        return
    try:
        torch.set_num_interop_threads(num_threads)
    except RuntimeError as e:
        raise RuntimeError(
            f"cannot set inter-op parallelism threads to {num_threads}: torch has already "
            f"started its inter-op pool with {torch.get_num_interop_threads()} threads. Call "
            "sg.config.threading.set_inter_op_parallelism_threads at the start of the program, "
            f"before any parallel work ({e})"
        ) from None


def get_inter_op_parallelism_threads() -> int:
    return torch.get_num_interop_threads()
