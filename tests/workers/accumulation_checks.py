"""A MultiWorkerMirroredStrategy worker: gradient accumulation and compressed all-reduce,
counted through the communicator. Writes what it observed to result-<rank>.pt."""

import torch
import torch.nn.functional as F

import stratagem as sg
from stratagem.comm.bucketing import GradientReducer
from stratagem.config.threading import usable_cpus
from workers.common import build_model

# As many intra-op threads as the host has cores: the workers fill it, so the automatic pack
# (bytes_per_pack=0) is one pack on any machine (checked last).
torch.set_num_threads(usable_cpus())
strategy = sg.distribute.MultiWorkerMirroredStrategy()
comm = strategy.extended.communicator
rank = comm.rank
MICRO, K = 6, 4
GLOBAL = MICRO * K * comm.world_size
out: dict = {"rank": rank}

torch.manual_seed(0)
with strategy.scope():
    model = build_model()
initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
out["initial"] = initial
g = torch.Generator().manual_seed(100 + rank)  # each worker its own examples
micro = [
    (torch.randn(MICRO, 5, generator=g), torch.randint(0, 3, (MICRO,), generator=g))
    for _ in range(K)
]
out["micro"] = micro


def backward(x, y):
    (F.cross_entropy(model(x), y, reduction="sum") / GLOBAL).backward()


def one_step(passes, accumulate):
    """Reset to the initial weights, run the backward passes (those marked True inside
    accumulate_gradients()), step; the gradients, weights and traffic of the step."""
    model.load_state_dict(initial)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer.zero_grad()
    bytes_before, reduces_before = comm.traffic.bytes_sent, comm.traffic.all_reduces
    for (x, y), deferred in zip(passes, accumulate):
        if deferred:
            with strategy.extended.accumulate_gradients():
                strategy.run(backward, args=(x, y))
        else:
            strategy.run(backward, args=(x, y))
    optimizer.step()
    return {
        "grads": {k: p.grad.clone() for k, p in model.named_parameters()},
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "bytes": comm.traffic.bytes_sent - bytes_before,
        "all_reduces": comm.traffic.all_reduces - reduces_before,
    }


whole = (torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro]))
out["whole"] = one_step([whole], [False])
out["accumulated"] = one_step(micro, [True, True, True, False])  # reduced by the 4th backward
out["deferred_to_step"] = one_step(micro, [True] * 4)  # reduced by optimizer.step()
out["every_pass"] = one_step(micro, [False] * 4)  # today's accumulation: a reduction each

# Keras: gradient_accumulation_steps=4 on micro-batches vs one batch 4 times larger ---------


with strategy.scope():
    module = build_model()
    keras_model = sg.keras.Model(module)


def keras_fit(batch_size, k):
    # One model for both fits: the reducer covers every model built in the scope, so a second
    # model would change the bytes of each reduction.
    module.load_state_dict(initial)
    with strategy.scope():
        keras_model.compile(
            sg.keras.optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=k),
            sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    gx = torch.Generator().manual_seed(7)
    x, y = torch.randn(96, 5, generator=gx), torch.randint(0, 3, (96,), generator=gx)
    # The gradients' bytes: those sent in the train steps' backward and step (fit's input and
    # metrics send others, which depend on the number of batches).
    optimizer, sent = keras_model.optimizer, [0]

    def counted(fn):
        def call(*args, **kwargs):
            before = comm.traffic.bytes_sent
            result = fn(*args, **kwargs)
            sent[0] += comm.traffic.bytes_sent - before
            return result

        return call

    optimizer.backward, optimizer.step = counted(optimizer.backward), counted(optimizer.step)
    keras_model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return {
        "weights": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "iterations": keras_model.optimizer.iterations,
        "bytes": sent[0],
    }


out["fit_accumulated"] = keras_fit(12, K)
out["fit_whole"] = keras_fit(12 * K, None)

# compression: the gradient reducer on plain modules (no strategy), float32 vs 16 bits --------


def reduced_grads(compression, scale=1.0):
    torch.manual_seed(1)
    module = build_model()
    module.load_state_dict(initial)
    reducer = GradientReducer(comm, compression=compression)
    reducer.add_parameters(list(module.parameters()))
    before = comm.traffic.bytes_sent
    x, y = whole
    (F.cross_entropy(module(x), y, reduction="sum") * scale / GLOBAL).backward()
    sent = comm.traffic.bytes_sent - before
    reducer.remove()
    return {k: p.grad.clone() for k, p in module.named_parameters()}, sent


local_module = build_model()
local_module.load_state_dict(initial)
(F.cross_entropy(local_module(whole[0]), whole[1], reduction="sum") / GLOBAL).backward()
local = {k: p.grad.clone() for k, p in local_module.named_parameters()}
out["local_grads"] = local
out["peer_local_grads"] = {k: comm.all_gather(g, what=k) for k, g in local.items()}
manual = {}
for k, grad in local.items():
    summed = grad.clone()
    comm.all_reduce(summed, what=f"manual sum of {k}")
    manual[k] = summed
out["manual_sum"] = manual
out["fp32"], out["fp32_bytes"] = reduced_grads(None)
out["bf16"], out["bf16_bytes"] = reduced_grads("bf16")
out["fp16"], out["fp16_bytes"] = reduced_grads("fp16")
# Gradients far below fp16's smallest value (6e-8), in a bucket whose flags are 1.
out["fp32_tiny"], _ = reduced_grads(None, scale=1e-9)
out["fp16_tiny"], _ = reduced_grads("fp16", scale=1e-9)


def overlap():
    """Bytes sent during each of 4 accumulated backward passes, and before the gradient of the
    first layer's output was computed (while backward still had layers to go): with one
    bucket per parameter, the last pass sends the later layers' buckets before it ends."""
    module = build_model()
    module.load_state_dict(initial)
    reducer = GradientReducer(comm, first_bucket_bytes=64, bucket_bytes=64)
    reducer.add_parameters(list(module.parameters()))
    passes = []
    for i, (x, y) in enumerate(micro):
        reducer.deferring = i < K - 1
        before, mid = comm.traffic.bytes_sent, []
        hidden = module[0](x)
        hidden.register_hook(lambda g, mid=mid: mid.append(comm.traffic.bytes_sent))
        (F.cross_entropy(module[1:](hidden), y, reduction="sum") / GLOBAL).backward()
        passes.append((mid[0] - before, comm.traffic.bytes_sent - before))
    reducer.remove()
    return passes


out["overlap"] = overlap()

# The automatic pack: a model of 4.3 MB (four buckets at the sizes given explicitly) goes, with
# everything else the reducer holds, in one all-reduce. Last, as it adds to every reduction.
with strategy.scope():
    wide = torch.nn.Sequential(*(torch.nn.Linear(600, 600) for _ in range(3)))
before = comm.traffic.all_reduces
strategy.run(lambda: wide(torch.randn(4, 600)).sum().backward())
out["wide_all_reduces"] = comm.traffic.all_reduces - before

torch.save(out, f"result-{rank}.pt")
print(f"worker {rank} done", flush=True)
