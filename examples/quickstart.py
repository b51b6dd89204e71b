"""Quick start: Keras's fit on PyTorch over 2 replicas (the README's and the docs' example)."""

import numpy as np
from torch import nn

import stratagem as sg

# Two logical devices on this CPU, as TF's tutorials do; with GPUs, leave these 2 lines out.
cpu = sg.config.list_physical_devices("CPU")[0]
sg.config.set_logical_device_configuration(cpu, [sg.config.LogicalDeviceConfiguration()] * 2)

(x_train, y_train), (x_test, y_test) = sg.data.datasets.load_digits(image_size=8)
x_train, x_test = x_train / np.float32(255), x_test / np.float32(255)

strategy = sg.distribute.MirroredStrategy()  # a replica per device, gradients summed
with strategy.scope():
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    model = sg.keras.Model(net)
    loss = sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer="adam", loss=loss, metrics=["accuracy"])
model.fit(x_train, y_train, batch_size=64, epochs=5)
print(f"Test accuracy: {model.evaluate(x_test, y_test)[1]:.4f}")
