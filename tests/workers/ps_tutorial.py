"""TensorFlow's "Parameter server training with ParameterServerStrategy" tutorial, ported cell
by cell with only the porting table's substitutions (``docs/porting.md``):
``stratagem run --chief -n 3 --ps 2 THIS WORKING_DIR`` (the tutorial's NUM_WORKERS = 3 and
NUM_PS = 2). Every task runs this file; workers and ps tasks stop at ``server.join()``.
The tutorial's own ``assert``s run here; what it prints is checked by
``tests/test_tutorial_parameter_server_training.py``, which also reads ``result.json``.
"""

import json
import os
import random
import sys

import torch

import stratagem as sg

# ------------------------------------------------------------------------------ cluster setup
# port: create_in_process_cluster(NUM_WORKERS, NUM_PS) -> `stratagem run --chief -n 3 --ps 2`,
# which sets TF_CONFIG for each task (the tutorial's "Clusters in the real world").
NUM_WORKERS = 3
NUM_PS = 2
cluster_resolver = sg.distribute.cluster_resolver.TFConfigClusterResolver()
if cluster_resolver.task_type in ("worker", "ps"):
    server = sg.distribute.Server(
        cluster_resolver.cluster_spec(),
        job_name=cluster_resolver.task_type,
        task_index=cluster_resolver.task_id,
        protocol="grpc",
        start=True,
    )
    server.join()

# ------------------------------------------------------------ instantiate the strategy
variable_partitioner = sg.distribute.experimental.partitioners.MinSizePartitioner(
    min_shard_bytes=(256 << 10), max_shards=NUM_PS
)

strategy = sg.distribute.experimental.ParameterServerStrategy(
    cluster_resolver, variable_partitioner=variable_partitioner
)

# -------------------------------------------------------------------- training with Model.fit


def dataset_fn(input_context):
    global_batch_size = 64
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)

    x = torch.rand((10, 10))
    y = torch.rand((10,))

    dataset = sg.data.Dataset.from_tensor_slices((x, y)).shuffle(10).repeat()
    dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    dataset = dataset.batch(batch_size)
    dataset = dataset.prefetch(2)

    return dataset


dc = sg.keras.utils.experimental.DatasetCreator(dataset_fn)

with strategy.scope():
    model = sg.keras.Model(torch.nn.Sequential(torch.nn.Linear(10, 10)))

    model.compile(sg.keras.optimizers.SGD(), loss="mse", steps_per_execution=10)

working_dir = sys.argv[1]  # port: '/tmp/my_working_dir', a folder the test gives
log_dir = os.path.join(working_dir, "log")
ckpt_filepath = os.path.join(working_dir, "ckpt")
backup_dir = os.path.join(working_dir, "backup")

callbacks = [
    sg.keras.callbacks.TensorBoard(log_dir=log_dir),
    sg.keras.callbacks.ModelCheckpoint(filepath=ckpt_filepath),
    sg.keras.callbacks.BackupAndRestore(backup_dir=backup_dir),
]

history = model.fit(dc, epochs=5, steps_per_epoch=20, callbacks=callbacks)
fit_iterations = model.optimizer.iterations  # not the tutorial's: the test reads it

# ---------------------------------------------------- training with a custom training loop
feature_vocab = ["avenger", "ironman", "batman", "hulk", "spiderman", "kingkong", "wonder_woman"]
label_vocab = ["yes", "no"]


class StringLookup(torch.nn.Module):
    """port: tf.keras.layers.StringLookup(vocabulary, num_oov_indices=1, mask_token=None):
    torch has no string tensors, so the layer looks strings up in Python (out-of-vocabulary
    ones are index 0 while there is an OOV index, the vocabulary follows)."""

    def __init__(self, vocabulary, num_oov_indices=1, mask_token=None):
        super().__init__()
        self.vocabulary = ["[UNK]"] * num_oov_indices + list(vocabulary)
        self.index = {word: i for i, word in enumerate(self.vocabulary)}

    def get_vocabulary(self):
        return list(self.vocabulary)

    def forward(self, strings):
        return torch.tensor([self.index.get(str(s), 0) for s in strings])


