"""Model.fit with BackupAndRestore(save_freq=4) under MultiWorkerMirroredStrategy, 6 epochs of
20 shuffled batches.

With ``--kill``, worker 1 of the launcher's first attempt SIGKILLs itself as batch 5 of epoch 3
begins: a fit killed mid-epoch, which the launcher's restart must resume from the backup taken
after batch 4 (the chief wrote it before batch 4's all-reduce, which worker 1 took part in).
Prints the epochs this run trained, their losses and the final accuracy.
"""

import os
import signal
import sys

import torch

import stratagem as sg
from workers.common import build_model, keras_data

backup_dir, kill = sys.argv[1], "--kill" in sys.argv[2:]
strategy = sg.distribute.MultiWorkerMirroredStrategy()
torch.manual_seed(0)
with strategy.scope():
    model = sg.keras.Model(build_model())
model.compile(
    sg.keras.optimizers.SGD(0.05, momentum=0.9),
    sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    ["accuracy"],
)
x, _ = keras_data(480)
y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


class KillOnce(sg.keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        first_attempt = os.environ.get("STRATAGEM_RESTART_COUNT") == "0"
        at = (self.epoch, batch) == (3, 5)
        if kill and first_attempt and at and strategy.cluster_resolver.task_id == 1:
            os.kill(os.getpid(), signal.SIGKILL)


history = model.fit(
    x, y, batch_size=24, epochs=6, verbose=0,
    callbacks=[sg.keras.callbacks.BackupAndRestore(backup_dir, save_freq=4), KillOnce()],
)  # fmt: skip
loss, accuracy = model.evaluate(x, y, verbose=0)
losses = " ".join(f"{v:.6f}" for v in history.history["loss"])
print(f"trained epochs {history.epoch} losses {losses} final accuracy {accuracy:.6f}", flush=True)
