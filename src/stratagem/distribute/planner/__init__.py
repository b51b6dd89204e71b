"""``sg.distribute.plan`` and ``sg.distribute.auto``: choose how to distribute a model.

The planner traces one training step on the meta device (``model_trace``), prices each way to
distribute it by memory per device and bytes sent per step (``cost_model``, ``candidates``)
and chooses the cheapest that fits (``choose``); ``str(plan)`` is the table of every
candidate (``plan_table``). FSDP, DTensor and pipelines are imported only when a plan needs
them.
"""

from stratagem.distribute.planner.candidates import Candidate, ClusterShape
from stratagem.distribute.planner.choose import Plan, PlanDoesNotFitError, auto, plan
from stratagem.distribute.planner.cost_model import Memory
from stratagem.distribute.planner.model_trace import ModelFacts, trace_model

__all__ = [
    "Candidate",
    "ClusterShape",
    "Memory",
    "ModelFacts",
    "Plan",
    "PlanDoesNotFitError",
    "auto",
    "plan",
    "trace_model",
]