with strategy.scope():
    feature_lookup_layer = StringLookup(vocabulary=feature_vocab, mask_token=None)
    label_lookup_layer = StringLookup(vocabulary=label_vocab, num_oov_indices=0, mask_token=None)

    # port: the Keras models of one lookup layer (tf.keras.Input(dtype=tf.string) -> lookup)
    # are the lookup itself.
    feature_preprocess_stage = feature_lookup_layer
    label_preprocess_stage = label_lookup_layer


def feature_and_label_gen(num_examples=200):
    examples = {"features": [], "label": []}
    for _ in range(num_examples):
        features = random.sample(feature_vocab, 3)
        label = ["yes"] if "avenger" in features else ["no"]
        examples["features"].append(features)
        examples["label"].append(label)
    return examples


examples = feature_and_label_gen()


def dataset_fn(_):
    raw_dataset = sg.data.Dataset.from_tensor_slices(examples)

    train_dataset = (
        raw_dataset.map(
            lambda x: (
                {"features": feature_preprocess_stage(x["features"])},
                label_preprocess_stage(x["label"]),
            )
        )
        .shuffle(200)
        .batch(32)
        .repeat()
    )
    return train_dataset


class FunctionalModel(torch.nn.Module):
    """port: tf.keras.Model({"features": model_input}, dense_output) of the layers below."""

    def __init__(self):
        super().__init__()
        self.emb_layer = torch.nn.Embedding(len(feature_lookup_layer.get_vocabulary()), 16384)
        self.dense = torch.nn.Linear(16384, 1)  # Dense(units=1, activation="sigmoid"): below
        # port: Keras's default initializers (Embedding: uniform(-0.05, 0.05); Dense:
        # glorot_uniform kernel, zero bias), which the tutorial's training relies on.
        torch.nn.init.uniform_(self.emb_layer.weight, -0.05, 0.05)
        torch.nn.init.xavier_uniform_(self.dense.weight)
        torch.nn.init.zeros_(self.dense.bias)

    def forward(self, inputs):
        emb_output = torch.mean(self.emb_layer(inputs["features"]), dim=1)
        # port: the sigmoid's input (the logits), which tf.keras's BinaryCrossentropy takes
        # back from the sigmoid op; predictions are torch.sigmoid(model(...)).
        return self.dense(emb_output)


# These variables created under the `Strategy.scope` will be placed on parameter
# servers in a round-robin fashion.
with strategy.scope():
    model = FunctionalModel()
    emb_layer = model.emb_layer

    optimizer = torch.optim.RMSprop(model.parameters(), lr=0.1, alpha=0.9, eps=1e-7)
    accuracy = sg.keras.metrics.Accuracy()

# port: emb_layer.weights[i] (the shards of a ShardedVariable) ->
# strategy.extended.variable_shards(emb_layer.weight)[i]
shards = strategy.extended.variable_shards(emb_layer.weight)
assert len(shards) == 2
assert shards[0].shape == (4, 16384)
assert shards[1].shape == (4, 16384)
assert shards[0].device == "/job:ps/replica:0/task:0/device:CPU:0"
assert shards[1].device == "/job:ps/replica:0/task:1/device:CPU:0"


def step_fn(iterator):
    def replica_fn(batch_data, labels):
        logits = model(batch_data)
        pred = torch.sigmoid(logits)
        per_example_loss = sg.keras.losses.BinaryCrossentropy(
            from_logits=True, reduction=sg.keras.losses.Reduction.NONE
        )(labels, logits)
        loss = sg.nn.compute_average_loss(per_example_loss)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        actual_pred = torch.gt(pred, 0.5).long()
        accuracy.update_state(labels, actual_pred)
        return loss.detach()

    batch_data, labels = next(iterator)
    losses = strategy.run(replica_fn, args=(batch_data, labels))
    return strategy.reduce(sg.distribute.ReduceOp.SUM, losses, axis=None)


