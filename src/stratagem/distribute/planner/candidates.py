"""The plans the planner weighs, each priced by ``cost_model`` against a cluster's shape.

``ClusterShape(hosts, devices_per_host, memory_per_device)`` is all the planner knows of a
cluster. ``candidates(facts, cluster, slots)`` returns one ``Candidate`` per plan: MWMS, FSDP
ZeRO-3 and ZeRO-2, HSDP for every (replicate, shard) factorization of the world, a (data,
model) mesh with Megatron's layouts for every model size that divides the world (when the
model has such projections), and a pipeline for every stage count that divides the world
(when it has layers), its split points balanced by memory or by parameters, whichever sends
less. ``exhaustive=True`` tries every contiguous split instead (the reference of the tests).
Each candidate says whether it fits ``memory_per_device`` and, if not, by how much it misses.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from stratagem.distribute.planner import cost_model
from stratagem.distribute.planner.cost_model import Memory
from stratagem.distribute.planner.model_trace import ModelFacts


@dataclass(frozen=True)
class ClusterShape:
    """``hosts`` machines of ``devices_per_host`` devices (one process each), each device with
    ``memory_per_device`` bytes (None: no limit)."""

    hosts: int
    devices_per_host: int
    memory_per_device: int | None = None

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.devices_per_host < 1:
            raise ValueError(
                f"ClusterShape: hosts={self.hosts} and devices_per_host="
                f"{self.devices_per_host}; expected at least one of each"
            )
        if self.memory_per_device is not None and self.memory_per_device <= 0:
            raise ValueError(
                f"ClusterShape: memory_per_device={self.memory_per_device}; expected a "
                "positive number of bytes or None"
            )

    @property
    def world(self) -> int:
        return self.hosts * self.devices_per_host


@dataclass(frozen=True)
class Candidate:
    """One plan priced: its memory peak per device, the bytes a device sends per step, and
    whether it fits (``reason`` says why it was refused, or what it is)."""

    name: str
    kind: str  # mirrored, zero3, zero2, hsdp, mesh, pipeline
    memory: Memory
    bytes_per_step: float
    fits: bool
    reason: str
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def shortfall(self) -> int:
        """Bytes over the budget (0 when it fits)."""
        return 0 if self.fits else int(self.settings.get("over", 0))


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


def _pipeline_splits(
    facts: ModelFacts, stages: int, slots: int, exhaustive: bool
) -> Iterator[list[int]]:
    n = len(facts.layers)
    if exhaustive:
        yield from (list(c) for c in itertools.combinations(range(1, n), stages - 1))
        return
    from stratagem.pipeline.split import balanced_split_points  # only when planning pipelines

    by_params = [float(x.param_bytes) + 1 for x in facts.layers]
    by_params[0] += facts.pre.param_bytes
    by_params[-1] += facts.post.param_bytes
    by_memory = [
        (2 + slots) * p + (stages) * x.saved_bytes
        for p, x in zip(by_params, facts.layers, strict=True)
    ]
    by_memory[0] += stages * facts.pre.saved_bytes
    by_memory[-1] += facts.post.saved_bytes
    seen = []
    for costs in (by_params, by_memory):
        points = balanced_split_points(costs, stages)
        if points not in seen:
            seen.append(points)
            yield points


def _priced(
    cluster: ClusterShape, name: str, kind: str, memory: Memory, sent: float, **settings: Any
) -> Candidate:
    budget = cluster.memory_per_device
    if budget is None or memory.peak <= budget:
        return Candidate(name, kind, memory, sent, True, "fits", settings)
    over = memory.peak - budget
    return Candidate(
        name,
        kind,
        memory,
        sent,
        False,
        f"needs {over / 2**20:,.1f} MiB more",
        {**settings, "over": over},
    )


def candidates(
    facts: ModelFacts, cluster: ClusterShape, slots: int, exhaustive: bool = False
) -> Iterator[Candidate]:
    """Every plan for ``facts`` on ``cluster`` with an optimizer of ``slots`` state slots."""
    world = cluster.world
    memory, sent = cost_model.mirrored(facts, world, slots)
    yield _priced(cluster, "MultiWorkerMirrored", "mirrored", memory, sent)
    if world == 1:
        return
    for reshard, kind, name in ((True, "zero3", "FSDP ZeRO-3"), (False, "zero2", "FSDP ZeRO-2")):
        memory, sent = cost_model.sharded(facts, world, 1, slots, reshard)
        yield _priced(cluster, name, kind, memory, sent, reshard=reshard)
    for shard in _divisors(world)[:-1]:
        replicate = world // shard
        memory, sent = cost_model.sharded(facts, shard, replicate, slots, True)
        yield _priced(
            cluster,
            f"HSDP {replicate}x{shard}",
            "hsdp",
            memory,
            sent,
            replicate=replicate,
            shard=shard,
        )
    if facts.megatron_bytes:
        for model in _divisors(world):
            data = world // model
            memory, sent = cost_model.megatron_mesh(facts, data, model, slots)
            yield _priced(
                cluster,
                f"Mesh {data}x{model} Megatron",
                "mesh",
                memory,
                sent,
                data=data,
                model=model,
            )
    for stages in _divisors(world):
        if stages > len(facts.layers):
            break
        replicas = world // stages
        best: Candidate | None = None
        for points in _pipeline_splits(facts, stages, slots, exhaustive):
            memory, sent, _ = cost_model.pipeline(facts, stages, replicas, slots, points)
            one = _priced(
                cluster,
                f"Pipeline {stages} stages x{replicas}",
                "pipeline",
                memory,
                sent,
                stages=stages,
                replicas=replicas,
                split_points=points,
            )
            if best is None or _better(one, best):
                best = one
        if best is not None:
            yield best


def _better(a: Candidate, b: Candidate) -> bool:
    """Fitting beats not fitting; then fewer bytes per step; then a lower peak."""
    key_a = (not a.fits, a.bytes_per_step if a.fits else a.shortfall, a.memory.peak)
    key_b = (not b.fits, b.bytes_per_step if b.fits else b.shortfall, b.memory.peak)
    return key_a < key_b


def cheapest(found: list[Candidate]) -> Candidate:
    """The candidate to choose: the fitting one that sends least (then the smallest peak)."""
    best = found[0]
    for c in found[1:]:
        if _better(c, best):
            best = c
    return best
