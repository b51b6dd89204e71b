"""Reading a sharded checkpoint's DCP files without running code from them.

``torch.distributed.checkpoint`` reads its ``.metadata`` index with ``pickle.load`` and loads
non-tensor values with ``torch.load(weights_only=False)``, so a crafted checkpoint could run what
it wants. Here ``.metadata`` is read by an unpickler that resolves only DCP's own metadata
classes (plain dataclasses and an enum), ``torch.Size``, torch's dtypes and layouts and
``pathlib`` paths, and refuses any other global. Then the index is checked: every piece of data
lies in a plain file of the checkpoint directory (no ``../``, no absolute path) at a
non-negative offset, with no stream transform. Non-tensor values load with
``weights_only=True``. A torch whose DCP renames its metadata classes fails with a named error.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from stratagem.train.manifest import DamagedSaveError, UnsafeCheckpointError, is_plain_name

__all__ = ["SafeLoadPlanner", "SafeReader", "load_dcp_metadata", "read_dcp_metadata"]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, set[str]] = {
    _DCP_METADATA: {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a lookup of torch's layouts by name
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase, where: str) -> None:
        super().__init__(file)
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return getattr(importlib.import_module(module), name)
        if module == "torch":  # dtypes pickle as torch.<name>: allow those values only
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype | torch.memory_format):
                return value
        raise UnsafeCheckpointError(
            f"{self._where} asks to load the global {module}.{name}, which is not part of DCP's "
            f"checkpoint metadata; refusing to unpickle it (it could run code)"
        )


def load_dcp_metadata(data: bytes, checkpoint: str) -> Metadata:
    """DCP's ``Metadata`` from the bytes of ``.metadata``, resolving only DCP's own classes,
    and checked to keep every read inside ``checkpoint``."""
    where = f"the sharded checkpoint {os.path.join(checkpoint, '.metadata')!r}"
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), where).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:
        raise DamagedSaveError(f"{where} is unreadable: {type(e).__name__}: {e}") from e
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(
            f"{where} holds a {type(metadata).__name__}, expected DCP's Metadata"
        )
    for index, info in (metadata.storage_data or {}).items():
        relative = getattr(info, "relative_path", None)
        if not isinstance(relative, str) or not is_plain_name(relative):
            raise UnsafeCheckpointError(
                f"{where} stores {getattr(index, 'fqn', index)!r} in {relative!r}, which is not "
                f"a file of the checkpoint directory; refusing to read outside it"
            )
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0):
            raise UnsafeCheckpointError(
                f"{where} stores {getattr(index, 'fqn', index)!r} at offset {offset!r} length "
                f"{length!r}; expected non-negative integers"
            )
        if getattr(info, "transform_descriptors", None):
            raise UnsafeCheckpointError(
                f"{where} asks for the stream transforms {info.transform_descriptors!r} on "
                f"{relative!r}; stratagem writes none"
            )
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader, handing DCP the ``Metadata`` that ``load_dcp_metadata`` read and
    checked beforehand (never ``pickle.load``)."""

    def __init__(self, path: str, metadata: Metadata) -> None:
        super().__init__(path)
        self._checked = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's fall-back to per-rank files: none of ours
            raise FileNotFoundError(f"{os.fspath(self.path)!r} has no per-rank DCP metadata")
        metadata = self._checked
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_dcp_metadata(checkpoint: str) -> Metadata:
    """The checked ``Metadata`` of the sharded checkpoint directory ``checkpoint``."""
    with open(os.path.join(checkpoint, ".metadata"), "rb") as f:
        return load_dcp_metadata(f.read(), checkpoint)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, loading non-tensor values with ``weights_only=True`` (DCP's own
    uses ``weights_only=False``)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as e:
            raise UnsafeCheckpointError(
                f"the sharded checkpoint's value {read_item.dest_index.fqn!r} does not load with "
                f"torch.load(weights_only=True) ({e}); refusing to unpickle it"
            ) from e
        # DefaultLoadPlanner.load_bytes (torch 2.13) but for the torch.load above.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
