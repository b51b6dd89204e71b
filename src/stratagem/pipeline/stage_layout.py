"""Which process runs which stage: stages x data-parallel replicas as a 2-D grid of ranks.

Rank ``r`` is stage ``r % num_stages`` of pipeline replica ``r // num_stages``: each replica's
stages are consecutive ranks (so a pipeline of 2 stages on 2 machines of 2 processes keeps its
point-to-point traffic inside one machine), and the replicas of one stage, which all-reduce
gradients, are ``num_stages`` ranks apart. With interleaving a rank holds ``stages_per_rank``
model chunks: chunk ``c`` runs on stage rank ``c % num_stages`` (Megatron's looped layout).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineLayout:
    num_stages: int
    num_replicas: int = 1
    stages_per_rank: int = 1

    def __post_init__(self) -> None:
        for name in ("num_stages", "num_replicas", "stages_per_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.num_stages * self.num_replicas

    @property
    def num_chunks(self) -> int:
        """How many pieces the model is cut into (stages x chunks per stage rank)."""
        return self.num_stages * self.stages_per_rank

    def check_world(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ValueError(
                f"a pipeline of num_stages={self.num_stages} x num_replicas={self.num_replicas} "
                f"needs {self.world_size} processes, but the job has {world_size}; start it with "
                f"`stratagem run -n {self.world_size}` or change num_stages/num_replicas"
            )

    def stage_of(self, rank: int) -> int:
        return rank % self.num_stages

    def replica_of(self, rank: int) -> int:
        return rank // self.num_stages

    def rank_of(self, stage: int, replica: int) -> int:
        return replica * self.num_stages + stage

    def pipeline_ranks(self, replica: int) -> list[int]:
        """The ranks of one pipeline replica, in stage order."""
        return [self.rank_of(s, replica) for s in range(self.num_stages)]

    def replica_ranks(self, stage: int) -> list[int]:
        """The ranks that hold the same stage in every replica (they all-reduce gradients)."""
        return [self.rank_of(stage, r) for r in range(self.num_replicas)]

    def chunks_of(self, stage: int) -> list[int]:
        """The model chunks a stage rank holds, in forward order."""
        return [stage + v * self.num_stages for v in range(self.stages_per_rank)]

    def stage_of_chunk(self, chunk: int) -> int:
        return chunk % self.num_stages
