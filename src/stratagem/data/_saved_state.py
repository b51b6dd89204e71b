"""Where an iterator stands, as plain data and tensors for a checkpoint, and back.

A pass's state (``Pass.state``) holds chunks; ``encode`` turns them into dicts that
``torch.load(weights_only=True)`` reads back: an index chunk as the position of its source among
the pipeline's sources and its ids, computed elements as tagged lists of tensors, strings and
numbers. ``decode`` is the reverse, against the live pipeline's sources. Tensors are copied, so
a saved element never drags the whole array it is a view of into the file.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from stratagem.data._chunks import ErrorChunk, IndexChunk, Source, ValueChunk
from stratagem.errors import InputError

_CHUNK = "__chunk__"
_ENCODED = "__encoded__"


class Encoded:
    """A state already encoded against other sources (an inner iterator's ``state_dict``):
    kept as it is, and handed back as it is by ``decode``."""

    __slots__ = ("state",)

    def __init__(self, state: Any) -> None:
        self.state = state


def encode(state: Any, sources: list[Source]) -> Any:
    """``state`` with every chunk in it made plain data (see the module docstring)."""
    if isinstance(state, IndexChunk):
        for position, source in enumerate(sources):
            if source is state.source:
                ids = torch.from_numpy(np.ascontiguousarray(state.ids).copy())
                return {_CHUNK: "index", "source": position, "ids": ids}
        # A source this pipeline does not name (none today): keep the elements themselves.
        return {_CHUNK: "values", "values": [_value(e) for e in state.elements()]}
    if isinstance(state, ValueChunk):
        return {_CHUNK: "values", "values": [_value(v) for v in state.values]}
    if isinstance(state, Encoded):
        return {_ENCODED: state.state}
    if isinstance(state, ErrorChunk):
        error = state.error
        return {_CHUNK: "error", "type": type(error).__name__, "message": str(error)}
    if isinstance(state, dict):
        return {key: encode(value, sources) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return [encode(value, sources) for value in state]
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if state is None or isinstance(state, bool | int | float | str):
        return state
    raise InputError(f"cannot save an iterator state holding a {type(state).__name__}: {state!r}")


def decode(saved: Any, sources: list[Source]) -> Any:
    """The state ``encode`` made ``saved`` from, its chunks over ``sources``."""
    if isinstance(saved, dict) and _ENCODED in saved:
        return saved[_ENCODED]
    if isinstance(saved, dict) and _CHUNK in saved:
        kind = saved[_CHUNK]
        if kind == "index":
            position = saved["source"]
            if not isinstance(position, int) or not 0 <= position < len(sources):
                raise InputError(
                    f"a saved iterator state names source {position!r}; the pipeline has "
                    f"{len(sources)}"
                )
            return IndexChunk(sources[position], _ids(saved["ids"]))
        if kind == "values":
            return ValueChunk([_element(v) for v in saved["values"]])
        if kind == "error":
            return ErrorChunk(
                InputError(
                    f"this element failed before the iterator was saved: "
                    f"{saved['type']}: {saved['message']}"
                )
            )
        raise InputError(f"a saved iterator state holds a chunk of unknown kind {kind!r}")
    if isinstance(saved, dict):
        return {key: decode(value, sources) for key, value in saved.items()}
    if isinstance(saved, list):
        return [decode(value, sources) for value in saved]
    return saved


def _ids(saved: Any) -> np.ndarray:
    if not isinstance(saved, torch.Tensor) or saved.dtype != torch.int64:
        raise InputError(f"a saved iterator state's element ids are not int64 ids: {saved!r}")
    return saved.numpy()


def _value(value: Any) -> list[Any]:
    """One element (a structure of tensors, strings, numbers) as a tagged list."""
    if isinstance(value, torch.Tensor):
        return ["tensor", value.detach().clone()]
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "USO":
            return ["strings", value.tolist(), list(value.shape)]
        return ["ndarray", torch.from_numpy(value.copy())]
    if value is None:
        return ["none"]
    if isinstance(value, str | bytes | bool | int | float):
        return ["plain", value]
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        raise InputError(
            f"cannot save an iterator holding elements of the namedtuple "
            f"{type(value).__qualname__}: a checkpoint holds plain data only, and a class is "
            "not rebuilt from a file; map the elements to tuples or dicts first"
        )
    if isinstance(value, tuple):
        return ["tuple", [_value(v) for v in value]]
    if isinstance(value, list):
        return ["list", [_value(v) for v in value]]
    if isinstance(value, dict):
        return ["dict", [[k, _value(v)] for k, v in value.items()]]
    raise InputError(
        f"cannot save an iterator holding an element component of type "
        f"{type(value).__qualname__}; a checkpoint holds tensors, arrays, strings and numbers"
    )


def _element(saved: Any) -> Any:
    if not isinstance(saved, list) or not saved or not isinstance(saved[0], str):
        raise InputError(f"a saved iterator state holds a malformed element: {saved!r}")
    tag = saved[0]
    if tag == "tensor" and isinstance(saved[1], torch.Tensor):
        return saved[1]
    if tag == "ndarray" and isinstance(saved[1], torch.Tensor):
        return saved[1].numpy()
    if tag == "strings":
        return np.array(saved[1]).reshape(saved[2])
    if tag == "none":
        return None
    if tag == "plain":
        return saved[1]
    if tag == "tuple":
        return tuple(_element(v) for v in saved[1])
    if tag == "list":
        return [_element(v) for v in saved[1]]
    if tag == "dict":
        return {k: _element(v) for k, v in saved[1]}
    raise InputError(f"a saved iterator state holds an element tagged {tag!r}")
