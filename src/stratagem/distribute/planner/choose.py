"""``plan``: the cheapest plan that fits; ``auto``: that plan's strategy, built.

``plan(model, example_batch, devices_or_cluster, memory_per_device=None, optimizer="adam")``
traces the model on the meta device (``model_trace``), prices every candidate
(``candidates``) and returns a ``Plan``: ``plan.chosen``, ``plan.candidates`` and, printed,
the table of them all. ``example_batch`` is what one device computes on per step under data
parallelism (the global batch is ``world`` of them). When no candidate fits,
``PlanDoesNotFitError`` names the one that misses by least, and by how much.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from stratagem.cluster import ClusterSpec
from stratagem.distribute.planner.candidates import Candidate, ClusterShape, candidates, cheapest
from stratagem.distribute.planner.cost_model import OPTIMIZER_SLOTS
from stratagem.distribute.planner.model_trace import ModelFacts, trace_model
from stratagem.distribute.planner.plan_table import format_plan
from stratagem.distribute.strategy import Strategy
from stratagem.errors import StratagemError


class PlanDoesNotFitError(StratagemError, MemoryError):
    """No candidate fits the memory of a device; ``closest`` misses by ``shortfall`` bytes."""

    def __init__(self, message: str, closest: Candidate) -> None:
        super().__init__(message)
        self.closest = closest
        self.shortfall = closest.shortfall


@dataclass(frozen=True)
class Plan:
    """The chosen candidate among all priced; ``str(plan)`` is the table."""

    chosen: Candidate
    candidates: tuple[Candidate, ...]
    cluster: ClusterShape
    facts: ModelFacts
    model: torch.nn.Module | None = field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        return format_plan(self.candidates, self.chosen, self.cluster)

    def build(self) -> Strategy:
        """The chosen strategy, made in this process (every process of the job calls it)."""
        return build_strategy(self.chosen, self.facts, self.model)


def optimizer_slots(optimizer: Any) -> int:
    """Parameter-sized state slots of ``optimizer``: a name (``"adam"``), a torch optimizer
    class or instance (Adam-like: 2, SGD: momentum or not), or a number."""
    if isinstance(optimizer, int) and not isinstance(optimizer, bool) and optimizer >= 0:
        return optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        if isinstance(optimizer, torch.optim.SGD):
            return int(bool(optimizer.defaults.get("momentum")))
        optimizer = type(optimizer)
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.__name__
    if isinstance(optimizer, str) and optimizer.lower() in OPTIMIZER_SLOTS:
        return OPTIMIZER_SLOTS[optimizer.lower()]
    raise ValueError(
        f"plan: optimizer={optimizer!r}; expected one of {sorted(OPTIMIZER_SLOTS)}, a torch "
        "optimizer (class or instance), or the number of parameter-sized state slots it keeps"
    )


def _default_memory(devices_per_host: int) -> int | None:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    return total // devices_per_host


def cluster_shape(devices_or_cluster: Any, memory_per_device: int | None) -> ClusterShape:
    """A ``ClusterShape`` from a count of devices (one host), a list of devices, a
    ``ClusterSpec`` or resolver (tasks grouped into hosts by address), or a ``ClusterShape``."""
    given = devices_or_cluster
    if hasattr(given, "cluster_spec") and callable(given.cluster_spec):
        given = given.cluster_spec()
    if isinstance(given, ClusterShape):
        shape = given
    elif isinstance(given, int) and not isinstance(given, bool) and given >= 1:
        shape = ClusterShape(1, given)
    elif isinstance(given, Sequence) and not isinstance(given, str) and given:
        shape = ClusterShape(1, len(given))
    elif isinstance(given, ClusterSpec):
        hosts: dict[str, int] = {}
        for job in ("chief", "worker"):
            for address in given.job_tasks(job) if job in given.jobs else []:
                host = str(address).rsplit(":", 1)[0]
                hosts[host] = hosts.get(host, 0) + 1
        if not hosts:
            raise ValueError(f"plan: the cluster {given.as_dict()} has no chief or worker tasks")
        per_host = max(hosts.values())
        # Hosts of unequal sizes fit no (replicate, shard) grid: priced as one host.
        shape = (
            ClusterShape(len(hosts), per_host)
            if min(hosts.values()) == per_host
            else ClusterShape(1, sum(hosts.values()))
        )
    else:
        raise ValueError(
            f"plan: devices_or_cluster={devices_or_cluster!r}; expected a number of devices, a "
            "list of devices, a sg.train.ClusterSpec or resolver, or a ClusterShape"
        )
    if memory_per_device is not None:
        return ClusterShape(shape.hosts, shape.devices_per_host, int(memory_per_device))
    if shape.memory_per_device is None:
        return ClusterShape(
            shape.hosts, shape.devices_per_host, _default_memory(shape.devices_per_host)
        )
    return shape


def choose(facts: ModelFacts, cluster: ClusterShape, slots: int) -> Plan:
    """The plan for facts already traced (pure arithmetic: the simulations call this)."""
    found = tuple(candidates(facts, cluster, slots))
    chosen = cheapest(list(found))
    if not chosen.fits:
        raise PlanDoesNotFitError(
            f"no plan fits {cluster.memory_per_device / 2**20:,.1f} MiB per device on "
            f"{cluster.world} devices; the closest, {chosen.name}, needs "
            f"{chosen.memory.peak / 2**20:,.1f} MiB (short by {chosen.shortfall / 2**20:,.1f} "
            f"MiB):\n{format_plan(found, chosen, cluster)}",
            chosen,
        )
    return Plan(chosen, found, cluster, facts)


def plan(
    model: torch.nn.Module,
    example_batch: Any,
    devices_or_cluster: Any = None,
    memory_per_device: int | None = None,
    optimizer: Any = "adam",
) -> Plan:
    """``sg.distribute.plan``: price every way to distribute ``model`` and choose the cheapest
    that fits. ``devices_or_cluster`` defaults to this job's processes."""
    if devices_or_cluster is None:
        devices_or_cluster = _this_job()
    cluster = cluster_shape(devices_or_cluster, memory_per_device)
    chosen = choose(trace_model(model, example_batch), cluster, optimizer_slots(optimizer))
    return replace(chosen, model=model)


