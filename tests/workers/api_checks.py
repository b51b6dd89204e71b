"""A worker that exercises the cross-worker API; writes what it observed to result-<task>.pt."""

import time

import torch

import stratagem as sg
from workers.common import build_model

strategy = sg.distribute.MultiWorkerMirroredStrategy()
task = strategy.cluster_resolver.task_id
n = strategy.num_replicas_in_sync
out = {"task": task, "n": n, "is_chief": strategy.extended.should_checkpoint}

# reduce / gather of values that differ per worker ------------------------------------------
value = torch.tensor([[1.0 + task, 10.0 * (task + 1)]])  # shape [1, 2]
out["reduce"] = {op: strategy.reduce(op, value, axis=None) for op in ("SUM", "MEAN", "MAX", "MIN")}
uneven = torch.arange(task + 1, dtype=torch.float32) + 100 * task  # worker w holds w+1 values
out["reduce_axis0_mean"] = strategy.reduce("MEAN", uneven, axis=0)
out["reduce_axis0_sum"] = strategy.reduce("SUM", uneven, axis=0)
out["gather"] = strategy.gather(uneven, axis=0)


def replica_all_reduce():
    ctx = sg.distribute.get_replica_context()
    return ctx.all_reduce("SUM", torch.tensor(float(ctx.replica_id_in_sync_group + 1)))


out["replica_all_reduce"] = strategy.run(replica_all_reduce)

# exactly-once input: global batches split across workers ------------------------------------
ids = sg.data.Dataset.range(50).shuffle(50).batch(8)  # unseeded shuffle: seeds must agree
seen = []
for epoch in range(2):
    for batch in strategy.experimental_distribute_dataset(ids):
        seen.append((epoch, batch.tolist()))
out["distributed_ids"] = seen


def per_worker(ctx):
    ds = sg.data.Dataset.range(40).shuffle(40)  # shuffle, then shard: shards must be disjoint
    return ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(4)


out["from_function_ids"] = [
    b.tolist() for b in strategy.distribute_datasets_from_function(per_worker)
]


def uneven_pipeline(ctx):
    # worker 0 gets 3 batches, worker 1 gets 2: as TF, both go on for 3 steps, worker 1's last
    # one an empty batch shaped like its others.
    return [torch.ones(2, 5)] * (3 if ctx.input_pipeline_id == 0 else 2)


out["uneven_shapes"] = [
    tuple(b.shape) for b in strategy.distribute_datasets_from_function(uneven_pipeline)
]


def empty_pipeline(ctx):
    # worker 1 has no batch at all: nothing to shape an empty one on, so every worker stops.
    return [torch.ones(2)] * (3 if ctx.input_pipeline_id == 0 else 0)


out["empty_steps"] = sum(1 for _ in strategy.distribute_datasets_from_function(empty_pipeline))

# metrics are global ---------------------------------------------------------------------------
metric = sg.keras.metrics.SparseCategoricalAccuracy()
logits = torch.tensor([[5.0, 0.0], [0.0, 5.0], [5.0, 0.0]])
labels = torch.tensor([0, 1, 1]) if task == 0 else torch.tensor([1, 1, 1])
strategy.run(lambda: metric.update_state(labels, logits))
out["accuracy"] = metric.result()

# gradient accumulation, unused and one-sided parameters ---------------------------------------
torch.manual_seed(0)
with strategy.scope():
    model = build_model()
    unused = torch.nn.Linear(2, 2)  # never used: its grads must stay None
    one_sided = torch.nn.Linear(2, 1)  # used on worker 1 only


def accumulate():
    x = torch.full((2, 5), float(task + 1))
    for i in range(2):  # two backward passes before any step: each must be counted once
        loss = model(x).sum()
        if task == 1 and i == 1:
            loss = loss + one_sided(torch.ones(1, 2)).sum()
        loss.backward()


