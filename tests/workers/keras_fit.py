"""A worker that runs Model.fit / evaluate / predict under MultiWorkerMirroredStrategy.

Each worker seeds torch differently (SEED): the chief's initial values must win. Writes
keras-<task>.pt with the initial and final parameters, the history, evaluate and predict.
"""

import os

import torch

import stratagem as sg
from workers.common import build_model, keras_data

torch.manual_seed(int(os.environ["SEED"]))
strategy = sg.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    model = sg.keras.Model(build_model())
initial = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
model.compile(
    sg.keras.optimizers.SGD(0.1, momentum=0.9),
    sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    ["accuracy"],
)
x, y = keras_data()
callbacks = [
    sg.keras.callbacks.ModelCheckpoint("ckpt/w-{epoch}", save_weights_only=True),
    sg.keras.callbacks.CSVLogger("log.csv"),
]
history = model.fit(x, y, batch_size=24, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
result = {
    "num_replicas": strategy.num_replicas_in_sync,
    "initial": initial,
    "final": {k: v.detach().clone() for k, v in model.module.state_dict().items()},
    "history": history.history,
    "evaluate": model.evaluate(x, y, batch_size=24, verbose=0),
    "predict": torch.from_numpy(model.predict(x, batch_size=24)),
}
torch.save(result, f"keras-{strategy.cluster_resolver.task_id}.pt")
