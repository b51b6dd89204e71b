"""Model.fit with sharded data parallelism: FullyShardedStrategy (FSDP2, ZeRO-3) on digits.

Each worker holds 1/N of the parameters, gradients and Adam state; layers are gathered just in
time for their forward and backward. The script is the one MultiWorkerMirroredStrategy would
run, with the strategy's name changed (TF's nearest: DTensor layouts, or Keras 3's
``ModelParallel``). The data is scikit-learn's digits at 8x8 (no download).

    stratagem run -n 2 examples/sharded_fit.py             # 2 workers, ZeRO-3
    stratagem run -n 2 examples/sharded_fit.py --zero2     # keep layers gathered until backward
    torchrun --standalone --nproc-per-node 2 examples/sharded_fit.py
"""

import argparse
import os

import numpy as np
import torch

import stratagem as sg

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=15)
parser.add_argument("--zero2", action="store_true", help="reshard_after_forward=False")
parser.add_argument("--dir", default="sharded_fit_output", help="checkpoints and saved model")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
torch.manual_seed(args.seed)

strategy = sg.distribute.experimental.FullyShardedStrategy(reshard_after_forward=not args.zero2)
print(f"Number of replicas: {strategy.num_replicas_in_sync}")

(x_train, y_train), (x_test, y_test) = sg.data.datasets.load_digits(image_size=8)
x_train = (x_train.reshape(-1, 64) / np.float32(255)).astype(np.float32)
x_test = (x_test.reshape(-1, 64) / np.float32(255)).astype(np.float32)

with strategy.scope():
    # Each top-level child holding parameters becomes one FSDP unit (gathered in one go).
    model = sg.keras.Model(
        torch.nn.Sequential(
            torch.nn.Linear(64, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 10),
        )
    )
    model.compile(
        optimizer=sg.keras.optimizers.Adam(learning_rate=1e-3),
        loss=sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )

callbacks = [
    # Saved sharded through torch.distributed.checkpoint: a restart on any number of workers
    # resumes from it.
    sg.keras.callbacks.BackupAndRestore(os.path.join(args.dir, "backup")),
]
model.fit(x_train, y_train, batch_size=64, epochs=args.epochs, callbacks=callbacks, verbose=0)
loss, accuracy = model.evaluate(x_test, y_test, batch_size=64, verbose=0)
print(f"Test loss: {loss:.4f}, Test accuracy: {accuracy:.4f}")

# A whole, plain model: loads without stratagem (model.safetensors) or with load_model.
path = model.save(os.path.join(args.dir, "saved_model"))
print(f"Saved the whole model to {path}")
