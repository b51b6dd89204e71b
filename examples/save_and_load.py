"""TensorFlow's "Save and load a model using a distribution strategy" tutorial, ported.

tensorflow/docs site/en/tutorials/distribute/save_and_load.ipynb, cell by cell, with the
README's substitutions only: ``tf.`` → ``sg.``; the Keras ``Sequential`` → a ``torch.nn``
``Sequential`` in ``sg.keras.Model`` (channels first), whose first layer's ``input_shape=`` is
``model.build(...)``; ``tfds.load("mnist")`` → ``sg.data.datasets.load_digits()`` (no download);
``hub.KerasLayer(loaded, trainable=True)`` in a model → ``sg.keras.Model(loaded)``; ``/tmp/...``
paths → ``--dir``.
The distribution calls are the tutorial's: ``MirroredStrategy``, ``model.save``,
``tf.saved_model.save/load``, ``SaveOptions``/``LoadOptions(experimental_io_device=
"/job:localhost")``, loading inside and outside a strategy's scope.

    python examples/save_and_load.py                           # MirroredStrategy(), as TF
    python examples/save_and_load.py --devices cpu:0,cpu:1     # 2 replica threads
    python examples/save_and_load.py --epochs 1 --train-batches 4  # seconds (the test's run)
"""

import argparse
import os
import tempfile

import torch

import stratagem as sg

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=2, help="the tutorial's epochs=2")
parser.add_argument("--devices", help="MirroredStrategy devices, e.g. cpu:0,cpu:1 (default: as TF)")
parser.add_argument("--dir", help="where the models are saved (default: a temporary directory)")
parser.add_argument("--train-batches", type=int, help="train on this many batches (a quick run)")
args = parser.parse_args()
DEVICES = args.devices.split(",") if args.devices else None
SAVE_DIR = args.dir or tempfile.mkdtemp(prefix="save_and_load-")
torch.manual_seed(0)

# --- Load the data and create the model using tf.distribute.MirroredStrategy -------------------

mirrored_strategy = sg.distribute.MirroredStrategy(DEVICES)


def get_data():
    (x_train, y_train), (x_test, y_test) = sg.data.datasets.load_digits(image_size=28)
    mnist_train = sg.data.Dataset.from_tensor_slices((x_train, y_train))
    mnist_test = sg.data.Dataset.from_tensor_slices((x_test, y_test))

    BUFFER_SIZE = 10000

    BATCH_SIZE_PER_REPLICA = 64
    BATCH_SIZE = BATCH_SIZE_PER_REPLICA * mirrored_strategy.num_replicas_in_sync

    def scale(image, label):
        image = image.to(torch.float32)  # tf.cast(image, tf.float32)
        image /= 255

        return image, label

    train_dataset = mnist_train.map(scale).cache().shuffle(BUFFER_SIZE).batch(BATCH_SIZE)
    eval_dataset = mnist_test.map(scale).batch(BATCH_SIZE)
    if args.train_batches:  # not in the tutorial: a quick run for the tests
        train_dataset = train_dataset.take(args.train_batches)

    return train_dataset, eval_dataset


def get_model():
    with mirrored_strategy.scope():
        model = sg.keras.Model(
            torch.nn.Sequential(
                torch.nn.Unflatten(1, (1, 28)),  # (28, 28) images, channels first
                torch.nn.Conv2d(1, 32, 3),
                torch.nn.ReLU(),
                torch.nn.MaxPool2d(2),
                torch.nn.Flatten(),
                torch.nn.Linear(13 * 13 * 32, 64),
                torch.nn.ReLU(),
                torch.nn.Linear(64, 10),
            )
        )
        model.build((None, 28, 28))  # Keras: input_shape=(28, 28, 1) on the first layer

        model.compile(
            loss=sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            optimizer=sg.keras.optimizers.Adam(),
            metrics=[sg.metrics.SparseCategoricalAccuracy()],
        )
        return model


# Train the model with Model.fit:
model = get_model()
train_dataset, eval_dataset = get_data()
model.fit(train_dataset, epochs=args.epochs)

# --- The Keras API ----------------------------------------------------------------------------

keras_model_path = os.path.join(SAVE_DIR, "keras_save.keras")
model.save(keras_model_path)

# Restore the model without tf.distribute.Strategy:
restored_keras_model = sg.keras.models.load_model(keras_model_path)
restored_keras_model.fit(train_dataset, epochs=args.epochs)

