"""An elastic job's worker (``stratagem run -n MIN:MAX``): ``fit`` under MultiWorkerMirrored
with ``BackupAndRestore(save_freq=1)`` on the exact-resume checks' pipeline (examples carry
their id). Argument: the kills, as JSON ``[[round, rank, step], ...]``: the worker of that rank
in that round (``STRATAGEM_ELASTIC_ROUND``) kills itself with SIGKILL at the step's start.
Each worker appends one line per committed step to ``ledger.jsonl``: round, world size, step,
its rank and the ids it trained on; the chief writes ``final.pt``."""

import json
import os
import signal
import sys

import torch

import stratagem as sg
from workers.resume_data import Ledgered, dataset

strategy = sg.distribute.MultiWorkerMirroredStrategy()
rank = strategy.cluster_resolver.task_id or 0
this_round = int(os.environ["STRATAGEM_ELASTIC_ROUND"])
kill_at = {step for r, k, step in json.loads(sys.argv[1]) if (r, k) == (this_round, rank)}


class Ledger(sg.keras.callbacks.Callback):
    """Records each committed step (its end) and kills this worker at the start of a step of
    ``kill_at``. A barrier after each line: no worker starts a step before every
    worker has written the last one's line (and the chief its backup), so a worker stopped by
    the launcher after a peer's loss has written all it committed."""

    def on_train_batch_begin(self, batch, logs=None):
        if batch in kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, batch, logs=None):
        ids = self.model.module.seen[-1]
        record = {
            "round": this_round,
            "world": strategy.num_replicas_in_sync,
            "step": batch,
            "rank": rank,
            "pid": os.getpid(),
            "ids": ids,
        }
        with open("ledger.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        strategy.extended.barrier("the ledger's line of a step")


torch.manual_seed(0)
with strategy.scope():
    keras_model = sg.keras.Model(Ledgered())
keras_model.compile(
    sg.keras.optimizers.SGD(0.1, momentum=0.9),
    sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
)
callbacks = [sg.keras.callbacks.BackupAndRestore("backup", save_freq=1), Ledger()]
keras_model.fit(dataset(), epochs=1, verbose=0, callbacks=callbacks)
if rank == 0:
    final = {k: v.detach().clone() for k, v in keras_model.module.net.state_dict().items()}
    torch.save(final, "final.pt")
