"""A worker that records what each AutoShardPolicy gives it; writes result-<task>.pt."""

import torch

import stratagem as sg

strategy = sg.distribute.MultiWorkerMirroredStrategy()
task = strategy.cluster_resolver.task_id
Policy = sg.data.experimental.AutoShardPolicy
out = {}


def steps(dataset):
    return [batch.tolist() for batch in strategy.experimental_distribute_dataset(dataset)]


def with_policy(dataset, policy):
    options = sg.data.Options()
    options.experimental_distribute.auto_shard_policy = policy
    return dataset.with_options(options)


for policy in (Policy.AUTO, Policy.DATA, Policy.OFF):
    out[policy.name] = steps(with_policy(sg.data.Dataset.range(12).batch(4), policy))
hinted = sg.data.Dataset.range(12).shard(sg.data.experimental.SHARD_HINT, -1).batch(4)
out["HINT"] = steps(with_policy(hinted, Policy.HINT))
try:
    steps(with_policy(sg.data.Dataset.range(12).batch(4), Policy.FILE))
except sg.errors.InputError as error:
    out["FILE"] = str(error)
try:
    steps(hinted)  # the default policy (AUTO) does not fill SHARD_HINT in
except sg.errors.InputError as error:
    out["HINT_without_policy"] = str(error)
# input_lib_test.testMWMSPartialBatch: OFF, range(12).batch(8) rebatched into [4, 4].
out["TF_PARTIAL_OFF"] = steps(with_policy(sg.data.Dataset.range(12).batch(8), Policy.OFF))
# testMWMSPartialBatchWithLegacyRebatch: batches not made by batch() (no static batch size):
# each batch is cut by its own size, the last one too.
legacy = sg.data.Dataset.range(12).batch(8).map(lambda x: x)
out["TF_LEGACY_OFF"] = steps(with_policy(legacy, Policy.OFF))
# testMWMSWithDataSharding: AUTO and DATA, range(8).batch(3): legacy rebatch, then the shard.
for policy in (Policy.AUTO, Policy.DATA):
    out[f"TF_DATA_SHARDING_{policy.name}"] = steps(
        with_policy(sg.data.Dataset.range(8).batch(3), policy)
    )
# batch_sizes_for_worker: G=7 on 2 workers is [4, 3] on worker 0 and [3, 4] on worker 1, so
# each step holds 7 examples, the global batch compute_average_loss divides by.
rotated = with_policy(sg.data.Dataset.range(14).batch(7), Policy.OFF)
out["ROTATED"] = steps(rotated)
out["ROTATED_AVERAGE"] = [
    float(strategy.run(lambda x: sg.nn.compute_average_loss(torch.ones(x.shape[0])), args=(b,)))
    for b in strategy.experimental_distribute_dataset(rotated)
]
# One worker's own stream ends first: the other goes on, this one gets an empty batch.
uneven = sg.data.Dataset.range(13).shard(sg.data.experimental.SHARD_HINT, -1).batch(4)
out["HINT_UNEVEN"] = steps(with_policy(uneven, Policy.HINT))
torch.save(out, f"result-{task}.pt")
