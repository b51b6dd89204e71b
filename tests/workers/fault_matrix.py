"""A task of a 2-process job that trains until stopped, under STRATEGY: ``mwms``, ``mesh``
(data-parallel DTensor mesh, a sharded layout), ``mesh_loop`` (the same layout in the script's
own loop, no strategy.run) or ``pipeline`` (two stages). It prints
``step N`` every 5 steps; tests/test_fault_matrix.py kills or stops one task mid-training and
reads how the other fails."""

import os

import torch
import torch.nn.functional as F

import stratagem as sg

kind = os.environ["STRATEGY"]
torch.manual_seed(0)


def net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
if kind == "mwms":
    strategy = sg.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        def replica() -> None:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()

        strategy.run(replica)
elif kind == "mesh":
    from stratagem import dtensor

    mesh = dtensor.create_mesh([("batch", 2)], device_type="cpu")
    layout_map = dtensor.LayoutMap(mesh)
    layout_map["0.weight"] = dtensor.Layout(["batch", dtensor.UNSHARDED], mesh)
    strategy = sg.distribute.experimental.MeshStrategy(mesh, layout_map)
    with strategy.scope():
        model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        def replica(xs: torch.Tensor, ys: torch.Tensor) -> None:
            optimizer.zero_grad()
            F.cross_entropy(model(xs), ys).backward()
            optimizer.step()

        strategy.run(replica, args=(x[:8], y[:8]))
elif kind == "mesh_loop":
    # The DTensor seed's own loop: the model laid out on the mesh, trained without strategy.run,
    # so DTensor's collectives run outside stratagem's operations.
    from stratagem import dtensor

    mesh = dtensor.create_mesh([("batch", 2)], device_type="cpu")
    layout_map = dtensor.LayoutMap(mesh)
    layout_map["0.weight"] = dtensor.Layout(["batch", dtensor.UNSHARDED], mesh)
    model = layout_map.apply(net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = dtensor.copy_to_mesh(x, dtensor.Layout.replicated(mesh, 2))
    ys = dtensor.copy_to_mesh(y, dtensor.Layout.replicated(mesh, 1))

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(xs), ys).backward()
        optimizer.step()
elif kind == "pipeline":
    strategy = sg.distribute.experimental.PipelineStrategy(
        schedule="1F1B", num_microbatches=2, split_points=[2]
    )
    pipe = strategy.pipeline(net(), F.cross_entropy)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)

    def step() -> None:
        pipe.train_step(x, y, optimizer)
else:
    raise SystemExit(f"STRATEGY={kind!r}: expected mwms, mesh, mesh_loop or pipeline")

i = 0
while True:
    step()
    i += 1
    if i % 5 == 0:
        print(f"step {i}", flush=True)
