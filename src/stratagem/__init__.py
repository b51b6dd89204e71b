"""stratagem: TensorFlow's distribution strategies for PyTorch, on PyTorch's own engines.

``import stratagem as sg`` and port TensorFlow code by replacing ``tf.`` with ``sg.``.
"""

__version__ = "0.1.0"
