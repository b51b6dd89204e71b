"""The seed's ``mnist.py``, ported: the data set and the model the workers share.

TensorFlow → stratagem, line by line: ``tf.data.Dataset`` → ``sg.data.Dataset``; the Keras
``Sequential`` CNN → a ``torch.nn.Sequential`` of the same layers. The data is scikit-learn's
digits upsampled to 28×28 (no download), or a local Keras ``mnist.npz`` when
``MNIST_NPZ``/``--data`` names one.
"""

import os

import numpy as np
import torch

import stratagem as sg


def load_data():
    path = os.environ.get("MNIST_NPZ")
    if path:
        return sg.data.datasets.load_mnist(path)
    return sg.data.datasets.load_digits(image_size=28)


def mnist_dataset(batch_size):
    (x_train, y_train), _ = load_data()
    # The `x` arrays are in uint8 and have values in the range [0, 255].
    # You need to convert them to float32 with values in the range [0, 1]
    x_train = x_train / np.float32(255)
    y_train = y_train.astype(np.int64)
    # .repeat(): the digits are 1437 images, fewer than MNIST's 60000, so an epoch of 70 steps
    # needs more than one pass over them.
    train_dataset = sg.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(60000).repeat()
    return train_dataset


def dataset_fn(global_batch_size, input_context):
    batch_size = input_context.get_per_replica_batch_size(global_batch_size)
    dataset = mnist_dataset(batch_size)
    dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    dataset = dataset.batch(batch_size)
    return dataset


def test_dataset(global_batch_size):
    _, (x_test, y_test) = load_data()
    x_test = x_test / np.float32(255)
    return sg.data.Dataset.from_tensor_slices((x_test, y_test.astype(np.int64))).batch(
        global_batch_size
    )


def build_cnn_model():
    return torch.nn.Sequential(
        torch.nn.Unflatten(1, (1, 28)),  # Input(28, 28) + Reshape(28, 28, 1), channels first
        torch.nn.Conv2d(1, 32, 3),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(26 * 26 * 32, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    )
