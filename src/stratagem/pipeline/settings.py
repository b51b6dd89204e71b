"""``PipelineSettings``: how a strategy's pipelines run, the same for every model it cuts."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from stratagem.pipeline.stage_layout import PipelineLayout


@dataclass(frozen=True)
class PipelineSettings:
    """The rank layout, the schedule and its options, and the process groups of a pipeline.

    ``pipeline_group`` holds this replica's stages and ``replica_group`` this stage's replicas
    (None without data parallelism); ``timeout`` bounds each send or receive between stages.
    """

    layout: PipelineLayout
    schedule: str
    num_microbatches: int
    weight_stashing: bool
    drain_each_step: bool
    timeout: float
    pipeline_group: dist.ProcessGroup | None = None
    replica_group: dist.ProcessGroup | None = None
