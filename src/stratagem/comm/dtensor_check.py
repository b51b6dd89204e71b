"""Telling a DTensor (a tensor laid out on a mesh) from a plain tensor, at no import cost.

Layers that must not import ``dtensor`` (train, keras, the loss helpers) ask here. Until
``torch.distributed.tensor`` is loaded no DTensor can exist, so the check never loads it.
"""

from __future__ import annotations

import sys


def is_dtensor(value: object) -> bool:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor``."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)
