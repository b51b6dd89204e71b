"""The seed's DTensor-with-Keras tutorial, ported line by line to sg.dtensor on torch DTensor.

Run it on 4 processes (one device each; the seed uses 8 virtual CPUs in one process):

    stratagem run -n 4 examples/dtensor_layouts.py

or under ``torchrun --nproc-per-node 4``, or by hand with TF_CONFIG on each process.

Differences from the seed, each for a reason:
- One process per device: the mesh has as many devices as the job has processes, and each
  process's input pipeline yields its own shard of every global batch (``shard`` by the
  process's ``batch`` coordinate), which ``pack`` assembles, as the seed's
  ``pack_dtensor_inputs`` does with its local devices.
- ``Dense(kernel_layout=..., bias_layout=...)`` → ``sg.dtensor.layout_weights(nn.Linear(...),
  weight=..., bias=...)``; Keras layer names → ``nn.Sequential(OrderedDict(d1=...))`` names.
- A torch Linear weight is (out, in), a Keras kernel (in, out): the seed's kernel layout
  ``batch_sharded(mesh, 'batch', rank=2)`` is ``inner_sharded(mesh, 'batch', rank=2)`` on the
  weight, and the map key ``feature.*kernel`` is ``feature.*weight``.
- Weights exist as soon as the module does, so ``layout_map.scope()`` lays them out when the
  block ends; no first call is needed to create them.
- ``tf.GradientTape`` + ``apply_gradients`` → ``loss.backward()`` + a plain ``torch.optim.Adam``
  (its state is laid out like each weight); the mesh-aware metric is
  ``sg.dtensor.metrics.SparseCategoricalAccuracy(mesh=mesh)``.
- MNIST → scikit-learn's digits at 28×28 (no download): 1437 training images, so the last
  partial batch is dropped (a batch must split evenly over ``batch``).
- A last part the seed only describes: tensor parallelism on a (2, 2) mesh, with the first
  Linear split column-wise and the second row-wise over ``model``; then the same model
  trained Keras-style, ``Model.fit`` under ``sg.distribute.experimental.MeshStrategy`` (the
  seed's TF 2.9 could not fit a DTensor model; Keras 3's ``ModelParallel`` distribution can).
"""

import argparse
import collections
import warnings

import numpy as np
import torch
import torch.nn.functional as F

import stratagem as sg
from stratagem import dtensor

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=128)
parser.add_argument("--learning-rate", type=float, default=0.01)
# Model.fit at this rate: 3 epochs land on either side of 0.90 test accuracy depending on the
# initial weights' draw, 5 reach about 0.95 (measured on one process, 3 seeds).
parser.add_argument("--fit-epochs", type=int, default=5)
args = parser.parse_args()
# The CPU mesh has no DTensor random-number tracker; same seeds on every process instead.
warnings.filterwarnings("ignore", "DTensor random operators")

# One device per process: as many devices as this job has processes (the seed: 8 virtual CPUs).
num_devices = sg.cluster.resolve_cluster().world_size
devices = [f"CPU:{i}" for i in range(num_devices)]

# Deterministic pseudo-random number generation: every process must start from the same seed.
torch.manual_seed(1337)

# A data-parallel mesh.
mesh = dtensor.create_mesh([("batch", num_devices)], devices=devices)
chief = mesh.coordinate("batch") == 0


def log(*values):
    if chief:
        print(*values, flush=True)


example_weight_layout = dtensor.Layout([dtensor.UNSHARDED, dtensor.UNSHARDED], mesh)  # or
example_weight_layout = dtensor.Layout.replicated(mesh, rank=2)
example_data_layout = dtensor.Layout(["batch", dtensor.UNSHARDED], mesh)  # or
example_data_layout = dtensor.Layout.batch_sharded(mesh, "batch", rank=2)

# Layers with layouts.
unsharded_layout_2d = dtensor.Layout.replicated(mesh, 2)
unsharded_layout_1d = dtensor.Layout.replicated(mesh, 1)
model = torch.nn.Sequential(
    collections.OrderedDict(
        flatten=torch.nn.Flatten(),  # input_shape=(28, 28)
        d1=dtensor.layout_weights(
            torch.nn.Linear(28 * 28, 128), weight=unsharded_layout_2d, bias=unsharded_layout_1d
        ),
        relu=torch.nn.ReLU(),
        d2=dtensor.layout_weights(
            torch.nn.Linear(128, 10), weight=unsharded_layout_2d, bias=unsharded_layout_1d
        ),
    )
)

