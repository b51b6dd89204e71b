"""An elastic job's worker (``stratagem run -n MIN:MAX``): ``fit`` under MultiWorkerMirrored
with ``BackupAndRestore(save_freq=1)`` on the exact-resume checks' pipeline (examples carry
their id). Argument: events, as JSON ``[[round, who, step, what], ...]``: at the step's start,
the worker of rank ``who`` (or on node ``who``: ``$TEST_NODE``) in that round
(``STRATAGEM_ELASTIC_ROUND``) kills itself with SIGKILL (``"kill"``), or writes
``at-<round>-<who>`` and waits until it is stopped (``"wait"``) or until the file ``go`` is
there (``"hold"``).
Each worker appends one line per committed step to ``ledger.jsonl``: round, world size, step,
its rank and the ids it trained on; the chief writes ``final.pt``."""

import json
import os
import signal
import sys
import threading
import time

import torch

import stratagem as sg
from workers.resume_data import Ledgered, dataset

strategy = sg.distribute.MultiWorkerMirroredStrategy()
rank = strategy.cluster_resolver.task_id or 0
this_round = int(os.environ["STRATAGEM_ELASTIC_ROUND"])
node = os.environ.get("TEST_NODE")  # the test's name for this worker's machine, if any
events = {
    step: what
    for r, who, step, what in json.loads(sys.argv[1])
    if r == this_round and who in (rank, node)
}


class Ledger(sg.keras.callbacks.Callback):
    """Records each committed step (its end), and acts the events at the steps' starts. A
    barrier after each line: no worker starts a step before every worker has written the last
    one's line (and the chief its backup), so a worker stopped by the launcher after a peer's
    loss has written all it committed."""

    def on_train_batch_begin(self, batch, logs=None):
        if events.get(batch) == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if events.get(batch) in ("wait", "hold"):
            with open(f"at-{this_round}-{node or rank}", "w") as f:
                f.write(str(os.getpid()))
        if events.get(batch) == "wait":
            threading.Event().wait()  # until the launcher stops this worker
        while events.get(batch) == "hold" and not os.path.exists("go"):
            time.sleep(0.05)  # the test writes it when the scenario's next act may begin

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
