"""sg.keras.Model.fit under PipelineStrategy on 2 stage processes; saves what each rank saw.

Usage: pipeline_fit.py OUT_DIR SCHEDULE [SCHEDULE ...]. Every rank writes
OUT_DIR/fit-rankR.pt with:

- ``fit``: per schedule, 2 epochs of fit (90 examples in batches of 24: the last batch, 18, is
  padded to a multiple of the 4 micro-batches), no shuffle; this rank's final weights, the
  History, the evaluate and predict results;
- ``resume`` (under the first schedule): the same model trained 2 epochs with
  ``BackupAndRestore`` (kept) and ``ModelCheckpoint``, then continued for a 3rd epoch; a fresh
  model with other weights whose fit(epochs=3) resumes from the backup: both end with the same
  weights on every stage (model and optimizer state restored), and the ModelCheckpoint file
  holds the whole model.
"""

import sys
from pathlib import Path

import torch

import stratagem as sg
from workers.common import build_model, keras_data

OUT, SCHEDULES = Path(sys.argv[1]), sys.argv[2:]
EPOCHS = 2
x, y = keras_data(90)


def new_model(strategy, seed: int) -> sg.keras.Model:
    torch.manual_seed(seed)
    with strategy.scope():
        model = sg.keras.Model(build_model())
        model.compile(
            sg.keras.optimizers.Adam(0.01),
            sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            ["accuracy"],
        )
    return model


def own_weights(strategy, model: sg.keras.Model) -> dict[str, torch.Tensor]:
    """This rank's stage, as the strategy holds it (the layers of model.module it trains)."""
    pipe = strategy.extended.pipeline_of(model.module)
    return {n: p.detach().clone() for n, p in pipe.named_parameters()}


fit = {}
for schedule in SCHEDULES:
    strategy = sg.distribute.experimental.PipelineStrategy(
        schedule=schedule,
        num_microbatches=4,
        split_points=[1, 2, 4] if schedule == "Interleaved1F1B" else [2],
    )
    model = new_model(strategy, 0)
    history = model.fit(x, y, batch_size=24, epochs=EPOCHS, shuffle=False, verbose=0)
    fit[schedule] = {
        "weights": own_weights(strategy, model),
        "history": history.history,
        "evaluate": model.evaluate(x, y, batch_size=24, verbose=0),
        "predict": torch.from_numpy(model.predict(x, batch_size=24)),
    }

strategy = sg.distribute.experimental.PipelineStrategy(
    schedule=SCHEDULES[0], num_microbatches=4, split_points=[2]
)
backup, saved = OUT / "backup", OUT / "saved"
model = new_model(strategy, 0)
model.fit(
    x, y, batch_size=24, epochs=EPOCHS, shuffle=False, verbose=0,
    callbacks=[
        sg.keras.callbacks.BackupAndRestore(str(backup), delete_checkpoint=False),
        sg.keras.callbacks.ModelCheckpoint(str(saved / "ckpt-{epoch}")),
    ],
)  # fmt: skip
at_backup = own_weights(strategy, model)
model.fit(x, y, batch_size=24, epochs=EPOCHS + 1, initial_epoch=EPOCHS, shuffle=False, verbose=0)
continued = own_weights(strategy, model)

fresh = new_model(strategy, 99)  # other weights, an optimizer with no state
resumed_history = fresh.fit(
    x, y, batch_size=24, epochs=EPOCHS + 1, shuffle=False, verbose=0,
    callbacks=[sg.keras.callbacks.BackupAndRestore(str(backup))],
)  # fmt: skip
# EarlyStopping on the validation loss, which the last stage computes: it must stop every
# process at the same epoch (a val_loss that never improves by 10: after the 2nd epoch).
stopper = new_model(strategy, 0)
early = stopper.fit(
    x, y, batch_size=24, epochs=5, shuffle=False, verbose=0, validation_data=(x, y),
    callbacks=[sg.keras.callbacks.EarlyStopping("val_loss", min_delta=10.0, patience=1)],
)  # fmt: skip

resume = {
    "early_stopped_epochs": early.epoch,
    "at_backup": at_backup,
    "continued": continued,
    "resumed": own_weights(strategy, fresh),
    "resumed_epochs": resumed_history.epoch,
    "checkpoint": sg.train.latest_checkpoint(str(saved)),
}
torch.save({"fit": fit, "resume": resume}, OUT / f"fit-rank{strategy.rank}.pt")
print("fit checks done", flush=True)
