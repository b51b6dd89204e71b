"""``CheckpointManager`` and ``latest_checkpoint``: numbered checkpoints kept in one directory.

The directory holds checkpoint directories ``<checkpoint_name>-<n>`` and an index file
``checkpoint`` (JSON: the latest name and the managed names with their save times, oldest first),
replaced atomically after each save. A new manager on the same directory reads the index, so the
numbering and the deletion of old checkpoints continue across restarts.
"""

from __future__ import annotations

import operator
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable
from datetime import datetime
from typing import Any

import torch

from stratagem.errors import CheckpointError
from stratagem.train.background_writes import CheckpointOptions, is_async
from stratagem.train.checkpoint import (
    Checkpoint,
    PathLike,
    complete_save,
    is_writer,
    say_restored,
    write_numbered,
)
from stratagem.train.manifest import DamagedSaveError, FellBackWarning
from stratagem.train.storage import (
    DEFAULT_INDEX_FILENAME,
    hidden_sibling,
    is_checkpoint,
    leftover,
    looks_like_checkpoint,
    read_index,
    read_meta,
    verify_checkpoint,
    write_index,
)

__all__ = ["CheckpointManager", "first_intact", "latest_checkpoint"]


def latest_checkpoint(checkpoint_dir: PathLike, latest_filename: str | None = None) -> str | None:
    """The path of the newest intact checkpoint in ``checkpoint_dir``, or None when there is
    none at all.

    The index file's latest entry when it still exists; otherwise (no index, or its entry was
    deleted) the newest stratagem checkpoint directory there, whatever its name, by the save
    time in its ``meta.json`` and then its mtime. Hidden entries (saves in progress or
    interrupted) are never returned. The one returned is checked against its manifest: when the
    newest is damaged, a ``FellBackWarning`` names it and the newest intact one is returned;
    when every checkpoint there is damaged, a ``DamagedSaveError`` names them (TensorFlow logs
    an error and returns None, so a restarted job would start again from scratch).
    An index naming a path outside the directory is an ``UnsafeCheckpointError``.
    """
    directory = os.fspath(checkpoint_dir)
    if not os.path.isdir(directory):
        return None
    index = read_index(directory, latest_filename or DEFAULT_INDEX_FILENAME)
    first = index.get("latest") if index is not None else None
    names = _newest_first(directory)
    if isinstance(first, str) and first in names:
        names.remove(first)
        names.insert(0, first)
    return first_intact(directory, names, "latest_checkpoint")


def first_intact(directory: str, names: list[str], caller: str) -> str | None:
    """The path of the first of ``names`` (newest first) whose files all match its manifest;
    a warning names those skipped as damaged; a DamagedSaveError when all are."""
    damaged: list[str] = []
    for name in names:
        path = os.path.join(directory, name)
        try:
            verify_checkpoint(path)
        except DamagedSaveError as e:
            damaged.append(str(e))
            continue
        except (OSError, CheckpointError):
            continue  # deleted meanwhile, or not a checkpoint
        if damaged:
            warnings.warn(
                f"{caller}: {len(damaged)} newer checkpoint(s) in {directory!r} are damaged "
                f"({'; '.join(damaged)}); falling back to {path!r}",
                FellBackWarning,
                stacklevel=3,
            )
        return path
    if damaged:
        raise DamagedSaveError(
            f"{caller}: every checkpoint in {directory!r} is damaged, none can be restored: "
            f"{'; '.join(damaged)}; delete them to start afresh, or restore an intact copy"
        )
    return None


def _created(meta: dict[str, Any]) -> float:
    try:
        return datetime.fromisoformat(str(meta.get("created"))).timestamp()
    except ValueError:
        return float("-inf")


def _newest_first(directory: str) -> list[str]:
    """The checkpoint directories here, intact or damaged, newest first: by save time, or the
    directory's mtime where ``meta.json`` cannot be read."""
    found: list[tuple[float, float, str]] = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith(".") or not entry.is_dir():
                continue
            try:
                mtime = entry.stat().st_mtime
                try:
                    created = _created(read_meta(entry.path))
                except CheckpointError:
                    if not looks_like_checkpoint(entry.path):
                        continue
                    created = mtime  # damaged: its save time is about its mtime
            except OSError:
                continue
            found.append((created, mtime, entry.name))
    return [name for *_, name in sorted(found, reverse=True)]


