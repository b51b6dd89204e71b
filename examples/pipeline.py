"""Pipeline parallelism on the digits: an MLP cut into stages, one process per stage.

    stratagem run -n 2 examples/pipeline.py --schedule 1F1B
    stratagem run -n 4 examples/pipeline.py --schedule PipeDream
    stratagem run -n 4 examples/pipeline.py --num-replicas 2        # 2 stages x 2 replicas
    stratagem run -n 2 examples/pipeline.py --fit                   # Keras-style Model.fit

Every process reads the same batches; the first stage uses the images, the last the labels.
Prints each epoch's mean training loss and, at the end, the test accuracy (from every process:
predictions reach every stage of the pipeline). ``--checkpoint-dir`` saves every stage after
each epoch and resumes from there when the directory holds a checkpoint.

With ``--fit`` the same model trains through ``sg.keras.Model.fit`` instead of the loop below:
built whole in ``strategy.scope()`` on every process (the strategy keeps each process's
stage), with validation every epoch, and ``--checkpoint-dir`` backs it up with
``BackupAndRestore`` (each stage's layers and optimizer state; a restarted job resumes).
"""

import argparse
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import stratagem as sg

parser = argparse.ArgumentParser()
parser.add_argument(
    "--schedule", default="1F1B", choices=["GPipe", "1F1B", "Interleaved1F1B", "PipeDream"]
)
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--microbatches", type=int, default=4)
parser.add_argument("--num-replicas", type=int, default=1)
parser.add_argument("--no-stashing", action="store_true", help="PipeDream without weight stashing")
parser.add_argument("--checkpoint-dir", default=None)
parser.add_argument("--fit", action="store_true", help="train with sg.keras.Model.fit")
args = parser.parse_args()

sg.config.threading.set_intra_op_parallelism_threads(1)
strategy = sg.distribute.experimental.PipelineStrategy(
    schedule=args.schedule,
    num_microbatches=args.microbatches,
    num_replicas=args.num_replicas,
    weight_stashing=not args.no_stashing,
)

(x_train, y_train), (x_test, y_test) = sg.data.datasets.load_digits(image_size=8)
x_train = torch.from_numpy(x_train / np.float32(255)).reshape(-1, 64)
x_test = torch.from_numpy(x_test / np.float32(255)).reshape(-1, 64)
y_train, y_test = torch.from_numpy(y_train), torch.from_numpy(y_test)


def build() -> nn.Sequential:
    torch.manual_seed(0)  # every process builds the same model, then keeps its own stage
    return nn.Sequential(
        nn.Linear(64, 128),
        nn.ReLU(),
        nn.Linear(128, 128),
        nn.ReLU(),
        nn.Linear(128, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def train_with_fit() -> float:
    with strategy.scope():
        model = sg.keras.Model(build())
        model.compile(
            optimizer=sg.keras.optimizers.Adam(learning_rate=0.003),
            loss=sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    callbacks = []
    if args.checkpoint_dir:
        callbacks.append(sg.keras.callbacks.BackupAndRestore(args.checkpoint_dir))
    model.fit(
        x_train,
        y_train,
        batch_size=args.batch_size,
        epochs=args.epochs,
        validation_data=(x_test, y_test),
        callbacks=callbacks,
        verbose=2,
    )
    _, accuracy = model.evaluate(x_test, y_test, batch_size=args.batch_size, verbose=0)
    return accuracy


def train_with_loop() -> float:
    pipe = strategy.pipeline(build(), F.cross_entropy)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.003)
    epoch = torch.tensor(0)
    if args.checkpoint_dir and os.path.isdir(args.checkpoint_dir):
        pipe.restore(args.checkpoint_dir, optimizer, epoch=epoch)
        print("Restored epoch %d from %s" % (int(epoch), args.checkpoint_dir))
    print(pipe)

    steps = len(x_train) // args.batch_size
    while int(epoch) < args.epochs:
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(int(epoch)))
        total = 0.0
        for step in range(steps):
            idx = order[step * args.batch_size : (step + 1) * args.batch_size]
            total += pipe.train_step(x_train[idx], y_train[idx], optimizer)
        epoch += 1
        print("Epoch: %d, train_loss: %f." % (int(epoch) - 1, total / steps))
        if args.checkpoint_dir:
            pipe.save(args.checkpoint_dir, optimizer, epoch=epoch)
    return (pipe.predict(x_test).argmax(dim=1) == y_test).float().mean().item()


accuracy = train_with_fit() if args.fit else train_with_loop()
print("Test accuracy: %f" % accuracy)
