"""What flows through a pipeline: chunks of element *indices*, or chunks of element values.

A pipeline built from in-memory arrays never moves data until the last moment: shuffle, shard,
repeat, take, skip and batch rearrange int64 index arrays with numpy, and each element (or each
batch) is read from the arrays with one vectorized index per component. Only ``map`` and
``filter`` need the values, so from them on the pipeline carries ``ValueChunk``s.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import torch

from stratagem.data import _structure
from stratagem.data.spec import TensorSpec
from stratagem.errors import InputError

# Sources hand out their indices in blocks, so that ``range(10**9).take(5)`` stays cheap.
BLOCK = 1 << 16

Selection = slice | np.ndarray  # a slice or a boolean mask over the elements of a chunk


class Source(Protocol):
    """Something that turns an index array into an element (or a batch of elements)."""

    def __len__(self) -> int: ...

    def element_spec(self) -> Any:
        """The structure of ``TensorSpec``s of one element."""
        ...

    def gather(self, ids: int | np.ndarray) -> Any:
        """The element at ``ids`` (an int), or the elements stacked along new leading dims."""
        ...


class TensorSlices:
    """The slices along dim 0 of equally long tensors, packed into ``template``'s structure."""

    def __init__(self, template: Any, leaves: list[torch.Tensor | np.ndarray]) -> None:
        self.template = template
        self.leaves = leaves
        self._pack = _structure.packer(template)

    def __len__(self) -> int:
        return int(self.leaves[0].shape[0])

    def element_spec(self) -> Any:
        return self._pack([TensorSpec.from_value(leaf[:0]).inner() for leaf in self.leaves])

    def gather(self, ids: int | np.ndarray) -> Any:
        if isinstance(ids, int):
            return self._pack([_item(leaf, ids) for leaf in self.leaves])
        index = torch.from_numpy(np.ascontiguousarray(ids))
        return self._pack([_rows(leaf, ids, index) for leaf in self.leaves])


def _rows(leaf: torch.Tensor | np.ndarray, ids: np.ndarray, index: torch.Tensor) -> Any:
    """``leaf``'s elements at ``ids`` (a copy, as tf.data hands out batches of its own).

    For a tensor on an accelerator, indexing with a CPU index makes the host wait for the
    device (the index is copied there synchronously) in every step: a run of consecutive rows
    (unshuffled batches) is read as a slice of the device tensor, other rows with the index
    copied over from pinned memory, which the host does not wait for."""
    if isinstance(leaf, np.ndarray):
        return leaf[ids]
    if leaf.device.type == "cpu":
        return leaf[index]
    if ids.ndim == 1 and len(ids) and np.array_equal(ids, np.arange(ids[0], ids[0] + len(ids))):
        return leaf[int(ids[0]) : int(ids[0]) + len(ids)].clone()
    if leaf.device.type == "cuda":
        return leaf[index.pin_memory().to(leaf.device, non_blocking=True)]
    return leaf[index.to(leaf.device)]


def _item(leaf: torch.Tensor | np.ndarray, i: int) -> Any:
    # A string element is a Python str (or bytes), as tf.data's .numpy() gives one scalar.
    if isinstance(leaf, np.ndarray) and leaf.ndim == 1:
        return leaf[i].item()
    return leaf[i]


class RangeSource:
    """``start + i * step`` for ``i < n``, computed on demand (never allocated whole)."""

    def __init__(self, start: int, step: int, n: int) -> None:
        self.start, self.step, self.n = start, step, n

    def __len__(self) -> int:
        return self.n

    def element_spec(self) -> Any:
        return TensorSpec((), torch.int64)

    def gather(self, ids: int | np.ndarray) -> Any:
        if isinstance(ids, int):
            return torch.tensor(self.start + ids * self.step, dtype=torch.int64)
        return torch.from_numpy(np.asarray(self.start + ids * self.step, dtype=np.int64))


class IndexChunk:
    """``len(ids)`` elements of ``source``; ``ids`` has shape ``[k, *element_index_shape]``.

    An unbatched element's index is a scalar; a batch's is a vector, so a chunk of batches is
    a 2-d array and a batch of batches a 3-d one, read with one ``tensor[ids[i]]`` each.
    """

    __slots__ = ("ids", "source")

    def __init__(self, source: Source, ids: np.ndarray) -> None:
        self.source = source
        self.ids = ids

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def select(self, selection: Selection) -> IndexChunk:
        return IndexChunk(self.source, self.ids[selection])

    def elements(self) -> Iterator[Any]:
        if self.ids.ndim == 1:
            for i in self.ids.tolist():  # Python ints index fastest, and return views
                yield self.source.gather(i)
        else:
            for row in self.ids:
                yield self.source.gather(row)


class ValueChunk:
    """Elements already computed (by ``map``), as nested structures of tensors."""

    __slots__ = ("values",)

    def __init__(self, values: list[Any]) -> None:
        self.values = values

    def __len__(self) -> int:
        return len(self.values)

    def select(self, selection: Selection) -> ValueChunk:
        if isinstance(selection, slice):
            return ValueChunk(self.values[selection])
        return ValueChunk([self.values[i] for i in np.flatnonzero(selection)])

    def elements(self) -> Iterator[Any]:
        return iter(self.values)


