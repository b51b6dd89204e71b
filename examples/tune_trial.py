"""The seed's tuning trial script (my_vertex_ai_trial.py), ported: one training of the digits MLP.

The tuner runs it with the trial's hyperparameters as ``--name value`` arguments (the names of
``parameter_spec`` in examples/tune.py); it builds and compiles the model under a
MirroredStrategy scope, trains, reports the validation accuracy after every epoch (so the
median rule can stop a hopeless trial early) and saves the model where the job says
(``AIP_MODEL_DIR``). TensorFlow → stratagem: ``hypertune.HyperTune()`` → ``sg.tune.HyperTune()``,
Keras's ``Sequential`` of ``Dense`` layers → ``torch.nn`` in ``sg.keras.Model``; the data is
scikit-learn's 8x8 digits (no download).

    python examples/tune_trial.py --n_hidden 2 --n_neurons 64 --learning_rate 0.01
"""

import argparse
import os

parser = argparse.ArgumentParser()
parser.add_argument("--n_hidden", type=int, default=2)
parser.add_argument("--n_neurons", type=int, default=256)
parser.add_argument("--learning_rate", type=float, default=1e-2)
parser.add_argument("--optimizer", default="adam")
parser.add_argument("--epochs", type=int, default=10)
args = parser.parse_args()

import numpy as np  # noqa: E402 - after argparse, so that a bad option fails before torch loads
import torch  # noqa: E402

import stratagem as sg  # noqa: E402

OPTIMIZERS = {"sgd": sg.keras.optimizers.SGD, "adam": sg.keras.optimizers.Adam}
BATCH_SIZE = 32


def build_model(args):
    with sg.distribute.MirroredStrategy().scope():
        layers = [torch.nn.Flatten()]  # input_shape=[8, 8]
        width = 8 * 8
        for _ in range(args.n_hidden):
            layers += [torch.nn.Linear(width, args.n_neurons), torch.nn.ReLU()]
            width = args.n_neurons
        layers.append(torch.nn.Linear(width, 10))  # logits; the loss applies the softmax
        model = sg.keras.Model(torch.nn.Sequential(*layers))
        opt = OPTIMIZERS[args.optimizer](learning_rate=args.learning_rate)
        model.compile(
            loss=sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            optimizer=opt,
            metrics=["accuracy"],
        )
        return model


(x_train, y_train), (x_valid, y_valid) = sg.data.datasets.load_digits(image_size=8)
x_train, x_valid = x_train / np.float32(255), x_valid / np.float32(255)
steps_per_epoch = -(-len(x_train) // BATCH_SIZE)

hypertune = sg.tune.HyperTune()


class ReportValAccuracy(sg.keras.callbacks.Callback):
    """An intermediate report per epoch: what the median stopping rule compares."""

    def on_epoch_end(self, epoch, logs=None):
        hypertune.report_hyperparameter_tuning_metric(
            hyperparameter_metric_tag="accuracy",
            metric_value=logs["val_accuracy"],
            global_step=(epoch + 1) * steps_per_epoch,
        )


torch.manual_seed(0)
model = build_model(args)
history = model.fit(
    x_train,
    y_train,
    batch_size=BATCH_SIZE,
    epochs=args.epochs,
    validation_data=(x_valid, y_valid),
    callbacks=[ReportValAccuracy()],
    verbose=0,
)
# The seed's final report: the best validation accuracy of the run.
hypertune.report_hyperparameter_tuning_metric(
    hyperparameter_metric_tag="accuracy",  # name of the reported metric
    metric_value=max(history.history["val_accuracy"]),  # metric value
    global_step=args.epochs * steps_per_epoch,
)
print(f"val_accuracy by epoch: {[round(a, 4) for a in history.history['val_accuracy']]}")
if os.getenv("AIP_MODEL_DIR"):  # paths provided by the job
    model.save(os.path.join(os.environ["AIP_MODEL_DIR"], "digits_mlp"))