# Restore the model and train it using a tf.distribute.Strategy:
another_strategy = sg.distribute.OneDeviceStrategy("/cpu:0")
with another_strategy.scope():
    restored_keras_model_ds = sg.keras.models.load_model(keras_model_path)
    restored_keras_model_ds.fit(train_dataset, epochs=args.epochs)

# --- The tf.saved_model API -------------------------------------------------------------------

model = get_model()  # get a fresh model
saved_model_path = os.path.join(SAVE_DIR, "tf_save")
sg.saved_model.save(model, saved_model_path)

DEFAULT_FUNCTION_KEY = "serving_default"
loaded = sg.saved_model.load(saved_model_path)
inference_func = loaded.signatures[DEFAULT_FUNCTION_KEY]

predict_dataset = eval_dataset.map(lambda image, label: image)
for batch in predict_dataset.take(1):
    print(inference_func(batch))

# Load and do inference in a distributed manner:
another_strategy = sg.distribute.MirroredStrategy(DEVICES)
with another_strategy.scope():
    loaded = sg.saved_model.load(saved_model_path)
    inference_func = loaded.signatures[DEFAULT_FUNCTION_KEY]

    dist_predict_dataset = another_strategy.experimental_distribute_dataset(predict_dataset)

    # Calling the function in a distributed manner
    for batch in dist_predict_dataset:
        result = another_strategy.run(inference_func, args=(batch,))
        print(result)
        break


def build_model(loaded):
    # Wrap what's loaded to a KerasLayer (port: the loaded object is a torch module, which
    # sg.keras.Model wraps and trains as tf.keras.Model(x, hub.KerasLayer(loaded, trainable=True)))
    model = sg.keras.Model(loaded)
    return model


another_strategy = sg.distribute.MirroredStrategy(DEVICES)
with another_strategy.scope():
    loaded = sg.saved_model.load(saved_model_path)
    model = build_model(loaded)

    model.compile(
        loss=sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=sg.keras.optimizers.Adam(),
        metrics=[sg.metrics.SparseCategoricalAccuracy()],
    )
    model.fit(train_dataset, epochs=args.epochs)

# --- Mixing the APIs: Model.save, then the low-level loader -----------------------------------

model = get_model()

# Saving the model using Keras Model.save
model.save(saved_model_path)

another_strategy = sg.distribute.MirroredStrategy(DEVICES)
# Loading the model using the lower-level API
with another_strategy.scope():
    loaded = sg.saved_model.load(saved_model_path)

# --- Saving/Loading from a local device -------------------------------------------------------

model = get_model()

# Saving the model to a path on localhost.
saved_model_path = os.path.join(SAVE_DIR, "tf_save")
save_options = sg.saved_model.SaveOptions(experimental_io_device="/job:localhost")
model.save(saved_model_path, options=save_options)

# Loading the model from a path on localhost.
another_strategy = sg.distribute.MirroredStrategy(DEVICES)
with another_strategy.scope():
    load_options = sg.saved_model.LoadOptions(experimental_io_device="/job:localhost")
    loaded = sg.keras.models.load_model(saved_model_path, options=load_options)

# --- Caveats: a model that was never called has no traced function ----------------------------


class SubclassedModel(torch.nn.Module):
    """Example model defined by subclassing (tf.keras.Model → torch.nn.Module)."""

    output_name = "output_layer"

    def __init__(self):
        super().__init__()
        self._dense_layer = torch.nn.Linear(5, 5)

    def forward(self, inputs):
        return self._dense_layer(inputs)


my_model = sg.keras.Model(SubclassedModel())
try:
    my_model.save(saved_model_path)
except ValueError as e:
    print(f"{type(e).__name__}: ", *e.args)

sg.saved_model.save(my_model, saved_model_path)
x = sg.saved_model.load(saved_model_path)
print("signatures of a model never called:", x.signatures)

# Fitting the model traces it (Keras's save_spec), and saving then has a signature.
BATCH_SIZE_PER_REPLICA = 4
BATCH_SIZE = BATCH_SIZE_PER_REPLICA * mirrored_strategy.num_replicas_in_sync

dataset_size = 100
dataset = sg.data.Dataset.from_tensor_slices(
    (torch.arange(5, dtype=torch.float32).repeat(dataset_size, 1),) * 2
).batch(BATCH_SIZE)  # TF: Dataset.from_tensors((range(5), range(5))).repeat(dataset_size)

my_model.compile(optimizer="adam", loss="mean_squared_error")
my_model.fit(dataset, epochs=2)

my_model.save(saved_model_path)
print("signatures after fit:", sorted(sg.saved_model.load(saved_model_path).signatures))
