"""TensorFlow's "Parameter server training" tutorial, ported: a chief coordinates, workers run.

    stratagem run --chief -n 2 --ps 1 examples/parameter_server_coordinator.py
    stratagem run --chief -n 2 --ps 1 --evaluator examples/parameter_server_coordinator.py

TF2's parameter-server training is coordinator-based: the ``chief`` task runs this program's
training loop and ``schedule``\\ s functions; the ``worker`` tasks only serve
(``sg.distribute.Server(...).join()``) and run what they are sent; the variables live on the
``ps`` tasks, and each worker's gradients are applied there asynchronously. Every task runs this
same file (the launcher starts one script for all roles); workers and ps tasks stop at
``server.join()``. With ``--evaluator``, an evaluator task runs TF's sidecar evaluation of the
``Model.fit`` part's checkpoints (``SidecarEvaluator``).

Differences from the tutorial, each for a reason:
- The data is scikit-learn's digits (8x8 images, 10 classes) instead of the tutorial's
  synthetic binary problem, and the model an MLP: no download, and an accuracy to check.
- ``tf.function`` is dropped: functions are sent to the workers by reference to this file
  (each worker compiles its own copy), never traced or pickled.
- ``tape.gradient`` + ``apply_gradients`` → ``loss.backward()`` + ``optimizer.step()``: the
  step pushes the gradients to the ps, which applies them.
- The tutorial's in-process cluster (``create_in_process_cluster``) → ``stratagem run``.
"""

import argparse
import os
import sys

import numpy as np
import torch

import stratagem as sg

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=8)
parser.add_argument("--steps-per-epoch", type=int, default=20)
parser.add_argument("--fit-epochs", type=int, default=8)
parser.add_argument("--global-batch-size", type=int, default=64)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--working-dir", default=os.path.join("runs", "parameter_server_coordinator"))
args = parser.parse_args()


def load_digits():
    (x_train, y_train), (x_test, y_test) = sg.data.datasets.load_digits(image_size=8)
    flat = lambda x: (x.reshape(len(x), -1) / np.float32(255)).astype(np.float32)  # noqa: E731
    return (flat(x_train), y_train), (flat(x_test), y_test)


def compiled_fit_model():
    """The model of the tutorial's Model.fit part (the chief's, and the evaluator's copy)."""
    model = sg.keras.Model(
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    )
    model.compile(
        sg.keras.optimizers.SGD(learning_rate=args.lr, momentum=0.9),
        loss=sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        steps_per_execution=5,
    )
    return model


working_dir = args.working_dir
ckpt_dir = os.path.join(working_dir, "ckpt")

cluster_resolver = sg.distribute.cluster_resolver.TFConfigClusterResolver()
if cluster_resolver.task_type == "evaluator":
    # The tutorial's sidecar evaluation (`stratagem run ... --evaluator`): a task of its own
    # evaluates each checkpoint Model.fit's ModelCheckpoint writes, until the last epoch's.
    _, (x_test, y_test) = load_digits()
    sg.keras.utils.SidecarEvaluator(
        model=compiled_fit_model(),
        data=(x_test, y_test),
        checkpoint_dir=ckpt_dir,
        max_evaluations=args.fit_epochs,
        timeout=600,
    ).start()
    sys.exit(0)
if cluster_resolver.task_type in ("worker", "ps"):
    # Workers and parameter servers serve until the chief is done.
    server = sg.distribute.Server(
        cluster_resolver.cluster_spec(),
        job_name=cluster_resolver.task_type,
        task_index=cluster_resolver.task_id,
        protocol="grpc",
        start=True,
    )
    server.join()  # as TF's, it does not return: the process ends when the job is done

# ---------------------------------------------------------------- the chief (the coordinator)

variable_partitioner = sg.distribute.experimental.partitioners.MinSizePartitioner(
    min_shard_bytes=(256 << 10), max_shards=2
)
strategy = sg.distribute.ParameterServerStrategy(
    cluster_resolver, variable_partitioner=variable_partitioner
)
torch.manual_seed(0)


def dataset_fn(input_context):
    global_batch_size = args.global_batch_size
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    (x, y), _ = load_digits()
    dataset = sg.data.Dataset.from_tensor_slices((x, y))
    dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    return dataset.shuffle(1024).batch(batch_size).repeat()