class CheckpointManager:
    """Saves numbered checkpoints into a directory and deletes the old ones (TF's manager).

    ``save()`` writes ``<directory>/<checkpoint_name>-<n>`` (``n`` is ``checkpoint_number``, else
    the checkpoint's incremented ``save_counter``), updates the index, then deletes the oldest
    checkpoints beyond ``max_to_keep`` (None keeps all), except one per
    ``keep_checkpoint_every_n_hours``, which leaves the managed list but stays on disk. With
    ``checkpoint_interval``, ``save()`` writes only once ``step_counter`` has advanced that many
    steps since the last save. Only the chief writes, deletes or updates the index; other
    processes create the directory and keep the same list in memory. Under a multi-worker
    strategy ``save()`` is collective, as TF's: every worker calls it and returns once the
    checkpoint and the index are written (``Checkpoint.write``).
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory: PathLike,
        max_to_keep: int | None = 5,
        keep_checkpoint_every_n_hours: float | None = None,
        checkpoint_name: str = "ckpt",
        step_counter: torch.Tensor | None = None,
        checkpoint_interval: int | None = None,
        init_fn: Callable[[], Any] | None = None,
    ) -> None:
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(
                f"CheckpointManager needs a stratagem.train.Checkpoint, got "
                f"{type(checkpoint).__name__}"
            )
        if max_to_keep is not None and (
            isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1
        ):
            raise ValueError(f"max_to_keep must be a positive int or None, got {max_to_keep!r}")
        if keep_checkpoint_every_n_hours is not None and not keep_checkpoint_every_n_hours > 0:
            raise ValueError(
                f"keep_checkpoint_every_n_hours must be a positive number or None, got "
                f"{keep_checkpoint_every_n_hours!r}"
            )
        if not checkpoint_name or os.sep in checkpoint_name or "/" in checkpoint_name:
            raise ValueError(
                f"checkpoint_name must be a non-empty file name without '/', got "
                f"{checkpoint_name!r}"
            )
        if checkpoint_interval is not None:
            if step_counter is None:
                raise ValueError(
                    f"checkpoint_interval={checkpoint_interval!r} needs a step_counter (a "
                    f"one-element integer tensor) to measure the interval with"
                )
            if isinstance(checkpoint_interval, bool) or not (
                isinstance(checkpoint_interval, int) and checkpoint_interval > 0
            ):
                raise ValueError(
                    f"checkpoint_interval must be a positive int, got {checkpoint_interval!r}"
                )
        if step_counter is not None and not (
            isinstance(step_counter, torch.Tensor) and step_counter.numel() == 1
        ):
            raise TypeError(
                f"step_counter must be a one-element tensor (like a 0-d int64 'step'), got "
                f"{type(step_counter).__name__}"
            )
        if init_fn is not None and not callable(init_fn):
            raise TypeError(f"init_fn must be callable or None, got {type(init_fn).__name__}")

        self._checkpoint = checkpoint
        self._directory = os.fspath(directory)
        self._max_to_keep = max_to_keep
        self._keep_hours = keep_checkpoint_every_n_hours
        self._checkpoint_name = checkpoint_name
        self._step_counter = step_counter
        self._checkpoint_interval = checkpoint_interval
        self._init_fn = init_fn
        self._last_checkpoint_step: int | None = None
        self._entries: list[tuple[str, float]] = []  # managed checkpoints, oldest first
        self._latest: str | None = None
        self._last_preserved = time.time()
        if is_writer(checkpoint):
            self._clean_leftovers()  # first: it may move a checkpoint back under its name
        self._load_index()

    # --- state on disk --------------------------------------------------------------------

    def _load_index(self) -> None:
        directory = self._directory
        if not os.path.isdir(directory):
            return
        index = read_index(directory)
        if index is None:
            if os.path.exists(os.path.join(directory, DEFAULT_INDEX_FILENAME)):
                warnings.warn(
                    f"{os.path.join(directory, DEFAULT_INDEX_FILENAME)!r} is not a stratagem "
                    f"checkpoint index; this manager starts a new one and will replace it",
                    stacklevel=3,
                )
            self._adopt_unindexed()
            return
        for entry in index["checkpoints"]:
            # Entries deleted behind the manager's back are forgotten, not errors; damaged
            # ones stay listed, so that restoring falls back past them with a warning.
            path = os.path.join(directory, entry["name"])
            if is_checkpoint(path) or looks_like_checkpoint(path):
                self._entries.append((entry["name"], float(entry.get("time") or 0.0)))
        names = [n for n, _ in self._entries]
        latest = index.get("latest")
        self._latest = latest if latest in names else (names[-1] if names else None)
        preserved = index.get("last_preserved_time")
        if isinstance(preserved, (int, float)):
            self._last_preserved = float(preserved)

    def _adopt_unindexed(self) -> None:
        """Without an index (a crash before the first one, or it was deleted), take over this
        manager's own ``<checkpoint_name>-<n>`` checkpoints in the order of their numbers."""
        pattern = re.compile(re.escape(self._checkpoint_name) + r"-(\d+)")
        found: list[tuple[int, str, float]] = []
        for name in os.listdir(self._directory):
            m = pattern.fullmatch(name)
            path = os.path.join(self._directory, name)
            if m and (is_checkpoint(path) or looks_like_checkpoint(path)):
                found.append((int(m[1]), name, os.path.getmtime(path)))
        found.sort()
        self._entries = [(name, mtime) for _, name, mtime in found]
        self._latest = self._entries[-1][0] if self._entries else None

    def _clean_leftovers(self) -> None:
        """Remove what interrupted writes left here; restore a checkpoint that a crash left
        renamed aside (between moving the old one away and the new one in)."""
        if not os.path.isdir(self._directory):
            return
        for name in os.listdir(self._directory):
            info = leftover(name)
            if info is None or info[2] == os.getpid():  # our own pid: possibly in progress
                continue
            target, what, _ = info
            path = os.path.join(self._directory, name)
            target_path = os.path.join(self._directory, target)
            try:
                if what == "old" and not os.path.lexists(target_path) and is_checkpoint(path):
                    os.rename(path, target_path)
                elif os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
            except OSError as e:
                warnings.warn(f"could not clean up {path!r}: {e}", stacklevel=3)

    def _delete(self, name: str) -> None:
        path = os.path.join(self._directory, name)
        if not (is_checkpoint(path) or looks_like_checkpoint(path)):
            return
        # Renamed first so that a crash mid-removal leaves a hidden leftover, never a
        # half-deleted directory under a checkpoint's name.
        doomed = hidden_sibling(path, "del")
        try:
            os.rename(path, doomed)
            shutil.rmtree(doomed)
        except OSError as e:
            warnings.warn(f"could not delete old checkpoint {path!r}: {e}", stacklevel=3)

    # --- public API -----------------------------------------------------------------------

    @property
    def directory(self) -> str:
        return self._directory

    @property
    def checkpoint(self) -> Checkpoint:
        return self._checkpoint

    @property
    def checkpoint_interval(self) -> int | None:
        return self._checkpoint_interval

    @property
    def checkpoints(self) -> list[str]:
        """Paths of the managed checkpoints, oldest first."""
        return [os.path.join(self._directory, name) for name, _ in self._entries]

    @property
    def latest_checkpoint(self) -> str | None:
        """Path of the newest managed checkpoint, or None before the first save."""
        return None if self._latest is None else os.path.join(self._directory, self._latest)

    def save(
        self,
        checkpoint_number: int | torch.Tensor | None = None,
        check_interval: bool = True,
        options: CheckpointOptions | None = None,
    ) -> str | None:
        """Write a numbered checkpoint and return its path (None when skipped by the interval).

        ``checkpoint_number`` names the checkpoint instead of ``save_counter`` (which is
        incremented either way, as in TF); ``check_interval=False`` saves even before
        ``checkpoint_interval`` steps have passed (but never twice at the same step).
        ``options=CheckpointOptions(enable_async=True)``: the write, the index and the removal
        of checkpoints beyond ``max_to_keep`` happen in the background, after the values are
        copied; ``manager.sync()`` (or ``checkpoint.sync()``) waits for them.
        """
        asynchronous = is_async(options)
        step: int | None = None
        if self._checkpoint_interval is not None:
            assert self._step_counter is not None  # checked in __init__
            step = int(self._step_counter)
            last = self._last_checkpoint_step
            if last is not None and (
                step == last or (check_interval and step < last + self._checkpoint_interval)
            ):
                return None
        number: int | None = None
        if checkpoint_number is not None:
            try:
                number = operator.index(checkpoint_number)
            except TypeError:
                raise TypeError(
                    f"checkpoint_number must be an int or a one-element integer tensor, got "
                    f"{checkpoint_number!r}"
                ) from None
        os.makedirs(self._directory, exist_ok=True)

        def name_for(counter: int) -> str:
            return f"{self._checkpoint_name}-{counter if number is None else number}"

        # The manager's own record changes now (an asynchronous save's path is known at once);
        # the index and the removal of old checkpoints follow the write, with what it was then.
        before = (list(self._entries), self._latest, self._last_preserved)
        name = name_for(int(self._checkpoint.save_counter) + 1)
        self._entries = [e for e in self._entries if e[0] != name] + [(name, time.time())]
        self._latest = name
        removed = self._sweep()
        recorded = (list(self._entries), self._latest, self._last_preserved)

        def index(path: str) -> None:
            if is_writer(self._checkpoint):
                # Index first: a crash while deleting leaves extra directories, never an index
                # naming checkpoints that are gone.
                write_index(self._directory, *recorded)
                for old in removed:
                    self._delete(old)

        try:
            path = write_numbered(
                self._checkpoint,
                lambda counter: os.path.join(self._directory, name_for(counter)),
                asynchronous,
                index,
            )
        except BaseException:
            self._entries, self._latest, self._last_preserved = before
            raise
        if not asynchronous:
            # Collective: every process returns with the checkpoint and the index written, so
            # any worker may restore latest_checkpoint now.
            complete_save(self._checkpoint, "CheckpointManager.save")
        if step is not None:
            self._last_checkpoint_step = step
        return path

    def sync(self) -> None:
        """Wait for the asynchronous saves under way (``Checkpoint.sync``; collective)."""
        self._checkpoint.sync()

    def _sweep(self) -> list[str]:
        """Drop the oldest entries beyond ``max_to_keep``; return those to delete from disk."""
        removed: list[str] = []
        if self._max_to_keep is None:
            return removed
        while len(self._entries) > self._max_to_keep:
            name, saved_at = self._entries.pop(0)
            if (
                self._keep_hours is not None
                and saved_at - self._keep_hours * 3600.0 >= self._last_preserved
            ):
                self._last_preserved = saved_at  # kept on disk, no longer managed
                continue
            removed.append(name)
        return removed

    def restore_or_initialize(self) -> str | None:
        """Restore the latest checkpoint and return its path, else call ``init_fn`` (None).

        A damaged latest checkpoint is skipped with a ``FellBackWarning`` for the newest intact
        one; a ``DamagedSaveError`` when every managed checkpoint is damaged."""
        if self._latest is not None:
            names = [self._latest] + [n for n, _ in reversed(self._entries) if n != self._latest]
            path = first_intact(self._directory, names, "CheckpointManager.restore_or_initialize")
            if path is None:  # all deleted behind the manager's back
                if self._init_fn is not None:
                    self._init_fn()
                return None
            self._checkpoint.restore(path)
            if self._step_counter is not None and self._checkpoint_interval is not None:
                self._last_checkpoint_step = int(self._step_counter)
            say_restored(self._checkpoint, path, self._step_counter)
            return path
        if self._init_fn is not None:
            self._init_fn()
        return None

    def __repr__(self) -> str:
        return (
            f"CheckpointManager(directory={self._directory!r}, max_to_keep={self._max_to_keep}, "
            f"checkpoints={[n for n, _ in self._entries]})"
        )
