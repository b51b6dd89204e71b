"""Exact resume on another number of workers, under MultiWorkerMirroredStrategy.

``first``: a custom loop trains STOP steps and writes a checkpoint of the model, the optimizer
and the distributed iterator; then ``fit`` with ``BackupAndRestore(save_freq=3)`` is stopped
after STOP batches (its last backup after batch 6). ``second`` (on any number of workers):
the custom loop restores and trains to the end; ``fit`` with the same backup directory resumes
and finishes. Both read an ``sg.data`` pipeline (streaming shuffle, map, batch, repeat,
prefetch) whose examples carry their id in a last column, which the model drops and records:
the ledger of what each worker consumed. Writes ``<phase>-<task>.pt``.
"""

import sys

import torch

import stratagem as sg
from workers.resume_data import (
    MAP_CALLS,
    STOP,
    Ledgered,
    custom_loop,
    dataset,
    per_worker_positions,
)

phase = sys.argv[1]


strategy = sg.distribute.MultiWorkerMirroredStrategy()
task = strategy.cluster_resolver.task_id or 0
result = {"workers": strategy.num_replicas_in_sync}

# -- the custom loop -------------------------------------------------------------------------
model = custom_loop(strategy, phase, "custom/ckpt")
result["custom"] = {
    "seen": model.seen,
    "map_calls": MAP_CALLS[0],
    "final": {k: v.detach().clone() for k, v in model.net.state_dict().items()},
}


# -- fit ---------------------------------------------------------------------------------------
class Interrupted(Exception):
    pass


class StopAfter(sg.keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.done = 0

    def on_train_batch_end(self, batch, logs=None):
        self.done += 1
        if self.done == STOP:
            raise Interrupted  # every worker at the same batch: as a job stopped there


MAP_CALLS[0] = 0
torch.manual_seed(0)
with strategy.scope():
    keras_model = sg.keras.Model(Ledgered())
keras_model.compile(
    sg.keras.optimizers.SGD(0.1, momentum=0.9),
    sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
)
callbacks = [sg.keras.callbacks.BackupAndRestore("fit-backup", save_freq=3)]
if phase == "first":
    callbacks.append(StopAfter())
try:
    keras_model.fit(dataset(), epochs=1, verbose=0, callbacks=callbacks)
except Interrupted:
    pass
result["fit"] = {
    "seen": keras_model.module.seen,
    "map_calls": MAP_CALLS[0],
    "final": {k: v.detach().clone() for k, v in keras_model.module.net.state_dict().items()},
}
result["per_worker"] = per_worker_positions(strategy, phase, "per-worker/ckpt")
torch.save(result, f"{phase}-{task}.pt")