strategy.run(accumulate)
out["accumulated_grads"] = {k: p.grad.clone() for k, p in model.named_parameters()}
out["unused_grad_is_none"] = all(p.grad is None for p in unused.parameters())
out["one_sided_grad"] = one_sided.weight.grad.clone() if one_sided.weight.grad is not None else None
out["initial"] = {k: v.detach().clone() for k, v in model.state_dict().items()}

# PyTorch's per-replica mean convention, as an explicit option ---------------------------------
mean_strategy = sg.distribute.MultiWorkerMirroredStrategy(gradient_aggregation="mean")
with mean_strategy.scope():
    mean_model = build_model()
x = torch.full((3, 5), float(task + 1))
mean_strategy.run(lambda: mean_model(x).mean().backward())
out["mean_aggregated"] = {k: p.grad.clone() for k, p in mean_model.named_parameters()}
out["mean_initial"] = {k: v.detach().clone() for k, v in mean_model.state_dict().items()}

# checkpoints: every worker saves to the same directory, only the chief writes ------------------
epoch = torch.tensor(3)
manager = sg.train.CheckpointManager(
    sg.train.Checkpoint(model=model, epoch=epoch), "shared_ckpt", 2
)
out["saved_path"] = manager.save()


# a save is collective: worker 1 restores what the chief wrote right after each save ----------
class SlowToSave:
    """A trackable the chief (only the writer reads it) takes ``delay`` seconds to read: a save
    that were not collective would let worker 1 reach its restore before the chief's write.
    The delay only widens that gap, so that such a save fails this check; a collective save
    passes whatever the delay."""

    delay = 0.0

    def state_dict(self):
        time.sleep(self.delay)
        return {}

    def load_state_dict(self, state):
        pass


slow = SlowToSave()
with strategy.scope():
    layer = torch.nn.Linear(2, 1)


def fill(value):
    with torch.no_grad():
        layer.weight.fill_(value)
        layer.bias.fill_(value)


def saved_slowly(save):
    slow.delay = 0.5
    try:
        return save()
    finally:
        slow.delay = 0.0


def restored(path):
    """Worker 1: its weights spoiled, then ``path`` restored: the weight it holds (or why not)."""
    fill(-1.0)
    try:
        sg.train.Checkpoint(layer=layer, slow=slow).restore(path)
    except Exception as e:  # the result names it: a checkpoint not there yet
        return f"{type(e).__name__}: {e}"
    return layer.weight.flatten()[0].item()


# Each time a first value is saved before, so an old checkpoint is there to be read instead.
collective = sg.train.CheckpointManager(
    sg.train.Checkpoint(layer=layer, slow=slow), "collective", max_to_keep=None
)
fill(1.0)
collective.save()
fill(2.0)
saved_slowly(collective.save)
if task == 1:
    out["manager_restored"] = restored(collective.latest_checkpoint)
plain = sg.train.Checkpoint(layer=layer, slow=slow)
fill(3.0)
plain.save("plain/ckpt")
fill(4.0)
saved_slowly(lambda: plain.save("plain/ckpt"))
if task == 1:
    out["save_restored"] = restored(sg.train.latest_checkpoint("plain"))
fill(5.0)
plain.write("written")
fill(6.0)
saved_slowly(lambda: plain.write("written"))
if task == 1:
    out["write_restored"] = restored("written")

# optimizer.iterations counts a custom loop's steps, one per step ------------------------------
with strategy.scope():
    keras_model = sg.keras.Model(torch.nn.Linear(2, 1))
    keras_model.compile(sg.keras.optimizers.SGD(0.1), loss="mse")


def custom_step():
    loss = keras_model(torch.ones(2, 2)).sum()
    keras_model.optimizer.zero_grad()
    loss.backward()
    keras_model.optimizer.step()


for _ in range(3):
    strategy.run(custom_step)
out["custom_loop_iterations"] = keras_model.optimizer.iterations
torch.save(out, f"result-{task}.pt")
