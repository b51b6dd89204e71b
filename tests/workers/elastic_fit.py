"""An elastic job's worker (``stratagem run -n MIN:MAX``): ``fit`` under MultiWorkerMirrored
with ``BackupAndRestore(save_freq=1)`` on the exact-resume checks' pipeline (examples carry
their id). Argument: events, as JSON ``[[round, who, step, what], ...]``: at the step's start,
the worker of rank ``who`` (or on node ``who``: ``$TEST_NODE``) in that round
(``STRATAGEM_ELASTIC_ROUND``) kills itself with SIGKILL (``"kill"``), or writes
``at-<round>-<who>`` and waits until it is stopped (``"wait"``) or until the file ``go`` is
there (``"hold"``).
Each worker appends one line per committed step to ``ledger.jsonl``: round, world size, step,
its rank, pid and the ids it trained on; the chief writes ``final.pt``. A second argument
``arrays``: fit on the same examples as arrays, in order, for 2 epochs; ``unseeded``: fit on
the pipeline with its shuffle seeded by the job (another order in each job); ``loop``: the
exact-resume checks' custom loop under ``PreemptionCheckpointHandler``, with a
``CheckpointManager`` save after every step."""

import json
import os
import signal
import sys
import threading
import time

import torch

import stratagem as sg
from workers.resume_data import (
    EPOCHS,
    GLOBAL_BATCH,
    Ledgered,
    dataset,
    examples,
    loop_objects,
    train_steps,
)

strategy = sg.distribute.MultiWorkerMirroredStrategy()
comm = strategy.extended.communicator
node = os.environ.get("TEST_NODE")  # the test's name for this worker's machine, if any
plan = json.loads(sys.argv[1])


def where() -> tuple[int, int]:
    """This worker's round and rank now: a worker that went on in place has new ones (a job of
    one has no group: the round it was started in)."""
    if not hasattr(comm, "round"):
        return int(os.environ["STRATAGEM_ELASTIC_ROUND"]), 0
    return comm.round, comm.rank


def event(step: int) -> str | None:
    this_round, rank = where()
    found = [w for r, who, at, w in plan if (r, at) == (this_round, step) and who in (rank, node)]
    return found[0] if found else None


class Ledger(sg.keras.callbacks.Callback):
    """Records each committed step (its end), and acts the events at the steps' starts. A
    barrier after each line: no worker starts a step before every worker has written the last
    one's line (and the chief its backup), so a worker stopped by the launcher after a peer's
    loss has written all it committed."""

    def on_train_batch_begin(self, batch, logs=None):
        act(self.model.optimizer.iterations)  # the job's step, over the epochs

    def on_train_batch_end(self, batch, logs=None):
        # The job's step, over the epochs.
        record(self.model.optimizer.iterations - 1, self.model.module.seen[-1])


def act(step: int) -> None:
    """The event planned for the start of ``step``, if any."""
    what = event(step)
    if what == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if what in ("wait", "hold"):
        this_round, rank = where()
        with open(f"at-{this_round}-{node or rank}", "w") as f:
            f.write(str(os.getpid()))
    if what == "wait":
        threading.Event().wait()  # until the launcher stops this worker
    while what == "hold" and not os.path.exists("go"):
        time.sleep(0.05)  # the test writes it when the scenario's next act may begin


def record(step: int, ids: list[int]) -> None:
    """The ledger's line of a committed step, then a barrier (see ``Ledger``)."""
    line = {
        "round": where()[0],
        "world": strategy.num_replicas_in_sync,
        "step": step,
        "rank": where()[1],
        "pid": os.getpid(),
        "ids": ids,
    }
    with open("ledger.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    strategy.extended.barrier("the ledger's line of a step")


def custom_loop() -> Ledgered:
    """The exact-resume checks' custom loop: model, optimizer, distributed iterator and step
    in a checkpoint saved after every step; the handler restores the newest when the job's
    workers are started again after a change."""
    model, optimizer, iterator, step, checkpoint = loop_objects(strategy)
    manager = sg.train.CheckpointManager(checkpoint, "checkpoints", 2, step_counter=step)
    sg.train.PreemptionCheckpointHandler(strategy.cluster_resolver, manager)

    def end(done: int) -> None:
        manager.save()
        record(done, model.seen[-1])

    train_steps(strategy, model, optimizer, iterator, step, checkpoint, "loop", "", act, end)
    return model


if len(sys.argv) > 2 and sys.argv[2] == "loop":
    trained = custom_loop()
    if where()[1] == 0:
        torch.save({k: v.detach().clone() for k, v in trained.net.state_dict().items()}, "final.pt")
    sys.exit(0)


torch.manual_seed(0)
with strategy.scope():
    keras_model = sg.keras.Model(Ledgered())
keras_model.compile(
    sg.keras.optimizers.SGD(0.1, momentum=0.9),
    sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
)
callbacks = [sg.keras.callbacks.BackupAndRestore("backup", save_freq=1), Ledger()]
if len(sys.argv) > 2 and sys.argv[2] == "arrays":  # the same examples, as arrays, in order
    features, labels = zip(*examples())
    keras_model.fit(
        torch.stack(features), torch.stack(labels), batch_size=GLOBAL_BATCH, shuffle=False,
        epochs=EPOCHS, verbose=0, callbacks=callbacks,
    )  # fmt: skip
else:  # the checks' pipeline; "unseeded": its shuffle seeded by the job
    seed = None if len(sys.argv) > 2 and sys.argv[2] == "unseeded" else 7
    keras_model.fit(dataset(seed), epochs=1, verbose=0, callbacks=callbacks)
if where()[1] == 0:
    final = {k: v.detach().clone() for k, v in keras_model.module.net.state_dict().items()}
    torch.save(final, "final.pt")
