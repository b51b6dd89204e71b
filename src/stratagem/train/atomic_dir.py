"""Directories that appear whole or not at all: publish a staged directory, read a consistent one.

A save (a checkpoint, a saved model) is a directory of several files; a reader that loads it
while another process saves to the same path sees the old save or the new one, never a mix nor
a half-written one. Writers build the whole directory under a hidden sibling name and
``publish`` it: on Linux one ``renameat2(RENAME_EXCHANGE)`` swaps it with the previous save (the
path never goes missing), which is then deleted; elsewhere the previous save is renamed aside
and the new one in, and readers that find the path missing meanwhile wait for the new one.
Readers ``open_files`` every file relative to one open handle of the directory, so all come
from the same save; a file that vanishes under them makes them start again on the new save.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

# How long a reader keeps trying while saves replace the directory under it. Each new attempt
# means another complete save was published meanwhile, so this bounds only pathological churn.
READ_DEADLINE_S = 60.0

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_renameat2: Any = None  # libc's renameat2, once looked up; False where there is none


def hidden_sibling(path: str, what: str) -> str:
    """``<dir>/.<name>.<what>-<pid>-<hex>``: a hidden name next to ``path`` for a staged write
    (``tmp``), a replaced save (``old``) or one being deleted (``del``)."""
    parent, name = os.path.split(os.path.normpath(path))
    return os.path.join(parent, f".{name}.{what}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def fsync_dir(path: str) -> None:
    """Make a directory's new entries and renames durable (not possible everywhere: Windows)."""
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


def fsync_tree(path: str) -> None:
    """fsync every file under ``path`` and the directories themselves, so that a published
    save survives a crash of the machine as well as of the process."""
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


def _exchange(a: str, b: str) -> bool:
    """Swap the entries ``a`` and ``b`` atomically; False where the system cannot."""
    global _renameat2
    if _renameat2 is None:
        try:
            _renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
            _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
            _renameat2.argtypes += [ctypes.c_uint]
        except (AttributeError, OSError, TypeError):  # not Linux, or a libc before glibc 2.28
            _renameat2 = False
    if _renameat2 is False:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False  # this filesystem cannot exchange; the caller renames in two steps
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) of {a!r} and {b!r}: {os.strerror(err)}")


def publish(staged: str, path: str) -> None:
    """Make the complete directory ``staged`` visible at ``path`` in one step, replacing what
    is there (the caller has checked that it may be replaced); delete the replaced one."""
    fsync_tree(staged)
    parent = os.path.dirname(path) or "."
    if not os.path.lexists(path):
        try:
            os.rename(staged, path)
            fsync_dir(parent)
            return
        except OSError as e:  # another writer published meanwhile: replace theirs
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise
    if _exchange(staged, path):
        fsync_dir(parent)
        _remove(staged)  # now the replaced save
        return
    old = hidden_sibling(path, "old")
    os.rename(path, old)
    try:
        os.rename(staged, path)
    except BaseException:
        os.rename(old, path)  # put the previous save back
        raise
    fsync_dir(parent)
    _remove(old)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _replaced_save_aside(path: str) -> bool:
    """Whether a two-step ``publish`` of ``path`` is between its renames."""
    parent, name = os.path.split(os.path.normpath(path))
    try:
        return any(n.startswith(f".{name}.old-") for n in os.listdir(parent or "."))
    except OSError:
        return False


@contextlib.contextmanager
def open_files(
    path: str, names: Iterable[str], optional: Iterable[str] = ()
) -> Iterator[dict[str, BinaryIO]]:
    """Open ``names`` (and those of ``optional`` that exist) in the directory ``path``, all from
    one and the same save, however many saves replace it meanwhile.

    Raises FileNotFoundError when ``path`` is not there, NotADirectoryError when it is a file,
    and FileNotFoundError naming the file when a required one is missing from a directory that
    nobody replaced (it is not a complete save).
    """
    required, maybe = list(names), [n for n in optional if n not in names]
    deadline = time.monotonic() + READ_DEADLINE_S
    while True:
        files = _try_open(path, required, maybe)
        if files is not None:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{path!r} was replaced by new saves faster than it could be read for "
                f"{READ_DEADLINE_S:g} s"
            )
        time.sleep(0.001)
    try:
        yield files
    finally:
        for f in files.values():
            f.close()


def _try_open(path: str, required: list[str], maybe: list[str]) -> dict[str, BinaryIO] | None:
    """The open files, or None when a save replaced ``path`` meanwhile (try again)."""
    try:
        dir_fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except FileNotFoundError:
        if _replaced_save_aside(path):
            return None
        raise
    files: dict[str, BinaryIO] = {}
    try:
        for name in [*required, *maybe]:
            try:
                fd = os.open(name, os.O_RDONLY, dir_fd=dir_fd)
            except FileNotFoundError:
                if _still_at(path, dir_fd) is False:
                    for f in files.values():
                        f.close()
                    return None
                if name in maybe:
                    continue
                for f in files.values():
                    f.close()
                raise FileNotFoundError(
                    errno.ENOENT, f"{path!r} has no {name!r}: it is not a complete save"
                ) from None
            files[name] = os.fdopen(fd, "rb")
    finally:
        os.close(dir_fd)
    return files


def _still_at(path: str, dir_fd: int) -> bool:
    """Whether the directory open as ``dir_fd`` is still the one at ``path``."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(dir_fd)
    return (now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino)