def auto(
    model: torch.nn.Module,
    example_batch: Any,
    devices_or_cluster: Any = None,
    memory_per_device: int | None = None,
    optimizer: Any = "adam",
) -> Strategy:
    """``sg.distribute.auto``: ``plan(...)``'s chosen strategy, built (call it in every
    process; build the model again inside its ``scope()``)."""
    return plan(model, example_batch, devices_or_cluster, memory_per_device, optimizer).build()


def _this_job() -> Any:
    from stratagem.distribute.cluster_resolver import TFConfigClusterResolver

    resolver = TFConfigClusterResolver()
    spec = resolver.cluster_spec()
    if spec.jobs:
        return spec
    world = os.environ.get("WORLD_SIZE")
    return int(world) if world else max(1, torch.cuda.device_count())


def build_strategy(chosen: Candidate, facts: ModelFacts, model: torch.nn.Module | None) -> Strategy:
    """The strategy a candidate stands for (a mesh's layouts are read off ``model``)."""
    s = chosen.settings
    wrap = [re.escape(x.path) for x in facts.layers] if facts.layers else None
    if chosen.kind == "mirrored":
        from stratagem.distribute.multi_worker_mirrored_strategy import (
            MultiWorkerMirroredStrategy,
        )

        return MultiWorkerMirroredStrategy()
    if chosen.kind in ("zero3", "zero2", "hsdp"):
        from stratagem.distribute.fully_sharded_strategy import FullyShardedStrategy

        mesh = None
        if chosen.kind == "hsdp":
            from stratagem.dtensor import create_mesh

            mesh = create_mesh([("replicate", s["replicate"]), ("shard", s["shard"])])
        return FullyShardedStrategy(
            reshard_after_forward=chosen.kind != "zero2", mesh=mesh, wrap=wrap
        )
    if chosen.kind == "mesh":
        from stratagem.distribute.mesh_strategy import MeshStrategy
        from stratagem.dtensor import create_mesh, megatron_layout_map

        if model is None:
            raise ValueError(f"{chosen.name}: building a Megatron mesh needs the model planned")
        mesh = create_mesh([("batch", s["data"]), ("model", s["model"])])
        return MeshStrategy(mesh, megatron_layout_map(mesh, model))
    from stratagem.distribute.pipeline_strategy import PipelineStrategy

    points = s["split_points"]
    named = points if facts.layers_are_sequential else [facts.layers[i].path for i in points]
    return PipelineStrategy(
        s["stages"],
        num_microbatches=s["stages"],
        split_points=named,
        num_replicas=s["replicas"],
    )