def eval_dataset_fn():
    _, (x, y) = load_digits()
    return sg.data.Dataset.from_tensor_slices((x, y)).batch(60)


# The model, optimizer and metric are built in the chief's scope: their variables live on the ps.
with strategy.scope():
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    accuracy = sg.keras.metrics.SparseCategoricalAccuracy()


def step_fn(iterator):
    def replica_fn(batch_data, labels):
        pred = model(batch_data)
        per_example_loss = sg.keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=sg.keras.losses.Reduction.NONE
        )(labels, pred)
        loss = sg.nn.compute_average_loss(per_example_loss)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        accuracy.update_state(labels, pred)
        return loss

    batch_data, labels = next(iterator)
    losses = strategy.run(replica_fn, args=(batch_data, labels))
    return strategy.reduce(sg.distribute.ReduceOp.SUM, losses, axis=None)


coordinator = sg.distribute.coordinator.ClusterCoordinator(strategy)


def per_worker_dataset_fn():
    return strategy.distribute_datasets_from_function(dataset_fn)


per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
per_worker_iterator = iter(per_worker_dataset)

for i in range(args.epochs):
    accuracy.reset_states()
    for _ in range(args.steps_per_epoch):
        coordinator.schedule(step_fn, args=(per_worker_iterator,))
    # Wait at epoch boundaries.
    coordinator.join()
    print(f"Finished epoch {i}, accuracy is {float(accuracy.result()):f}.", flush=True)

loss = coordinator.schedule(step_fn, args=(per_worker_iterator,))
print(f"Final loss is {float(loss.fetch()):f}", flush=True)

# Direct evaluation on the coordinator (the tutorial's first way): the chief's reads of the
# model are reads of the ps, so it evaluates what the workers trained.
direct_accuracy = sg.keras.metrics.SparseCategoricalAccuracy()
for batch_data, labels in eval_dataset_fn():
    with torch.no_grad():
        pred = model(batch_data)
    direct_accuracy.update_state(labels, pred)
print(f"Direct evaluation accuracy: {float(direct_accuracy.result()):f}", flush=True)

# Distributed evaluation: each test batch is sent with its function (tensors travel by value),
# so every test image is evaluated exactly once, on whichever worker is free; the metric's
# totals come back with each function and add up on the chief.
with strategy.scope():
    eval_accuracy = sg.keras.metrics.SparseCategoricalAccuracy()


def eval_step(batch_data, labels):
    def replica_fn(batch_data, labels):
        with torch.no_grad():
            pred = model(batch_data)
        eval_accuracy.update_state(labels, pred)

    strategy.run(replica_fn, args=(batch_data, labels))


for batch_data, labels in eval_dataset_fn():
    coordinator.schedule(eval_step, args=(batch_data, labels))
coordinator.join()
print(f"Evaluation accuracy: {float(eval_accuracy.result()):f}", flush=True)


# ------------------------------------------------------------------------------ Model.fit
# The tutorial's first part: Keras's fit on the chief schedules the steps on the workers;
# callbacks run on the chief. Its input is a dataset, as the tutorial's (TF's recommended
# input; a DatasetCreator(dataset_fn) works too): each worker makes its own copy of the
# pipeline and shuffles it its own way.
global_batch_size = args.global_batch_size
(x, y), _ = load_digits()
dataset = sg.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x)).repeat()
dataset = dataset.batch(global_batch_size)
dataset = dataset.prefetch(2)

with strategy.scope():
    fit_model = compiled_fit_model()

log_dir = os.path.join(working_dir, "log")
ckpt_filepath = os.path.join(ckpt_dir, "ckpt-{epoch}")  # numbered: the sidecar evaluator's

callbacks = [
    sg.keras.callbacks.TensorBoard(log_dir=log_dir),
    sg.keras.callbacks.ModelCheckpoint(filepath=ckpt_filepath),
]
fit_model.fit(
    dataset, epochs=args.fit_epochs, steps_per_epoch=args.steps_per_epoch, callbacks=callbacks
)

# evaluate visits every test example exactly once, spread over the workers.
_, (x_test, y_test) = load_digits()
loss, fit_accuracy = fit_model.evaluate(x_test, y_test, batch_size=60, verbose=0)
print(f"Model.fit: test loss {loss:f}, test accuracy {fit_accuracy:f}", flush=True)
