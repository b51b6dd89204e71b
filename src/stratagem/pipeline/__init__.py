"""Pipeline parallelism: splitting a model into stages (an nn.Sequential, or a traced model at
module paths), the schedules, PipeDream's weight stashing.

The strategy that uses these is ``sg.distribute.experimental.PipelineStrategy``.
"""

from stratagem.pipeline.pipedream import PipeDreamStage, Recorder, one_f_one_b_order
from stratagem.pipeline.split import (
    balanced_split_points,
    check_split_points,
    resolve_split_points,
    split_sequential,
)
from stratagem.pipeline.stage_layout import PipelineLayout
from stratagem.pipeline.stages import PipelineModel, StepStats
from stratagem.pipeline.trace import TracedPieces, UntraceableModelError

__all__ = [
    "PipeDreamStage",
    "PipelineLayout",
    "PipelineModel",
    "Recorder",
    "StepStats",
    "TracedPieces",
    "UntraceableModelError",
    "balanced_split_points",
    "check_split_points",
    "one_f_one_b_order",
    "resolve_split_points",
    "split_sequential",
]
