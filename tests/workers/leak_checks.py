"""A MultiWorkerMirroredStrategy worker: models built, trained and dropped one after another;
what each step all-reduces, and whether the dropped parameters were freed. Writes what it
observed to result-<rank>.pt."""

import gc
import weakref

import torch
import torch.nn.functional as F

import stratagem as sg
from stratagem.comm.communicator import Traffic

strategy = sg.distribute.MultiWorkerMirroredStrategy()
comm = strategy.extended.communicator
rank, world = comm.rank, comm.world_size
out: dict = {"rank": rank}
g = torch.Generator().manual_seed(100 + rank)  # each worker its own examples
x, y = torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)


def plain(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(5, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3)
    )


def build(hidden: int) -> torch.nn.Module:
    with strategy.scope():
        return plain(hidden)


def expected_bytes(*models: torch.nn.Module) -> int:
    """What one all-reduce of these models' gradients (one bucket, two flags per parameter:
    gradient made, parameter held) sends."""
    params = [p for m in models for p in m.parameters()]
    traffic = Traffic()
    traffic.count("all_reduce", (sum(p.numel() for p in params) + 2 * len(params)) * 4, world)
    return traffic.bytes_sent


def step(model: torch.nn.Module) -> dict:
    """One SGD step of ``model``: what it sent, and its weights and gradients after."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def backward():
        (F.cross_entropy(model(x), y, reduction="sum") / (8 * world)).backward()

    bytes_before, reduces_before = comm.traffic.bytes_sent, comm.traffic.all_reduces
    strategy.run(backward)
    optimizer.step()
    return {
        "bytes": comm.traffic.bytes_sent - bytes_before,
        "all_reduces": comm.traffic.all_reduces - reduces_before,
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "grads": {k: p.grad.clone() for k, p in model.named_parameters()},
    }


# 1. A model trained, dropped everywhere; the next one's steps send its gradients alone.
first = build(16)
out["first"] = step(first)
out["first_expected"] = expected_bytes(first)
first_param = weakref.ref(next(first.parameters()))
del first
gc.collect()
out["first_collected"] = first_param() is None
second = build(32)
out["second"] = step(second)
out["second_expected"] = expected_bytes(second)

# 2. Dropped on worker 0 only (as when one process's collector runs late): its slots stay on
# both until both have let go, so the buckets match; the survivor keeps grad None, untrained.
third = build(8)
third_param = weakref.ref(next(third.parameters()))
if rank == 0:
    del third
gc.collect()
fourth = build(24)
out["fourth"] = step(fourth)
# Both send third's slots, worker 0 zeros (and second's, held but not trained).
out["fourth_expected"] = expected_bytes(second, plain(8), fourth)
if rank == 0:
    out["third_collected"] = third_param() is None
else:
    out["third_grads"] = [p.grad for p in third.parameters()]
    del third
gc.collect()
fifth = build(12)
out["fifth"] = step(fifth)
# second and fourth are still held (not trained): their slots travel with fifth's.
out["fifth_expected"] = expected_bytes(second, fourth, fifth)
out["second_grads_unchanged"] = all(
    torch.equal(p.grad, out["second"]["grads"][k]) for k, p in second.named_parameters()
)

# 3. A Keras model fitted, then dropped: nothing of the strategy's keeps it.
with strategy.scope():
    keras_module = plain(16)
    keras_model = sg.keras.Model(keras_module)
    keras_model.compile(
        sg.keras.optimizers.SGD(0.1),
        sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
keras_model.fit(x, y, batch_size=4, epochs=1, verbose=0)
keras_param = weakref.ref(next(keras_module.parameters()))
del keras_model, keras_module
gc.collect()
out["keras_collected"] = keras_param() is None

torch.save(out, f"result-{rank}.pt")
print(f"worker {rank} done", flush=True)