for name, weight in model.named_parameters():
    log(f"Weight name: {name} with layout: {weight.layout}")
    break

# The data set and the input pipeline: the same shuffle (seeded) on every process, each
# process taking its shard of every global batch.
(x_train, y_train), (x_test, y_test) = sg.data.datasets.load_digits(image_size=28)


def normalize_img(image, label):
    """Normalizes images: `uint8` -> `float32`."""
    return image.astype(np.float32) / np.float32(255.0), label


def input_pipeline(mesh, images, labels, batch_size, train):
    shards = mesh.dim_size("batch")
    ds = sg.data.Dataset.from_tensor_slices(normalize_img(images, labels))
    if train:
        ds = ds.shuffle(len(images), seed=1337)
    ds = ds.shard(shards, mesh.coordinate("batch"))
    return ds.batch(batch_size // shards, drop_remainder=train)


ds_train = input_pipeline(mesh, x_train, y_train, args.batch_size, train=True)
ds_test = input_pipeline(mesh, x_test, y_test, args.batch_size, train=False)


def train_step(model, x, y, optimizer, metrics):
    logits = model(x)
    # The sum of the batch-sharded per-example losses is a replicated global loss.
    loss = F.cross_entropy(logits, y, reduction="sum")
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    for metric in metrics.values():
        metric.update_state(y_true=y, y_pred=logits.detach())
    loss_per_sample = loss.detach() / len(x)
    results = {"loss": loss_per_sample}
    return results


@torch.no_grad()
def eval_step(model, x, y, metrics):
    logits = model(x)
    loss = F.cross_entropy(logits, y, reduction="sum")
    for metric in metrics.values():
        metric.update_state(y_true=y, y_pred=logits)
    loss_per_sample = loss / len(x)
    results = {"eval_loss": loss_per_sample}
    return results


def pack_dtensor_inputs(images, labels, image_layout, label_layout):
    num_local_devices = image_layout.mesh.num_local_devices()
    images = torch.tensor_split(torch.as_tensor(images), num_local_devices)
    labels = torch.tensor_split(torch.as_tensor(labels), num_local_devices)
    images = dtensor.pack(images, image_layout)
    labels = dtensor.pack(labels, label_layout)
    return images, labels


def fit(model, mesh, ds_train, ds_test, num_epochs, tag):
    # A plain torch optimizer: its state tensors are DTensors laid out like their weights.
    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate)
    metrics = {"accuracy": dtensor.metrics.SparseCategoricalAccuracy(mesh=mesh)}
    eval_metrics = {"eval_accuracy": dtensor.metrics.SparseCategoricalAccuracy(mesh=mesh)}
    image_layout = dtensor.Layout.batch_sharded(mesh, "batch", rank=3)  # (N, 28, 28)
    label_layout = dtensor.Layout.batch_sharded(mesh, "batch", rank=1)
    results = {}
    for epoch in range(num_epochs):
        log("============================")
        log("Epoch: ", epoch)
        for metric in metrics.values():
            metric.reset_state()
        step = 0
        for input in ds_train:
            images, labels = input[0], input[1]
            images, labels = pack_dtensor_inputs(images, labels, image_layout, label_layout)
            results.update(train_step(model, images, labels, optimizer, metrics))
            step += 1
        for metric_name, metric in metrics.items():
            results[metric_name] = metric.result()
        log(
            f"{step} steps - loss: {float(results['loss'].full_tensor()):.4f} - accuracy: "
            f"{float(results['accuracy']):.4f}"
        )

    for metric in eval_metrics.values():
        metric.reset_state()
    for input in ds_test:
        images, labels = input[0], input[1]
        images, labels = pack_dtensor_inputs(images, labels, image_layout, label_layout)
        results.update(eval_step(model, images, labels, eval_metrics))
    for metric_name, metric in eval_metrics.items():
        results[metric_name] = metric.result()
    for metric_name, metric in results.items():
        value = metric.full_tensor() if isinstance(metric, dtensor.DTensor) else metric
        log(f"{metric_name}: {float(value)}")
    log(f"{tag} test accuracy: {float(results['eval_accuracy']):.4f}")


fit(model, mesh, ds_train, ds_test, args.epochs, "data-parallel")


