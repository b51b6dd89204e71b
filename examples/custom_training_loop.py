"""The seed's custom training loop with MultiWorkerMirroredStrategy, ported line by line.

Run it as a cluster (each task gets its TF_CONFIG from the launcher):

    stratagem run -n 2 examples/custom_training_loop.py

or by hand with TF_CONFIG on each machine, or under ``torchrun --nproc-per-node 2``. With
``--devices cpu:0,cpu:1`` the same loop runs in one process under MirroredStrategy.

Differences from the seed, each for a reason:
- ``tape.gradient`` + ``optimizer.apply_gradients`` → ``loss.backward()`` + ``optimizer.step()``
  (the strategy sums gradients across replicas in between, as TF does).
- ``tf.Variable`` counters → 0-d ``torch.tensor``s; ``assign_add(1)`` → ``+= 1``.
- The epoch counter is advanced *before* the checkpoint is saved: the seed saves with
  ``step_in_epoch == 70`` and then divides by zero batches when it resumes from that checkpoint.
- The checkpoint directory is a fixed path (``--checkpoint-dir``) rather than a per-process temp
  dir, so that a restarted job finds it; and the test accuracy is printed at the end.
"""

import argparse
import os
import shutil
import sys

import torch

import stratagem as sg

# Make the sibling mnist.py importable, as the seed does with '.'.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mnist

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--steps-per-epoch", type=int, default=70)
parser.add_argument("--per-worker-batch-size", type=int, default=64)
parser.add_argument(
    "--checkpoint-dir", default=os.path.join("runs", "custom_training_loop", "ckpt")
)
parser.add_argument("--data", help="a local Keras mnist.npz (default: scikit-learn's digits)")
parser.add_argument(
    "--devices",
    help="run in one process with MirroredStrategy over these devices, e.g. cpu:0,cpu:1",
)
parser.add_argument("--seed", type=int, default=None, help="torch seed of this process")
args = parser.parse_args()
if args.data:
    os.environ["MNIST_NPZ"] = args.data
if args.seed is not None:
    torch.manual_seed(args.seed)

if args.devices:
    strategy = sg.distribute.MirroredStrategy(args.devices.split(","))
else:
    strategy = sg.distribute.MultiWorkerMirroredStrategy()

with strategy.scope():
    # Model building needs to be within `strategy.scope()`.
    multi_worker_model = mnist.build_cnn_model()

per_worker_batch_size = args.per_worker_batch_size
num_workers = strategy.num_replicas_in_sync
global_batch_size = per_worker_batch_size * num_workers

with strategy.scope():
    multi_worker_dataset = strategy.distribute_datasets_from_function(
        lambda input_context: mnist.dataset_fn(global_batch_size, input_context)
    )

with strategy.scope():
    # The creation of optimizer and train_accuracy will need to be in
    # `strategy.scope()` as well, since they create variables.
    optimizer = torch.optim.RMSprop(multi_worker_model.parameters(), lr=0.001, alpha=0.9, eps=1e-7)
    train_accuracy = sg.keras.metrics.SparseCategoricalAccuracy(name="train_accuracy")


def train_step(iterator):
    """Training step function."""

    def step_fn(inputs):
        """Per-Replica step function."""
        x, y = inputs
        predictions = multi_worker_model(x)
        per_batch_loss = sg.keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=sg.keras.losses.Reduction.NONE
        )(y, predictions)
        loss = sg.nn.compute_average_loss(per_batch_loss, global_batch_size=global_batch_size)

        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        train_accuracy.update_state(y, predictions)
        return loss

    per_replica_losses = strategy.run(step_fn, args=(next(iterator),))
    return strategy.reduce(sg.distribute.ReduceOp.SUM, per_replica_losses, axis=None)


checkpoint_dir = args.checkpoint_dir


def _is_chief(task_type, task_id, cluster_spec):
    return (
        task_type is None
        or task_type == "chief"
        or (task_type == "worker" and task_id == 0 and "chief" not in cluster_spec.as_dict())
    )


def _get_temp_dir(dirpath, task_id):
    base_dirpath = "workertemp_" + str(task_id)
    temp_dir = os.path.join(dirpath, base_dirpath)
    os.makedirs(temp_dir, exist_ok=True)
    return temp_dir


def write_filepath(filepath, task_type, task_id, cluster_spec):
    dirpath = os.path.dirname(filepath)
    base = os.path.basename(filepath)
    if not _is_chief(task_type, task_id, cluster_spec):
        dirpath = _get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)


epoch = torch.tensor(0, dtype=torch.int64)
step_in_epoch = torch.tensor(0, dtype=torch.int64)
if strategy.cluster_resolver is not None:
    task_type, task_id = (strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id)
    cluster_spec = strategy.cluster_resolver.cluster_spec()
else:  # MirroredStrategy: one process, the chief
    task_type, task_id, cluster_spec = None, None, sg.train.ClusterSpec({})

checkpoint = sg.train.Checkpoint(
    model=multi_worker_model, optimizer=optimizer, epoch=epoch, step_in_epoch=step_in_epoch
)

write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id, cluster_spec)
checkpoint_manager = sg.train.CheckpointManager(
    checkpoint, directory=write_checkpoint_dir, max_to_keep=1
)

latest_checkpoint = sg.train.latest_checkpoint(checkpoint_dir)
if latest_checkpoint:
    checkpoint.restore(latest_checkpoint)
    print(f"Restored {latest_checkpoint}: epoch {epoch.item()}, step {step_in_epoch.item()}")

num_epochs = args.epochs
num_steps_per_epoch = args.steps_per_epoch

while epoch.item() < num_epochs:
    iterator = iter(multi_worker_dataset)
    total_loss = 0.0
    num_batches = 0

    while step_in_epoch.item() < num_steps_per_epoch:
        total_loss += train_step(iterator)
        num_batches += 1
        step_in_epoch += 1

    train_loss = total_loss / num_batches
    print(
        "Epoch: %d, accuracy: %f, train_loss: %f."
        % (epoch.item(), train_accuracy.result(), train_loss),
        flush=True,
    )

    train_accuracy.reset_states()

    epoch += 1
    step_in_epoch.zero_()
    # Once the `CheckpointManager` is set up, you're now ready to save, and remove
    # the checkpoints non-chief workers saved.
    checkpoint_manager.save()
    if not _is_chief(task_type, task_id, cluster_spec):
        shutil.rmtree(write_checkpoint_dir)

test_accuracy = sg.keras.metrics.SparseCategoricalAccuracy(name="test_accuracy")


def eval_step(inputs):
    x, y = inputs
    with torch.no_grad():
        test_accuracy.update_state(y, multi_worker_model(x))


for batch in strategy.experimental_distribute_dataset(mnist.test_dataset(global_batch_size)):
    strategy.run(eval_step, args=(batch,))
print("Test accuracy: %f" % test_accuracy.result(), flush=True)
