"""The seed's DTensor model trained with Keras 3's distribution API (``sg.keras.distribution``).

Run it on 2 or 4 processes (one device each):

    stratagem run -n 4 examples/keras3_distribution.py

Keras 3 code that distributes with ``keras.distribution`` ports with its names unchanged: a
``DeviceMesh`` over ``list_devices()``, a ``LayoutMap`` of tuples, ``ModelParallel`` made
current by ``set_distribution``, then ``compile`` and ``fit``. What changes is the model: torch
modules, so the keys are torch's paths written as Keras writes them (``d1/weight``; Keras's
``dense/kernel``) and the axes are torch's shapes (a ``Linear`` weight is (out, in)). The same
model is then trained by stratagem's own names (``MeshStrategy`` over an ``sg.dtensor``
``LayoutMap``) on the same mesh: both print their test accuracy, which must agree.
"""

import argparse
import collections

import numpy as np
import torch

import stratagem as sg
from stratagem import dtensor
from stratagem.keras import distribution as keras_distribution

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=128)
parser.add_argument("--learning-rate", type=float, default=0.01)
args = parser.parse_args()

(x_train, y_train), (x_test, y_test) = sg.data.datasets.load_digits(image_size=28)
x_train, x_test = x_train.astype(np.float32) / 255.0, x_test.astype(np.float32) / 255.0


def build_model():
    # The seed's model; layer names as the seed names its Keras layers.
    return torch.nn.Sequential(
        collections.OrderedDict(
            flatten=torch.nn.Flatten(),
            d1=torch.nn.Linear(28 * 28, 128),
            relu=torch.nn.ReLU(),
            d2=torch.nn.Linear(128, 10),
        )
    )


def train(scope, tag):
    torch.manual_seed(1337)  # the same initial weights on every process, and for both runs
    with scope():
        model = sg.keras.Model(build_model())
        model.compile(
            optimizer=sg.keras.optimizers.Adam(learning_rate=args.learning_rate),
            loss=sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, verbose=0)
        _, accuracy = model.evaluate(x_test, y_test, batch_size=args.batch_size, verbose=0)
    local = tuple(model.module.d1.weight.to_local().shape)
    if torch.distributed.get_rank() == 0:
        print(f"{tag}: d1.weight local shape {local}, test accuracy: {accuracy:.4f}", flush=True)


# Keras 3, unchanged but for the model's names: tensor parallelism over `model` when the job
# has an even number of processes, data parallelism along `batch` over the rest.
devices = keras_distribution.list_devices("cpu")
model_parallel = 2 if len(devices) % 2 == 0 else 1
mesh = keras_distribution.DeviceMesh(
    (len(devices) // model_parallel, model_parallel), ["batch", "model"], devices
)
layout_map = keras_distribution.LayoutMap(mesh)
layout_map["d1/weight"] = ("model", None)  # column-wise (Keras's kernel: (None, "model"))
layout_map["d1/bias"] = ("model",)
layout_map["d2/weight"] = (None, "model")  # row-wise
distribution = keras_distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
train(distribution.scope, "Keras 3 ModelParallel")

# stratagem's own names, on the same mesh.
ours_mesh = mesh.backend_mesh
ours_map = dtensor.LayoutMap(ours_mesh)
ours_map["d1.weight"] = dtensor.Layout(["model", dtensor.UNSHARDED], ours_mesh)
ours_map["d1.bias"] = dtensor.Layout(["model"], ours_mesh)
ours_map["d2.weight"] = dtensor.Layout([dtensor.UNSHARDED, "model"], ours_mesh)
strategy = sg.distribute.experimental.MeshStrategy(ours_mesh, ours_map, batch_dim_name="batch")
train(strategy.scope, "sg.dtensor MeshStrategy")