# Layouts for existing model code: LayoutMap, keyed by regexes on the weights' paths.
class SubclassedModel(torch.nn.Module):
    def __init__(self, name=None):
        super().__init__()
        self.feature = torch.nn.Linear(16, 16)
        self.feature_2 = torch.nn.Linear(16, 24)
        self.dropout = torch.nn.Dropout(0.1)

    def forward(self, inputs):
        x = self.feature(inputs)
        x = self.dropout(x)
        return self.feature_2(x)


# model.feature.weight, model.feature.bias, model.feature_2.weight, model.feature_2.bias
layout_map = dtensor.LayoutMap(mesh=mesh)
layout_map["feature.*weight"] = dtensor.Layout.inner_sharded(mesh, "batch", rank=2)
layout_map["feature.*bias"] = dtensor.Layout.batch_sharded(mesh, "batch", rank=1)

with layout_map.scope():
    subclassed_model = SubclassedModel()

dtensor_input = dtensor.copy_to_mesh(torch.zeros((16, 16)), layout=unsharded_layout_2d)
subclassed_model(dtensor_input)
log(subclassed_model.feature.weight.layout)

# Sequential models: the children's names are the keys.
with layout_map.scope():
    model = torch.nn.Sequential(
        collections.OrderedDict(
            feature=torch.nn.Linear(16, 16),
            dropout=torch.nn.Dropout(0.1),
            feature_2=torch.nn.Linear(16, 32),
        )
    )
log(model.feature_2.weight.layout)

# Tensor parallelism on a (batch, model) mesh: d1 split column-wise (its outputs), d2 row-wise
# (its inputs), so each process holds half of every Linear weight; DTensor adds the all-reduce.
if num_devices % 2 == 0:
    tp_mesh = dtensor.create_mesh([("batch", num_devices // 2), ("model", 2)])
    tp_layout_map = dtensor.LayoutMap(mesh=tp_mesh)
    tp_layout_map["d1.weight"] = dtensor.Layout(["model", dtensor.UNSHARDED], tp_mesh)
    tp_layout_map["d1.bias"] = dtensor.Layout(["model"], tp_mesh)
    tp_layout_map["d2.weight"] = dtensor.Layout([dtensor.UNSHARDED, "model"], tp_mesh)
    torch.manual_seed(1337)
    with tp_layout_map.scope():
        tp_model = torch.nn.Sequential(
            collections.OrderedDict(
                flatten=torch.nn.Flatten(),
                d1=torch.nn.Linear(28 * 28, 128),
                relu=torch.nn.ReLU(),
                d2=torch.nn.Linear(128, 10),
            )
        )
    for name, weight in tp_model.named_parameters():
        log(
            f"Weight name: {name} with layout: {weight.layout} local shape: "
            f"{tuple(weight.to_local().shape)}"
        )
    tp_train = input_pipeline(tp_mesh, x_train, y_train, args.batch_size, train=True)
    tp_test = input_pipeline(tp_mesh, x_test, y_test, args.batch_size, train=False)
    fit(tp_model, tp_mesh, tp_train, tp_test, args.epochs, "tensor-parallel")

    # The same tensor-parallel model trained Keras-style: MeshStrategy gives Model.fit the mesh
    # (batches split along `batch`, weights laid out by the map when the model is built).
    strategy = sg.distribute.experimental.MeshStrategy(tp_mesh, tp_layout_map)
    torch.manual_seed(1337)
    with strategy.scope():
        keras_model = sg.keras.Model(
            torch.nn.Sequential(
                collections.OrderedDict(
                    flatten=torch.nn.Flatten(),
                    d1=torch.nn.Linear(28 * 28, 128),
                    relu=torch.nn.ReLU(),
                    d2=torch.nn.Linear(128, 10),
                )
            )
        )
        keras_model.compile(
            optimizer=sg.keras.optimizers.Adam(learning_rate=args.learning_rate),
            loss=sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    train_images, train_labels = normalize_img(x_train, y_train)
    test_images, test_labels = normalize_img(x_test, y_test)
    keras_model.fit(
        train_images, train_labels, batch_size=args.batch_size, epochs=args.fit_epochs,
        verbose=2 if chief else 0,
    )  # fmt: skip
    _, accuracy = keras_model.evaluate(test_images, test_labels, batch_size=args.batch_size)
    log(f"Model.fit tensor-parallel test accuracy: {accuracy:.4f}")
