"""The seed's distributed Keras tutorial, ported: Model.fit under a strategy, with callbacks.

TensorFlow → stratagem, line by line: ``tf.distribute.MirroredStrategy()`` →
``sg.distribute.MirroredStrategy(devices)`` (logical CPU devices are replica threads; on one
device it is the one replica); the Keras ``Sequential`` → a ``torch.nn.Sequential`` wrapped in
``sg.keras.Model``; ``tf.keras.callbacks.*`` → ``sg.keras.callbacks.*``. The data is
scikit-learn's digits upsampled to 28×28 (no download), or a local ``mnist.npz`` (``--data``).

    python examples/keras_fit.py                          # MirroredStrategy(), as the seed
    python examples/keras_fit.py --devices cpu:0,cpu:1    # 2 replica threads
    stratagem run -n 2 examples/keras_fit.py --multi-worker  # MultiWorkerMirroredStrategy
"""

import argparse
import os

import numpy as np
import torch

import stratagem as sg

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=12)
parser.add_argument(
    "--devices",
    help="MirroredStrategy's devices, e.g. cpu:0,cpu:1 (default: as TF, the GPUs or the CPU)",
)
parser.add_argument("--multi-worker", action="store_true", help="MultiWorkerMirroredStrategy")
parser.add_argument("--data", help="a local Keras mnist.npz (default: scikit-learn's digits)")
parser.add_argument("--seed", type=int, default=None, help="torch seed (initial weights, shuffle)")
parser.add_argument(
    "--dir",
    default="keras_fit_output",
    help="where checkpoints, logs and the saved model go; every worker must see it",
)
args = parser.parse_args()
if args.seed is not None:
    torch.manual_seed(args.seed)

if args.multi_worker:
    strategy = sg.distribute.MultiWorkerMirroredStrategy()
else:
    strategy = sg.distribute.MirroredStrategy(args.devices.split(",") if args.devices else None)
print(f"Number of devices: {strategy.num_replicas_in_sync}")

# The data: (x_train, y_train), (x_test, y_test) as uint8 images and integer labels.
if args.data:
    (x_train, y_train), (x_test, y_test) = sg.data.datasets.load_mnist(args.data)
else:
    (x_train, y_train), (x_test, y_test) = sg.data.datasets.load_digits(image_size=28)

BUFFER_SIZE = 10000
BATCH_SIZE_PER_REPLICA = 64
BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync


def scale(image, label):
    image = image.astype(np.float32)
    image /= 255
    return image, label.astype(np.int64)


train_dataset = (
    sg.data.Dataset.from_tensor_slices(scale(x_train, y_train))
    .cache()
    .shuffle(BUFFER_SIZE)
    .batch(BATCH_SIZE)
)
eval_dataset = sg.data.Dataset.from_tensor_slices(scale(x_test, y_test)).batch(BATCH_SIZE)

with strategy.scope():
    model = sg.keras.Model(
        torch.nn.Sequential(
            torch.nn.Unflatten(1, (1, 28)),  # input_shape=(28, 28, 1), channels first
            torch.nn.Conv2d(1, 32, 3),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Flatten(),
            torch.nn.Linear(13 * 13 * 32, 64),
            torch.nn.ReLU(),
            torch.nn.Linear(64, 10),
        )
    )
    # Keras's initializers (glorot_uniform weights, zero biases) rather than PyTorch's.
    for layer in model.module:
        if isinstance(layer, torch.nn.Conv2d | torch.nn.Linear):
            torch.nn.init.xavier_uniform_(layer.weight)
            torch.nn.init.zeros_(layer.bias)
    model.compile(
        loss=sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=sg.keras.optimizers.Adam(),
        metrics=["accuracy"],
    )

# Define the checkpoint directory to store the checkpoints.
work_dir = args.dir
checkpoint_dir = os.path.join(work_dir, "training_checkpoints")
# Define the name of the checkpoint files.
checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt_{epoch}")


# Define a function for decaying the learning rate.
# You can define any decay function you need.
def decay(epoch):
    if epoch < 3:
        return 1e-3
    elif epoch >= 3 and epoch < 7:
        return 1e-4
    return 1e-5


# Define a callback for printing the learning rate at the end of each epoch.
class PrintLR(sg.keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if strategy.extended.should_checkpoint:  # the chief prints, as the progress bar does
            print(f"\nLearning rate for epoch {epoch + 1} is {model.optimizer.learning_rate}")


# Put all the callbacks together.
callbacks = [
    sg.keras.callbacks.TensorBoard(log_dir=os.path.join(work_dir, "logs")),
    sg.keras.callbacks.ModelCheckpoint(filepath=checkpoint_prefix, save_weights_only=True),
    sg.keras.callbacks.LearningRateScheduler(decay),
    PrintLR(),
]

EPOCHS = args.epochs
model.fit(train_dataset, epochs=EPOCHS, callbacks=callbacks)

# Restore the latest checkpoint and evaluate.
model.load_weights(sg.train.latest_checkpoint(checkpoint_dir))
eval_loss, eval_acc = model.evaluate(eval_dataset)
print(f"Eval loss: {eval_loss}, Eval accuracy: {eval_acc}")

# Export, then load without a strategy scope (one device) and evaluate.
path = os.path.join(work_dir, "saved_model")
model.save(path)
unreplicated_model = sg.keras.models.load_model(path)
eval_loss, eval_acc = unreplicated_model.evaluate(eval_dataset)
print(f"Eval loss: {eval_loss}, Eval Accuracy: {eval_acc}")

# Load inside the scope: distributed again.
with strategy.scope():
    replicated_model = sg.keras.models.load_model(path)
    eval_loss, eval_acc = replicated_model.evaluate(eval_dataset)
    print(f"Eval loss: {eval_loss}, Eval Accuracy: {eval_acc}")
