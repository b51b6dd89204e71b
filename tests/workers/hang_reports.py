"""A task of a 2-process job under STRATEGY (``mwms``, ``mesh``, ``mesh_loop``, ``fsdp``,
``pipeline``) where task SKIPPER misses the collectives of step SKIP_STEP. HANG says how:
``skip``: it goes straight to the job's final barrier instead (a collective the other task never
reaches while it waits in that step); ``busy``: it stays out of collectives (as if stuck in its
own code) until a file ``resume`` appears in its directory, then goes on with the step. It prints
``skipping step N at <time.time()>`` first. tests/test_hang_reports.py reads how both end."""

import os
import time

import torch
import torch.nn.functional as F

import stratagem as sg

kind = os.environ["STRATEGY"]
skipper, skip_step = int(os.environ["SKIPPER"]), int(os.environ["SKIP_STEP"])
torch.manual_seed(0)


def net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
if kind in ("mwms", "fsdp"):
    strategy = (
        sg.distribute.MultiWorkerMirroredStrategy()
        if kind == "mwms"
        else sg.distribute.experimental.FullyShardedStrategy()
    )
    with strategy.scope():
        model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        def replica() -> None:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()

        strategy.run(replica)
elif kind in ("mesh", "mesh_loop"):
    from stratagem import dtensor

    mesh = dtensor.create_mesh([("batch", 2)], device_type="cpu")
    layout_map = dtensor.LayoutMap(mesh)
    layout_map["0.weight"] = dtensor.Layout(["batch", dtensor.UNSHARDED], mesh)
    if kind == "mesh":
        strategy = sg.distribute.experimental.MeshStrategy(mesh, layout_map)
        with strategy.scope():
            model = net()
    else:
        strategy = None
        model = layout_map.apply(net())
        xs = dtensor.copy_to_mesh(x, dtensor.Layout.replicated(mesh, 2))
        ys = dtensor.copy_to_mesh(y, dtensor.Layout.replicated(mesh, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        if strategy is None:
            optimizer.zero_grad()
            F.cross_entropy(model(xs), ys).backward()
            optimizer.step()
            return

        def replica(xs: torch.Tensor, ys: torch.Tensor) -> None:
            optimizer.zero_grad()
            F.cross_entropy(model(xs), ys).backward()
            optimizer.step()

        strategy.run(replica, args=(x[:8], y[:8]))
elif kind == "pipeline":
    strategy = sg.distribute.experimental.PipelineStrategy(
        schedule="1F1B", num_microbatches=2, split_points=[2]
    )
    pipe = strategy.pipeline(net(), F.cross_entropy)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)

    def step() -> None:
        pipe.train_step(x, y, optimizer)
else:
    raise SystemExit(f"STRATEGY={kind!r}: expected mwms, mesh, mesh_loop, fsdp or pipeline")


def final_barrier() -> None:
    if strategy is not None:
        strategy.extended.barrier("the end of training")
    else:  # the script's own loop: its own collective
        torch.distributed.all_reduce(torch.zeros(1))


for i in range(1, skip_step + 3):
    if i == skip_step and torch.distributed.get_rank() == skipper:
        print(f"skipping step {i} at {time.time():.3f}", flush=True)
        if os.environ["HANG"] == "skip":
            break  # this task skips the collectives of this step and the next ones
        # "busy": this task stays out of collectives until the test lets it go on.
        while not os.path.exists("resume"):
            time.sleep(0.05)
    step()
final_barrier()
print("finished", flush=True)
