"""Exact resume of a sync parameter-server job on another number of workers (launched by the
test through ``stratagem run -n W --ps 1``): the custom loop of ``resume_data`` over its
dataset with ``AutoShardPolicy.DATA`` (each worker takes its part of every global batch).

argv: phase (``first``: train STOP steps and checkpoint model, optimizer, iterator and step;
``second``: restore and train to the end). Writes ``<phase>-<task>.pt``: the ids this worker
consumed per step (its ledger) and, after a pull, the ps's parameters.
"""

import sys

import torch

import stratagem as sg
from workers.resume_data import custom_loop, data_sharded

phase = sys.argv[1]
strategy = sg.distribute.ParameterServerStrategy(mode="sync")
# Only workers get here: on a ps task the constructor served the job and exited.
model = custom_loop(strategy, phase, "custom/ckpt", data=data_sharded)
strategy.pull()
result = {
    "seen": model.seen,
    "final": {k: v.detach().clone() for k, v in model.net.state_dict().items()},
    "steps": strategy.ps_stats()[0]["steps"] if strategy.extended.should_checkpoint else None,
}
torch.save(result, f"{phase}-{strategy.cluster_resolver.task_id}.pt")
