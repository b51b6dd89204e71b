"""How a checkpoint lies on disk: its directory, atomic writes, and the ``checkpoint`` index.

One checkpoint is a directory at the path it was saved to::

    <path>/state.pt    one ``torch.save`` of {name: state}, always loaded with ``weights_only=True``
    <path>/meta.json   what the checkpoint holds, readable without torch

It is written into a hidden sibling directory and renamed into place, so a crash mid-save leaves
the previous checkpoint intact and no half-written directory under the final name. A directory of
checkpoints also holds an index file, ``checkpoint`` (JSON), naming them and the latest one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from typing import Any

import torch

from stratagem.errors import CheckpointError

FORMAT = "stratagem.checkpoint"
FORMAT_VERSION = 1
STATE_FILE = "state.pt"
META_FILE = "meta.json"
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of a sharded checkpoint
INDEX_FORMAT = "stratagem.checkpoint_index"
INDEX_VERSION = 1
DEFAULT_INDEX_FILENAME = "checkpoint"  # TensorFlow's name for the same file

# ".<name>.tmp-<pid>-<hex>" is a save in progress, ".<name>.old-<pid>-<hex>" the checkpoint it
# replaces, ".<name>.del-<pid>-<hex>" one being deleted. All are hidden so that scans of a
# directory never mistake them for checkpoints.
_LEFTOVER = re.compile(r"^\.(?P<target>.+)\.(?P<what>tmp|old|del)-(?P<pid>\d+)-[0-9a-f]{8}$")


def read_meta(path: str) -> dict[str, Any]:
    """The parsed ``meta.json`` of the checkpoint at ``path``; a CheckpointError says why not."""
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"no checkpoint at {path!r}; use latest_checkpoint(directory) to find the newest one"
        )
    expected = f"expected a directory holding {META_FILE} and {STATE_FILE} written by stratagem"
    if not os.path.isdir(path):
        raise CheckpointError(f"{path!r} is not a stratagem checkpoint: it is a file, {expected}")
    meta_path = os.path.join(path, META_FILE)
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(
            f"{path!r} is not a stratagem checkpoint: it has no {META_FILE}; {expected} "
            f"(a directory of checkpoints? use latest_checkpoint({path!r}))"
        ) from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{meta_path!r} is unreadable ({e}); {expected}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(
            f"{path!r} is not a stratagem checkpoint: {META_FILE} has format {found!r}, "
            f"expected {FORMAT!r}"
        )
    version = meta.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path!r} has format version {version!r}; this stratagem reads "
            f"versions up to {FORMAT_VERSION}"
        )
    # A sharded checkpoint (train/sharded.py) holds DCP's files in place of state.pt.
    data = DCP_METADATA if meta.get("sharded") else STATE_FILE
    if not os.path.isfile(os.path.join(path, data)):
        raise CheckpointError(f"checkpoint {path!r} has no {data}; {expected}")
    return meta


def load_state(path: str) -> Any:
    state_path = os.path.join(path, STATE_FILE)
    try:
        # weights_only: a checkpoint is data; unpickling arbitrary objects would run code.
        # map_location: restores copy into the trackables' own devices, wherever they are.
        return torch.load(state_path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"cannot load {state_path!r} with torch.load(weights_only=True): {e}"
        ) from e


def is_checkpoint(path: str) -> bool:
    """Whether ``path`` is a complete stratagem checkpoint directory."""
    try:
        read_meta(path)
    except (OSError, CheckpointError):
        return False
    return True


def fsync_dir(path: str) -> None:
    # Makes renames and new entries durable; not possible on every platform (Windows).
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def hidden_sibling(path: str, what: str) -> str:
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.{what}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def write_atomically(path: str, state: dict[str, Any], meta: dict[str, Any]) -> None:
    """Write a checkpoint directory at ``path`` so that readers see the old one or the new one."""
    path = os.path.normpath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if os.path.lexists(path) and not (
        is_checkpoint(path) or (os.path.isdir(path) and not os.listdir(path))
    ):
        raise CheckpointError(
            f"refusing to overwrite {path!r}: it exists and is not a stratagem checkpoint; "
            f"expected a free path, an empty directory or an earlier checkpoint"
        )
    tmp = hidden_sibling(path, "tmp")
    old: str | None = None
    os.mkdir(tmp)
    try:
        state_path = os.path.join(tmp, STATE_FILE)
        with open(state_path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        # Refuse now what restore would refuse later, when it is too late to fix.
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(state_path)
        if unsafe:
            raise CheckpointError(
                f"cannot save {path!r}: the state holds objects that torch.load(weights_only="
                f"True) refuses: {sorted(unsafe)}; keep state_dicts to tensors and plain Python "
                f"values, or allow them with torch.serialization.add_safe_globals"
            )
        # default=str: a strategy may record values JSON lacks (a torch.device); text will do.
        write_file(os.path.join(tmp, META_FILE), json.dumps(meta, indent=2, default=str) + "\n")
        fsync_dir(tmp)
        if os.path.lexists(path):
            old = hidden_sibling(path, "old")
            os.rename(path, old)
        os.rename(tmp, path)
        fsync_dir(os.path.dirname(path) or ".")
    except BaseException:
        if old is not None and not os.path.lexists(path):
            os.rename(old, path)  # put the previous checkpoint back
            old = None
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_file(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def leftover(name: str) -> tuple[str, str, int] | None:
    """(target name, "tmp", "old" or "del", pid) when ``name`` is left by an interrupted write."""
    m = _LEFTOVER.match(name)
    return (m["target"], m["what"], int(m["pid"])) if m else None


# --- the index file: ``<directory>/checkpoint``, JSON -------------------------------------


def read_index(directory: str, filename: str = DEFAULT_INDEX_FILENAME) -> dict[str, Any] | None:
    """The index of ``directory``; None when absent or not ours (a TensorFlow text file, say)."""
    try:
        with open(os.path.join(directory, filename), encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        return None
    entries = index.get("checkpoints")
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and isinstance(e.get("name"), str) for e in entries
    ):
        return None
    return index


def write_index(
    directory: str,
    entries: list[tuple[str, float]],
    latest: str | None,
    last_preserved_time: float | None = None,
    filename: str = DEFAULT_INDEX_FILENAME,
) -> None:
    """Replace the index atomically: names are relative to ``directory``, oldest first."""
    index = {
        "format": INDEX_FORMAT,
        "version": INDEX_VERSION,
        "latest": latest,
        "checkpoints": [{"name": n, "time": t} for n, t in entries],
        "last_preserved_time": last_preserved_time,
    }
    target = os.path.join(directory, filename)
    tmp = hidden_sibling(target, "tmp")
    try:
        write_file(tmp, json.dumps(index, indent=2) + "\n")
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_dir(directory)


def record_in_index(directory: str, name: str, when: float | None = None) -> None:
    """Make ``name`` the latest checkpoint of ``directory``'s index, keeping the other entries."""
    index = read_index(directory) or {}
    entries = [
        (e["name"], float(e.get("time") or 0.0))
        for e in index.get("checkpoints", [])
        if e["name"] != name
    ]
    entries.append((name, time.time() if when is None else when))
    write_index(directory, entries, name, index.get("last_preserved_time"))
