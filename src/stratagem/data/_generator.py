"""``Dataset.from_generator``: elements from a Python generator, checked against a signature.

As in TensorFlow, ``generator`` is a callable: each pass over the dataset calls it again (with
``args``) for a new iterator. Every element is converted to the declared dtypes and checked
against the declared structure and shapes, so a generator that yields something else fails at
that element with what it yielded and what was declared.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from stratagem.data import _structure
from stratagem.data._chunks import Chunk, ValueChunk
from stratagem.data._nodes import UNKNOWN, Node, Pass, PassState
from stratagem.data.spec import TensorSpec, as_dtype, string
from stratagem.errors import InputError


def signature(output_types: Any, output_shapes: Any, output_signature: Any) -> Any:
    """The element structure of ``TensorSpec``s from TF's two ways of declaring it."""
    if output_signature is not None:
        if output_types is not None or output_shapes is not None:
            raise TypeError(
                "from_generator takes either output_signature, or output_types (with optional "
                "output_shapes), not both (as in TensorFlow); got output_signature="
                f"{output_signature!r} with output_types={output_types!r}, output_shapes="
                f"{output_shapes!r}"
            )
        leaves = _structure.flatten_with_paths(output_signature)
        wrong = [f"{path}: {leaf!r}" for path, leaf in leaves if not isinstance(leaf, TensorSpec)]
        if wrong:
            raise TypeError(
                "from_generator's output_signature must be a structure of sg.data.TensorSpec; "
                f"got {', '.join(wrong)}"
            )
        return output_signature
    if output_types is None:
        raise TypeError(
            "from_generator needs the elements' signature, as TensorFlow does: pass "
            "output_signature=sg.data.TensorSpec(shape, dtype) (or a structure of them), or "
            "output_types (with optional output_shapes)"
        )
    types = _structure.flatten_with_paths(output_types)
    if output_shapes is None:
        return _structure.map_structure(lambda _, dtype: TensorSpec(None, dtype), output_types)
    shapes = _shape_leaves(output_types, output_shapes)
    if len(shapes) != len(types):
        raise TypeError(
            f"output_shapes {output_shapes!r} does not match the structure of output_types "
            f"{output_types!r}"
        )
    specs = iter([TensorSpec(shape, dtype) for (_, dtype), shape in zip(types, shapes)])
    return _structure.pack(output_types, specs)


def _shape_leaves(types: Any, shapes: Any) -> list[Any]:
    """The shapes matching each leaf of ``types``: a shape is a tuple/list/Size of ints, so it
    cannot be flattened as a structure blindly."""
    if not _structure.is_structure(types):
        return [shapes]
    if types is None:
        return []
    if isinstance(types, dict):
        if not isinstance(shapes, dict) or shapes.keys() != types.keys():
            return []
        return [s for key in types for s in _shape_leaves(types[key], shapes[key])]
    if not isinstance(shapes, (tuple, list)) or len(shapes) != len(types):
        return []
    return [s for t, shape in zip(types, shapes) for s in _shape_leaves(t, shape)]


class Generated(Node):
    """A source node: each pass calls ``generator(*args)`` and checks what it yields."""

    def __init__(self, generator: Callable[..., Any], args: tuple[Any, ...], spec: Any) -> None:
        self.generator, self.args, self.spec = generator, args, spec
        self._paths = _structure.flatten_with_paths(spec)
        self._pack = _structure.packer(spec)

    def cardinality(self) -> int:
        return UNKNOWN  # as TF: a generator's length is not known

    def describe(self) -> str:
        name = getattr(self.generator, "__name__", type(self.generator).__name__)
        return f"from_generator({name})"

    def rebuilt(self, upstream: Node | None, seed: int, position: int) -> Node:
        return self

    def element_spec(self) -> Any:
        return self.spec

    def open(self, state: PassState | None = None) -> Pass:
        if state is not None:
            raise InputError(self._unsaveable())
        iterator = iter(self.generator(*self.args))
        return Pass(self._elements(iterator), self._refuse_state)

    def _refuse_state(self) -> PassState:
        raise InputError(self._unsaveable())

    def _unsaveable(self) -> str:
        # As TF, which refuses to checkpoint a dataset with a py_function source.
        return (
            f"cannot checkpoint the position of an iterator over {self.describe()}: where a "
            "Python generator stands cannot be saved, and starting it over would repeat its "
            "elements; make the data a from_tensor_slices or range source (a generator's "
            "elements can be listed first), or leave the iterator out of the checkpoint"
        )

    def _elements(self, iterator: Iterator[Any]) -> Iterator[Chunk]:
        # One element a chunk: a generator may be slow or endless, so never read ahead of need.
        for value in iterator:
            yield ValueChunk([self._check(value)])

    def _check(self, value: Any) -> Any:
        if len(self._paths) == 1 and not _structure.is_structure(self.spec):
            leaves = [value]
        else:
            leaves = _leaves_like(self.spec, value)
        return self._pack([_convert(path, spec, v) for (path, spec), v in zip(self._paths, leaves)])


def _leaves_like(spec: Any, value: Any) -> list[Any]:
    """``value``'s components in the order of ``spec``'s, or an error naming the mismatch."""
    if not _structure.is_structure(spec):
        return [value]
    if spec is None:
        if value is not None:
            raise InputError(
                f"the generator yielded {_describe(value)} where the declared structure has None"
            )
        return []
    if isinstance(spec, dict):
        if not isinstance(value, dict) or value.keys() != spec.keys():
            raise InputError(
                f"the generator yielded {_describe(value)}, which does not match the declared "
                f"structure {spec!r}"
            )
        return [leaf for key in spec for leaf in _leaves_like(spec[key], value[key])]
    if not isinstance(value, (tuple, list)) or len(value) != len(spec):
        raise InputError(
            f"the generator yielded {_describe(value)}, which does not match the declared "
            f"structure {spec!r}"
        )
    return [leaf for s, v in zip(spec, value) for leaf in _leaves_like(s, v)]


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def _convert(path: str, spec: TensorSpec, value: Any) -> Any:
    where = "the generator's element" if path == "<element>" else f"component {path}"
    if spec.dtype is string:
        if isinstance(value, (str, bytes)):
            component: Any = value
            shape: tuple[int, ...] = ()
        else:
            component = np.asarray(value)
            if component.dtype.kind not in "USO":
                raise InputError(
                    f"{where}: the generator yielded {component.dtype} values where strings "
                    "were declared"
                )
            shape = component.shape
    else:
        try:
            if isinstance(value, torch.Tensor):
                component = value.detach().to(as_dtype(spec.dtype))
            else:
                component = torch.as_tensor(np.asarray(value), dtype=spec.dtype)
        except (TypeError, ValueError, RuntimeError) as error:
            raise InputError(
                f"{where}: cannot convert the generator's value {value!r} to {spec.dtype} ({error})"
            ) from None
        shape = tuple(component.shape)
    if spec.shape is not None and (
        len(shape) != len(spec.shape)
        or any(d is not None and d != s for d, s in zip(spec.shape, shape))
    ):
        raise InputError(
            f"{where}: the generator yielded a value of shape {shape}, which does not match "
            f"the declared shape {spec.shape}"
        )
    return component
