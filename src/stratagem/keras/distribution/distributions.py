"""Keras 3's ``Distribution``, ``DataParallel`` and ``ModelParallel``, run by ``MeshStrategy``.

A distribution is data (its mesh, batch axis, layout map, Keras's ``get_*_layout``); the
work is an ``sg.distribute.experimental.MeshStrategy`` over the backend mesh, made on first use
(``distribution.strategy``). ``set_distribution(d)`` makes ``d`` current in this thread (as
Keras's global state is per thread) and enters its strategy's scope, so models built and fitted
after it are laid out and trained on the mesh; ``set_distribution(None)`` (or the next one)
leaves it. ``d.scope()`` does the same for a block, restoring the previous one.
``distribute_tensor(tensor, layout)`` lays out one tensor (every process gives the same tensor).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from stratagem import dtensor
from stratagem.distribute import Strategy
from stratagem.distribute.experimental import MeshStrategy
from stratagem.keras.distribution import device_mesh as devices_of_job
from stratagem.keras.distribution.device_mesh import DeviceMesh, TensorLayout
from stratagem.keras.distribution.keras_layout_map import LayoutMap

DEFAULT_BATCH_DIM_NAME = "batch"


class Distribution:
    """``Distribution(device_mesh, batch_dim_name=None, auto_shard_dataset=True)``: the base."""

    def __init__(
        self,
        device_mesh: DeviceMesh,
        batch_dim_name: str | None = None,
        auto_shard_dataset: bool = True,
    ) -> None:
        if not auto_shard_dataset:
            raise NotImplementedError(
                "auto_shard_dataset=False (each process brings its own shard of the data) is "
                "not supported: stratagem's fit takes global batches and cuts them along "
                f"{batch_dim_name!r} itself; pass the whole dataset with auto_shard_dataset=True"
            )
        self._device_mesh = device_mesh
        self._batch_dim_name = batch_dim_name
        self._auto_shard_dataset = auto_shard_dataset
        self._num_processes = devices_of_job.num_processes()
        self._process_id = devices_of_job.process_id()
        self._is_multi_process = self._num_processes > 1
        self._strategy: Strategy | None = None

    @property
    def num_processes(self) -> int:
        return self._num_processes

    @property
    def num_model_replicas(self) -> int:
        raise NotImplementedError()

    @property
    def num_data_shards(self) -> int:
        return min(self.num_model_replicas, self.num_processes)

    @property
    def data_shard_id(self) -> int:
        """Which shard of the data this process reads: processes of one replica share one."""
        replicas = self.num_model_replicas
        if replicas >= self.num_processes:
            return self._process_id
        return self._process_id // (self.num_processes // replicas)

    def get_data_layout(self, data_shape: Sequence[int]) -> TensorLayout:
        raise NotImplementedError()

    def get_variable_layout(self, variable: Any) -> TensorLayout:
        raise NotImplementedError()

    def get_tensor_layout(self, path: str) -> TensorLayout | None:
        raise NotImplementedError()

    @property
    def strategy(self) -> Strategy | None:
        """The strategy that runs this distribution (stratagem's addition): none for Keras's
        abstract base, which only becomes current."""
        return None

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Make this distribution current for the block, then the previous one again."""
        original_scope = distribution()
        set_distribution(self)
        try:
            yield
        finally:
            set_distribution(original_scope)

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._device_mesh

    @property
    def batch_dim_name(self) -> str | None:
        return self._batch_dim_name

    @property
    def auto_shard_dataset(self) -> bool:
        return self._auto_shard_dataset

    def _data_layout(self, data_shape: Sequence[int]) -> TensorLayout:
        axes: list[str | None] = [None] * len(data_shape)
        axes[0] = self.batch_dim_name  # the first dimension is the batch
        return TensorLayout(axes, self.device_mesh)

    def _mesh_strategy(self, layout_map: dtensor.LayoutMap | None) -> Strategy:
        if self._strategy is None:
            assert self.batch_dim_name is not None
            self._strategy = MeshStrategy(
                self.device_mesh.backend_mesh, layout_map, batch_dim_name=self.batch_dim_name
            )
        return self._strategy

    def __repr__(self) -> str:
        return f"<{type(self).__name__} device_mesh={self.device_mesh}>"

    __str__ = __repr__


class DataParallel(Distribution):
    """``DataParallel(device_mesh=None, devices=None)``: weights replicated, batches split along
    the mesh's first axis (a 1-D mesh over ``devices``, or ``list_devices()``, when no mesh)."""

    def __init__(
        self,
        device_mesh: DeviceMesh | None = None,
        devices: Sequence[str] | None = None,
        auto_shard_dataset: bool = True,
    ) -> None:
        if device_mesh:
            if not isinstance(device_mesh, DeviceMesh):
                raise ValueError(
                    "Expect `mesh` to be an instance of `DeviceMesh`. "
                    f"Received: mesh={device_mesh} (of type {type(device_mesh)})"
                )
            super().__init__(device_mesh, device_mesh.axis_names[0], auto_shard_dataset)
            if device_mesh.devices.ndim != 1:
                warnings.warn(
                    f"Expect the input mesh to be 1D, but received mesh.devices.ndim="
                    f"{device_mesh.devices.ndim}. The first axis will be used for "
                    "data-parallel sharding.",
                    stacklevel=2,
                )
            return
        listed = np.array(devices if devices else devices_of_job.list_devices())
        mesh = DeviceMesh(listed.shape, [DEFAULT_BATCH_DIM_NAME], listed)
        super().__init__(mesh, DEFAULT_BATCH_DIM_NAME, auto_shard_dataset)

    @property
    def num_model_replicas(self) -> int:
        return int(self.device_mesh.devices.size)

    def get_data_layout(self, data_shape: Sequence[int]) -> TensorLayout:
        return self._data_layout(data_shape)

    def get_variable_layout(self, variable: Any) -> TensorLayout:
        """The variable's own ``layout`` when it has one, else replicated."""
        return _explicit_layout(variable) or TensorLayout(
            [None] * len(variable.shape), self.device_mesh
        )

    def get_tensor_layout(self, path: str) -> None:
        return None  # data parallelism leaves intermediate tensors as they are

    @property
    def strategy(self) -> Strategy:
        return self._mesh_strategy(None)


class ModelParallel(Distribution):
    """``ModelParallel(layout_map=..., batch_dim_name=None)``: weights laid out by the map
    (unmatched ones replicated), batches split along ``batch_dim_name`` (the first axis)."""

    def __init__(
        self,
        *,
        layout_map: LayoutMap | None = None,
        batch_dim_name: str | None = None,
        auto_shard_dataset: bool = True,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("device_mesh", None)
        if layout_map is None:
            raise ValueError("You must specify a layout_map argument.")
        if not isinstance(layout_map, LayoutMap):
            raise ValueError(
                "Argument `layout_map` must be a `LayoutMap` instance. "
                f"Received: layout_map={layout_map}"
            )
        mesh = layout_map.device_mesh
        super().__init__(mesh, batch_dim_name or mesh.axis_names[0], auto_shard_dataset)
        self._layout_map = layout_map
        if (
            self._is_multi_process
            and self.num_processes > self.num_model_replicas
            and self.num_processes % self.num_model_replicas != 0
        ):
            raise ValueError(
                "If `num_processes` is greater than `num_model_replicas`, `num_processes` must "
                "be divisible by `num_model_replicas`. Got num_processes="
                f"{self.num_processes}, num_model_replicas={self.num_model_replicas}."
            )

    @property
    def num_model_replicas(self) -> int:
        index = list(self.device_mesh.axis_names).index(self.batch_dim_name)
        return int(self.device_mesh.shape[index])

    def get_data_layout(self, data_shape: Sequence[int]) -> TensorLayout:
        return self._data_layout(data_shape)

    def get_variable_layout(self, variable: Any) -> TensorLayout:
        """The variable's own ``layout``, else the map's for ``variable.path``, else
        replicated."""
        explicit = _explicit_layout(variable)
        if explicit is not None:
            return explicit
        found = self._layout_map[variable.path]
        if found is not None:
            return found
        return TensorLayout([None] * len(variable.shape), self.device_mesh)

    def get_tensor_layout(self, path: str) -> TensorLayout | None:
        return self._layout_map[path]

    @property
    def strategy(self) -> Strategy:
        return self._mesh_strategy(self._layout_map.backend_layout_map())


def _explicit_layout(variable: Any) -> TensorLayout | None:
    """A layout the variable carries itself (Keras's ``variable._layout``, here ``layout``)."""
    layout = getattr(variable, "layout", None)
    return layout if isinstance(layout, TensorLayout) else None


class _Current(threading.local):
    """This thread's distribution, and the strategy scope it holds open."""

    def __init__(self) -> None:
        self.distribution: Distribution | None = None
        self.scope: contextlib.ExitStack | None = None


_current = _Current()


def distribution() -> Distribution | None:
    """``keras.distribution.distribution()``: the current distribution, or None."""
    return _current.distribution


def set_distribution(value: Distribution | None) -> None:
    """``keras.distribution.set_distribution``: make ``value`` current in this thread.

    The previous distribution's strategy scope is left (its models are laid out then, as at
    any scope's end) and ``value``'s is entered, so what is built and fitted next runs on its
    mesh. The abstract ``Distribution`` has no strategy and only becomes current.
    """
    if value is not None and not isinstance(value, Distribution):
        raise ValueError(
            f"set_distribution: expected a keras.distribution Distribution (DataParallel, "
            f"ModelParallel) or None, got {type(value).__name__}: {value!r}"
        )
    held, _current.scope = _current.scope, None
    _current.distribution = None
    if held is not None:
        held.close()
    strategy = None if value is None else value.strategy
    if strategy is not None:
        stack = contextlib.ExitStack()
        stack.enter_context(strategy.scope())
        _current.scope = stack
    _current.distribution = value


def distribute_tensor(tensor: torch.Tensor, layout: TensorLayout) -> torch.Tensor:
    """``keras.distribution.distribute_tensor``: ``tensor`` laid out by ``layout`` (a DTensor
    re-laid, a plain tensor copied: every process passes the same one)."""
    if not isinstance(layout, TensorLayout):
        raise ValueError(
            f"distribute_tensor: layout must be a TensorLayout, got {type(layout).__name__}"
        )
    target = layout.backend_layout
    if isinstance(tensor, dtensor.DTensor):
        if dtensor.fetch_layout(tensor) == target:
            return tensor
        return dtensor.relayout(tensor, target)
    return dtensor.copy_to_mesh(torch.as_tensor(tensor), target)
