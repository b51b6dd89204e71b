"""``sg.nn``: the loss helpers of ``tf.nn`` that distributed training needs."""

from stratagem.distribute.machinery.loss_scaling import (
    compute_average_loss,
    scale_regularization_loss,
)

__all__ = ["compute_average_loss", "scale_regularization_loss"]