coordinator = sg.distribute.experimental.coordinator.ClusterCoordinator(strategy)


def per_worker_dataset_fn():
    return strategy.distribute_datasets_from_function(dataset_fn)


per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
per_worker_iterator = iter(per_worker_dataset)

num_epoches = 4
steps_per_epoch = 5
for i in range(num_epoches):
    accuracy.reset_states()
    for _ in range(steps_per_epoch):
        coordinator.schedule(step_fn, args=(per_worker_iterator,))
    # Wait at epoch boundaries.
    coordinator.join()
    print(f"Finished epoch {i}, accuracy is {accuracy.result().numpy():f}.", flush=True)

loss = coordinator.schedule(step_fn, args=(per_worker_iterator,))
print(f"Final loss is {loss.fetch():f}", flush=True)

# ---------------------------------------------------------------------------- evaluation
eval_dataset = (
    sg.data.Dataset.from_tensor_slices(feature_and_label_gen(num_examples=16))
    .map(
        lambda x: (
            {"features": feature_preprocess_stage(x["features"])},
            label_preprocess_stage(x["label"]),
        )
    )
    .batch(8)
)

eval_accuracy = sg.keras.metrics.Accuracy()

model.eval()  # port: model(batch_data, training=False) is torch's eval mode
for batch_data, labels in eval_dataset:
    pred = torch.sigmoid(model(batch_data))
    actual_pred = torch.gt(pred, 0.5).long()
    eval_accuracy.update_state(labels, actual_pred)

print(f"Evaluation accuracy: {eval_accuracy.result():f}", flush=True)

with strategy.scope():
    # Define the eval metric on parameter servers.
    eval_accuracy = sg.keras.metrics.Accuracy()


def eval_step(iterator):
    def replica_fn(batch_data, labels):
        pred = torch.sigmoid(model(batch_data))  # in eval mode (training=False) since above
        actual_pred = torch.gt(pred, 0.5).long()
        eval_accuracy.update_state(labels, actual_pred)

    batch_data, labels = next(iterator)
    strategy.run(replica_fn, args=(batch_data, labels))


def eval_dataset_fn():
    return (
        sg.data.Dataset.from_tensor_slices(feature_and_label_gen(num_examples=16))
        .map(
            lambda x: (
                {"features": feature_preprocess_stage(x["features"])},
                label_preprocess_stage(x["label"]),
            )
        )
        .shuffle(16)
        .repeat()
        .batch(8)
    )


per_worker_eval_dataset = coordinator.create_per_worker_dataset(eval_dataset_fn)
per_worker_eval_iterator = iter(per_worker_eval_dataset)

eval_steps_per_epoch = 2
for _ in range(eval_steps_per_epoch):
    coordinator.schedule(eval_step, args=(per_worker_eval_iterator,))
coordinator.join()
print(f"Evaluation accuracy: {eval_accuracy.result():f}", flush=True)

# Not the tutorial's: what the test reads. The direct evaluation's figure recomputed with plain
# torch, outside the strategy and the metric, on the ps's final weights as a worker reads them
# (not through the chief's reads, which the direct evaluation used).


def final_weights():
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


plain = FunctionalModel()
plain.load_state_dict(coordinator.schedule(final_weights).fetch())
with torch.no_grad():
    hits = [
        (torch.gt(torch.sigmoid(plain(batch_data)), 0.5).long() == labels.reshape(-1, 1)).flatten()
        for batch_data, labels in eval_dataset
    ]
with open(os.path.join(working_dir, "result.json"), "w") as f:
    json.dump(
        {
            "fit_loss": history.history["loss"],
            "fit_iterations": int(fit_iterations),
            "ps_stats": strategy.ps_stats(),
            "direct_recomputed": float(torch.cat(hits).float().mean()),
            "eval_count": float(eval_accuracy.state_dict()["count"]),
        },
        f,
    )
