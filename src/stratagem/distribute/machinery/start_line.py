"""The one line a strategy says when it has started: what it is, where, and how long it took.

Said by ``Strategy.__init__`` once the strategy is complete (every strategy ends its start-up
there), through ``stratagem.cluster.progress``: at INFO when the strategy spans processes (the
start a user waits for and wants to see), at DEBUG for a strategy of one process.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch.distributed as dist

from stratagem.cluster import progress

# Facts some strategies add to ``extended.describe()`` that a user wants at start.
_EXTRA_FACTS = ("mode", "mesh", "num_stages", "schedule")


def _spans_processes(extended: Any) -> bool:
    # By the strategy's own cluster, not by whether a process group is up: the default strategy
    # (or a OneDevice one) made inside a multi-worker job is still a strategy of one process.
    resolver = extended.cluster_resolver
    spec = resolver.cluster_spec() if resolver is not None else None
    return bool(spec) and sum(spec.num_tasks(job) for job in spec.jobs) > 1


def _backend(facts: dict[str, Any]) -> str:
    if dist.is_available() and dist.is_initialized():
        return str(dist.get_backend())
    if "mode" in facts:  # a parameter-server strategy: its workers reach the ps by messages only
        return "ps messages (comm/messages.py)"
    return "none"


def process_age() -> float | None:
    """Seconds since this process started (imports included), where Linux's /proc tells."""
    try:
        with open("/proc/self/stat") as f:
            # Fields after the command name (which may hold spaces): starttime is field 22.
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def start_line(extended: Any, seconds: float) -> str:
    """``worker 0 of 2 workers (TF_CONFIG): MultiWorkerMirroredStrategy started in 1.2s: ...``."""
    facts = extended.describe()
    resolver = extended.cluster_resolver
    who = resolver.describe() if resolver is not None else "this process"
    devices = ", ".join(facts.get("devices", []))
    extra = "".join(f", {k} {facts[k]}" for k in _EXTRA_FACTS if k in facts)
    age = process_age()
    since = f" ({age:.1f}s since the process started)" if age is not None else ""
    replicas = facts["num_replicas_in_sync"]
    return (
        f"{who}: {facts['strategy']} started in {seconds:.1f}s{since}: "
        f"{replicas} replica{'' if replicas == 1 else 's'} in sync, devices {devices}, "
        f"backend {_backend(facts)}{extra}"
    )


def announce_start(extended: Any, seconds: float) -> None:
    """Say the start line: INFO across processes, DEBUG for one process."""
    level = logging.INFO if _spans_processes(extended) else logging.DEBUG
    log = progress.logger()
    if log.isEnabledFor(level):  # the line is built only when it is said
        log.log(level, start_line(extended, seconds))
