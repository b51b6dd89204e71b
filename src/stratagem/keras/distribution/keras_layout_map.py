"""Keras 3's ``LayoutMap``: variable paths (regex keys, ``re.fullmatch``) → ``TensorLayout``.

As Keras 3 (since 3.14; earlier releases used ``re.search``): an exact key wins, else the one
key that fully matches the path; two matching keys are a ``ValueError``; a tuple of axis names
is a ``TensorLayout`` on the map's mesh. A torch weight's path is its ``named_parameters()``
name written as Keras writes paths, with ``/`` (``d1.weight`` is ``d1/weight``); a key matches
either spelling. ``strict=`` and ``large_weight_size=`` are ``sg.dtensor.LayoutMap``'s: a key
that matches no weight, or a large weight no key matches, is named (an error with strict).
``backend_layout_map()`` is the ``sg.dtensor.LayoutMap`` the distribution lays weights out by.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterator, MutableMapping

from stratagem import dtensor
from stratagem.dtensor.layout_map import LARGE_WEIGHT_SIZE
from stratagem.keras.distribution.device_mesh import DeviceMesh, TensorLayout


def keras_path(path: str) -> str:
    """A torch weight path as Keras 3 writes variable paths: ``d1.weight`` → ``d1/weight``."""
    return path.replace(".", "/")


def fully_matches(key: str, path: str) -> bool:
    """Keras 3's rule: ``key`` fully matches ``path`` in its torch or its Keras spelling."""
    return re.fullmatch(key, path) is not None or re.fullmatch(key, keras_path(path)) is not None


class LayoutMap(MutableMapping[str, TensorLayout]):
    """``LayoutMap(device_mesh)``, dict-like: ``layout_map["d1/weight"] = ("model", None)``."""

    def __init__(
        self,
        device_mesh: DeviceMesh,
        *,
        strict: bool = False,
        large_weight_size: int = LARGE_WEIGHT_SIZE,
    ) -> None:
        self._layout_map: collections.OrderedDict[str, TensorLayout] = collections.OrderedDict()
        self._device_mesh = device_mesh
        self.strict = strict
        self.large_weight_size = large_weight_size
        self._backend: KerasKeyedLayoutMap | None = None

    def __getitem__(self, key: str) -> TensorLayout | None:
        """The layout for path ``key``: its exact key, else the one key that fully matches;
        None when none does; ``ValueError`` when several do."""
        if key in self._layout_map:
            return self._layout_map[key]
        matching_keys = [pattern for pattern in self._layout_map if fully_matches(pattern, key)]
        if len(matching_keys) > 1:
            raise ValueError(
                f"Path '{key}' matches multiple layout specification keys: {matching_keys}. "
                "Please make sure each tensor/variable path only matches at most one layout "
                "specification key in the LayoutMap."
            )
        return self._layout_map[matching_keys[0]] if matching_keys else None

    def __setitem__(self, key: str, layout: TensorLayout | tuple) -> None:
        if key in self._layout_map:
            raise ValueError(
                f"{key} already exist in the LayoutMap with value {self._layout_map[key]}. "
                "Please make sure to not use duplicated keys."
            )
        if isinstance(layout, tuple):
            layout = TensorLayout(axes=layout, device_mesh=None)
        if not isinstance(layout, TensorLayout):
            raise ValueError(f"{layout} should be a TensorLayout type, got {type(layout)}")
        if layout.device_mesh is None and self._device_mesh is not None:
            layout.device_mesh = self._device_mesh
        self._layout_map[key] = layout
        if self._backend is not None:  # a distribution already runs on it: keep it current
            self._backend[key] = layout.backend_layout

    def __delitem__(self, key: str) -> None:
        self._layout_map.pop(key)
        if self._backend is not None:
            del self._backend[key]

    def __len__(self) -> int:
        return len(self._layout_map)

    def __iter__(self) -> Iterator[str]:
        return iter(self._layout_map)

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._device_mesh

    def backend_layout_map(self) -> dtensor.LayoutMap:
        """The same keys and layouts as an ``sg.dtensor.LayoutMap`` on the backend mesh, with
        Keras 3's matching rule: one per ``LayoutMap``, made on first use and edited with it."""
        if self._backend is None:
            backend = KerasKeyedLayoutMap(
                self._device_mesh.backend_mesh,
                strict=self.strict,
                large_weight_size=self.large_weight_size,
            )
            for key, layout in self._layout_map.items():
                backend[key] = layout.backend_layout
            self._backend = backend
        return self._backend


class KerasKeyedLayoutMap(dtensor.LayoutMap):
    """An ``sg.dtensor.LayoutMap`` whose keys match paths as Keras 3's do (``fully_matches``)."""

    def key_matches(self, key: str, path: str) -> bool:
        return fully_matches(key, path)