class ErrorChunk:
    """One element that failed (its ``map`` function raised), as tf.data keeps an element's
    error: it is raised where the element is asked for, by ``next()``, and the pass goes on
    with the next element. Stages pass it through in order; one that cannot (it would have to
    look inside the element) raises it there, ending its pass."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __len__(self) -> int:
        return 1  # it stands for one element: take, skip and shard count it

    def select(self, selection: Selection) -> ErrorChunk | ValueChunk:
        chosen = range(1)[selection] if isinstance(selection, slice) else np.flatnonzero(selection)
        return self if len(chosen) else ValueChunk([])

    def elements(self) -> Iterator[Any]:
        raise self.error


Chunk = IndexChunk | ValueChunk | ErrorChunk


def source_chunks(source: Source, at: dict[str, int] | None = None) -> Iterator[Chunk]:
    """``source``'s elements, in order, as index chunks of at most ``BLOCK``: all of them, or
    from ``at["position"]`` on, which is kept up to date (the index of the next chunk's first)."""
    at = {"position": 0} if at is None else at
    n = len(source)
    while at["position"] < n:
        start = at["position"]
        at["position"] = end = min(start + BLOCK, n)
        yield IndexChunk(source, np.arange(start, end, dtype=np.int64))


def concat(chunks: list[Chunk]) -> Chunk:
    """One chunk holding the elements of ``chunks`` (all of one kind, as a pass never mixes)."""
    if len(chunks) == 1:
        return chunks[0]
    if all(isinstance(c, ValueChunk) for c in chunks):
        return ValueChunk([v for c in chunks for v in c.values])
    first = chunks[0]
    if not isinstance(first, IndexChunk) or not all(
        isinstance(c, IndexChunk) and c.source is first.source for c in chunks
    ):
        raise AssertionError("a pipeline pass mixed chunks of different sources")  # a bug of ours
    shapes = {c.ids.shape[1:] for c in chunks}
    if len(shapes) > 1:
        raise InputError(
            "cannot batch elements of different shapes together: their leading dims are "
            f"{sorted(shapes)}; batch them with drop_remainder=True upstream, or batch each "
            "shape separately"
        )
    return IndexChunk(first.source, np.concatenate([c.ids for c in chunks]))


def stack_values(values: list[Any], path: str = "") -> Any:
    """Elements of one structure stacked leaf by leaf into a batch (``torch.stack``).

    Recurses over the structure once per component, not once per element.
    """
    first = values[0]
    where = path or "<element>"
    if first is None:
        # TF's NoneTensorSpec batches to itself: a batch of None components is None.
        if any(v is not None for v in values):
            kinds = sorted({type(v).__name__ for v in values})
            raise InputError(f"cannot batch component {where}: it holds {kinds}, not only None")
        return None
    if _structure.is_strings(first):
        if not all(_structure.is_strings(v) for v in values):
            kinds = sorted({type(v).__name__ for v in values})
            raise InputError(f"cannot batch component {where}: it holds {kinds}, not only strings")
        shapes = {np.shape(v) for v in values}
        if len(shapes) > 1:
            raise InputError(
                f"cannot batch component {where}: elements have different shapes {sorted(shapes)}"
            )
        return np.array(values)
    if isinstance(first, torch.Tensor):
        if not all(isinstance(v, torch.Tensor) for v in values):
            kinds = sorted({type(v).__name__ for v in values})
            raise InputError(f"cannot batch component {where}: it holds {kinds}, not only tensors")
        shapes = {v.shape for v in values}
        if len(shapes) > 1:
            raise InputError(
                f"cannot batch component {where}: elements have different shapes "
                f"{sorted(tuple(shape) for shape in shapes)}"
            )
        return torch.stack(values)
    if not _structure.is_structure(first):
        raise InputError(
            f"cannot batch component {where}: it is a {type(first).__name__}, not a tensor"
        )
    if isinstance(first, dict):
        keys = first.keys()
        if not all(isinstance(v, dict) and v.keys() == keys for v in values):
            found = sorted(
                {repr(list(v)) if isinstance(v, dict) else type(v).__name__ for v in values}
            )
            raise InputError(f"cannot batch elements with different structures at {where}: {found}")
        return {k: stack_values([v[k] for v in values], f"{path}[{k!r}]") for k in keys}
    kind, size = type(first), len(first)
    if not all(type(v) is kind and len(v) == size for v in values):
        found = sorted(
            {
                f"{type(v).__name__} of {len(v)}"
                if _structure.is_structure(v) and v is not None
                else type(v).__name__
                for v in values
            }
        )
        raise InputError(f"cannot batch elements with different structures at {where}: {found}")
    stacked = [stack_values([v[i] for v in values], f"{path}[{i}]") for i in range(size)]
    if kind is list:
        return stacked
    return kind(*stacked) if hasattr(first, "_fields") else tuple(stacked)
