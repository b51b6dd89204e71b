"""Two workers: ``fit`` of the tiny language model on its own loss (workers/token_lm.py) under
MultiWorkerMirroredStrategy, FullyShardedStrategy and a data-parallel MeshStrategy, with
gradient accumulation 1, 2 and 4 (a mesh: 1); each worker holds halves of 1 and 97 real
tokens. Writes ``result-<rank>.pt``: each run's change of the weights (whole tensors)."""

import torch

import stratagem as sg
from workers.token_lm import LR, MICRO, TinyLM, data


def whole(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t).clone()


def update(strategy: sg.distribute.Strategy, k: int) -> dict[str, torch.Tensor]:
    with strategy.scope():
        model = sg.keras.Model(TinyLM())
        steps = k if k > 1 else None
        model.compile(sg.keras.optimizers.SGD(LR, gradient_accumulation_steps=steps))
    initial = {n: whole(p) for n, p in model.module.named_parameters()}
    ids, labels = data()
    model.fit(ids, labels, batch_size=MICRO, shuffle=False, verbose=0)
    return {n: initial[n] - whole(p) for n, p in model.module.named_parameters()}


mwms = sg.distribute.MultiWorkerMirroredStrategy()
rank = mwms.cluster_resolver.task_id
out = {}
for k in (1, 2, 4):
    out[f"mwms-{k}"] = update(mwms, k)
for k in (1, 2, 4):
    out[f"fsdp-{k}"] = update(sg.distribute.experimental.FullyShardedStrategy(), k)
# A mesh refuses gradient accumulation (DTensor reduces each gradient inside backward).
mesh = sg.dtensor.create_mesh([("batch", 2)])
out["mesh-1"] = update(sg.distribute.experimental.MeshStrategy(mesh), 1)
torch.save(out, f"result-{rank}.pt")
