"""``sg.data.experimental``: the names tutorials reach through ``tf.data.experimental``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from stratagem.data._device_copy import CudaCopier, cpu_copy, torch_device
from stratagem.data._prefetch import AUTOTUNE_BUFFER, Prefetch
from stratagem.data.dataset import AUTOTUNE, Dataset, appended
from stratagem.data.optional import Optional
from stratagem.data.options import SHARD_HINT, AutoShardPolicy, DistributeOptions

INFINITE_CARDINALITY = Dataset.INFINITE
UNKNOWN_CARDINALITY = Dataset.UNKNOWN


def cardinality(dataset: Dataset) -> int:
    """``dataset.cardinality()``, as ``tf.data.experimental.cardinality`` returns it."""
    return dataset.cardinality()


def prefetch_to_device(
    device: str | torch.device, buffer_size: int | None = None
) -> Callable[[Dataset], Dataset]:
    """A transformation for ``dataset.apply``: elements copied to ``device`` ("/gpu:0",
    "cuda:1", "/cpu:0") up to ``buffer_size`` ahead, in a background thread, as
    ``tf.data.experimental.prefetch_to_device``. Put it last in the pipeline.

    On CUDA, each tensor is pinned and copied with ``non_blocking=True`` on a side stream, and
    the step's stream waits for that copy (on the GPU) when it takes the element. On a CPU
    device it is ``prefetch``: the elements are already in host memory. ``None`` (TF's
    default) or ``AUTOTUNE`` keeps two elements ahead.
    """
    target = torch_device(device)
    size = AUTOTUNE if buffer_size is None else buffer_size
    if isinstance(size, bool) or not isinstance(size, int) or size < AUTOTUNE:
        raise TypeError(
            f"prefetch_to_device buffer_size must be an int >= 1, or None/AUTOTUNE; got "
            f"{buffer_size!r}"
        )
    size = AUTOTUNE_BUFFER if size in (AUTOTUNE, 0) else size
    description = f"prefetch_to_device({str(target)!r}, {size})"

    def transformation(dataset: Dataset) -> Dataset:
        if target.type == "cuda":
            copier = CudaCopier(target)
            return appended(
                dataset, lambda n: Prefetch(n, size, copier.send, copier.receive, description)
            )
        return appended(dataset, lambda n: Prefetch(n, size, cpu_copy, None, description))

    return transformation


def copy_to_device(target_device: str | torch.device) -> Callable[[Dataset], Dataset]:
    """``tf.data.experimental.copy_to_device``: elements copied to ``target_device``; here,
    ``prefetch_to_device`` with one element ahead."""
    return prefetch_to_device(target_device, 1)


__all__ = [
    "AUTOTUNE",
    "INFINITE_CARDINALITY",
    "SHARD_HINT",
    "UNKNOWN_CARDINALITY",
    "AutoShardPolicy",
    "DistributeOptions",
    "Optional",
    "cardinality",
    "copy_to_device",
    "prefetch_to_device",
]
