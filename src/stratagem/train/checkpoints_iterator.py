"""``checkpoints_iterator`` and ``wait_for_new_checkpoint``: TensorFlow's way to follow the
checkpoints a training job writes into a directory, as they appear (``tf.train``'s names and
arguments), for an evaluator running beside the training.

A checkpoint is only ever seen whole: saves are staged under hidden names and published in one
rename (``storage``), and ``latest_checkpoint`` checks the one it returns against its manifest,
falling back past a damaged one. The iterator yields a checkpoint when it is newer (by the save
time its ``meta.json`` records) than the last one yielded, so it never goes back to an older one
when the newest is damaged, and it yields a checkpoint saved again under the same path.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import datetime

from stratagem.errors import CheckpointError
from stratagem.train.checkpoint import PathLike
from stratagem.train.checkpoint_manager import latest_checkpoint
from stratagem.train.manifest import DamagedSaveError
from stratagem.train.storage import read_meta

__all__ = ["checkpoints_iterator", "wait_for_new_checkpoint"]

POLL_SECS = 1.0  # TF's seconds_to_sleep
REPORT_EVERY_SECS = 30.0


def wait_for_new_checkpoint(
    checkpoint_dir: PathLike,
    last_checkpoint: str | None = None,
    seconds_to_sleep: float = POLL_SECS,
    timeout: float | None = None,
) -> str | None:
    """The path of the latest checkpoint in ``checkpoint_dir`` once it is not
    ``last_checkpoint`` (TF's test: another path); None after ``timeout`` seconds without one."""
    directory = os.fspath(checkpoint_dir)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        path = _latest(directory, set())
        if path is not None and path != last_checkpoint:
            return path
        if deadline is not None and time.monotonic() + seconds_to_sleep > deadline:
            return None
        time.sleep(seconds_to_sleep)


def checkpoints_iterator(
    checkpoint_dir: PathLike,
    min_interval_secs: float = 0,
    timeout: float | None = None,
    timeout_fn: Callable[[], bool] | None = None,
    *,
    poll_secs: float = POLL_SECS,
    report_every_secs: float | None = REPORT_EVERY_SECS,
) -> Iterator[str]:
    """Yield the path of each new latest checkpoint in ``checkpoint_dir`` as it appears.

    As TensorFlow's: only the latest is yielded, so checkpoints written while the caller works
    on one are skipped; at least ``min_interval_secs`` pass between yields; after ``timeout``
    seconds without a new checkpoint, ``timeout_fn()`` decides (True: stop; False: wait on),
    and without a ``timeout_fn`` the iteration stops. While it waits, it prints
    ``waiting for a new checkpoint in DIR (30s)`` when the wait starts and every
    ``report_every_secs`` (None: never).
    """
    directory = os.fspath(checkpoint_dir)
    if timeout is not None and not timeout >= 0:
        raise ValueError(
            f"checkpoints_iterator: timeout must be >= 0 seconds or None, got {timeout!r}"
        )
    if not poll_secs > 0:
        raise ValueError(f"checkpoints_iterator: poll_secs must be > 0, got {poll_secs!r}")
    last_time: float | None = None  # save time of the last yield
    reported: set[str] = set()  # damage already reported, reported once
    seen: tuple[object, ...] | None = None  # the directory as it was at the last look
    while True:
        started = time.monotonic()
        waited_from = started
        next_report = started  # as soon as a look finds nothing new, then every so often
        found: str | None = None
        while found is None:
            now_seen = _snapshot(directory)
            if now_seen != seen:  # look closer (verify checksums) only when something changed
                seen = now_seen
                path = _latest(directory, reported)
                if path is not None and (last_time is None or _saved_at(path) > last_time):
                    found = path
                    break
            now = time.monotonic()
            if report_every_secs is not None and now >= next_report:
                print(
                    f"waiting for a new checkpoint in {directory} ({now - started:.0f}s)",
                    flush=True,
                )
                next_report = now + report_every_secs
            if timeout is not None and now - waited_from >= timeout:
                if timeout_fn is None or timeout_fn():
                    return
                waited_from = now  # TF: the timeout starts again
            time.sleep(poll_secs)
        last_time = _saved_at(found)
        yielded_at = time.monotonic()
        yield found
        rest = min_interval_secs - (time.monotonic() - yielded_at)
        if rest > 0:
            time.sleep(rest)


def _snapshot(directory: str) -> tuple[object, ...]:
    """What changes when a checkpoint is published (renamed in whole: a new name, or a new
    directory under the old one), deleted, or indexed: the entries' names and mtimes."""
    try:
        with os.scandir(directory) as entries:
            seen = []
            for entry in entries:
                try:
                    seen.append((entry.name, entry.stat().st_mtime_ns, entry.inode()))
                except OSError:
                    seen.append((entry.name, None, None))
    except OSError:
        return ()
    return tuple(sorted(seen, key=lambda e: e[0]))


def _latest(directory: str, reported: set[str]) -> str | None:
    """``latest_checkpoint``, with what it says about damaged checkpoints printed once each
    instead of warned at every look; None while every checkpoint there is damaged."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            path = latest_checkpoint(directory)
        except DamagedSaveError as e:
            _report(str(e), reported)
            return None
    for warning in caught:
        _report(str(warning.message), reported)
    return path


def _report(message: str, reported: set[str]) -> None:
    if message not in reported:
        reported.add(message)
        print(f"checkpoints_iterator: {message}", flush=True)


def _saved_at(path: str) -> float:
    """The save time ``meta.json`` records (its mtime for an old save without one)."""
    try:
        created = read_meta(path).get("created")
        return datetime.fromisoformat(str(created)).timestamp()
    except (OSError, CheckpointError, ValueError):
        try:
            return os.stat(path).st_mtime
        except OSError:
            return float("-inf")
