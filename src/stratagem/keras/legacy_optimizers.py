"""``sg.keras.optimizers.legacy``: TF 2.11+'s ``tf.keras.optimizers.legacy`` names (the Keras 2
optimizers, kept for old code), the same recipes as ``sg.keras.optimizers``: there is one
optimizer implementation here, torch's, so legacy and current differ in nothing. Keras 2's
``lr=`` and ``decay=`` arguments are not accepted (``learning_rate=``; a schedule callback)."""

from stratagem.keras.optimizer_recipes import SGD, Adagrad, Adam, RMSprop

__all__ = ["SGD", "Adagrad", "Adam", "RMSprop"]
