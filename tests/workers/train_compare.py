"""A worker that trains build_model() with SGD and with Adam under MultiWorkerMirroredStrategy.

Each worker seeds torch differently (SEED), so identical parameters afterwards show that the
chief's initial values were broadcast. Writes result-<task>.pt with the initial and final
parameters of each optimizer's model.
"""

import os
import sys

import torch

import stratagem as sg
from workers.common import build_model, global_batches, make_optimizer

torch.manual_seed(int(os.environ["SEED"]))
strategy = sg.distribute.MultiWorkerMirroredStrategy()
task = strategy.cluster_resolver.task_id
result = {"num_replicas": strategy.num_replicas_in_sync}
for name in sys.argv[1:]:
    with strategy.scope():
        model = build_model()
        optimizer = make_optimizer(name, model.parameters())
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dataset = strategy.experimental_distribute_dataset(global_batches())

    def step(batch, model=model, optimizer=optimizer):
        x, y = batch
        per_example = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = sg.nn.compute_average_loss(per_example)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss

    first_step_params = None
    for i, batch in enumerate(dataset):
        strategy.run(step, args=(batch,))
        if i == 0:
            first_step_params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    result[name] = {
        "initial": initial,
        "after_step_1": first_step_params,
        "final": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }
torch.save(result, f"result-{task}.pt")
