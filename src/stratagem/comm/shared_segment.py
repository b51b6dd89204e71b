"""Tensor bytes through shared memory, between two processes of one machine.

A ``comm.messages`` connection between processes of one machine carries the bytes of large
tensors in a ``/dev/shm`` file that the sender writes and the receiver maps (each side owns the
segment it sends through, mode 0600); the frame itself (schema, dtypes, shapes) still travels on
the socket, so the segment holds raw bytes only. A segment is announced as ``name length (1
byte) | name | size (8 bytes) | token (16 bytes)``; the receiver opens only a name ``sg-`` and 32
hex digits, checks that it is a regular file of this user at least that large and, at the
connection's opening, that it holds the token, then unlinks the name (the mappings live on). A
frame's tensors are written from the segment's start: a connection carries one request or reply
at a time, so the receiver has copied them out before the sender writes again.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

import torch

from stratagem.errors import PeerDataError

DIRECTORY = Path("/dev/shm")
_NAME = re.compile(r"sg-[0-9a-f]{32}")
_TOKEN_BYTES = 16
MIN_BYTES = 64 << 10  # frames with fewer tensor bytes go on the socket


def available() -> bool:
    return DIRECTORY.is_dir() and os.access(DIRECTORY, os.W_OK)


class SendSegment:
    """The segment this side writes its frames' tensor bytes into (grown when one needs more)."""

    def __init__(self, size: int) -> None:
        self._map: mmap.mmap | None = None
        self._names: list[Path] = []
        self.announce = self._create(size)

    def _create(self, size: int) -> bytes:
        name = f"sg-{secrets.token_hex(16)}"
        path = DIRECTORY / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        self._names.append(path)
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if self._map is not None:
            self._map.close()
        self._map = mapping
        token = secrets.token_bytes(_TOKEN_BYTES)
        mapping[:_TOKEN_BYTES] = token
        return bytes([len(name)]) + name.encode() + size.to_bytes(8, "little") + token

    def write(self, buffers: list[memoryview]) -> bytes | None:
        """Write the tensors' bytes from the start; the announcement of a new, larger segment
        when the current one was too small (the receiver must open it first), else None."""
        assert self._map is not None
        needed = sum(len(b) for b in buffers)
        announce = None
        if needed > len(self._map):
            self.close_names()
            announce = self._create(max(needed, 2 * len(self._map)))
        view = memoryview(self._map)
        offset = 0
        try:
            for b in buffers:
                view[offset : offset + len(b)] = b
                offset += len(b)
        finally:
            view.release()
        return announce

    def close_names(self) -> None:
        """Remove the names the receiver has not removed yet (it may never have opened them)."""
        for path in self._names:
            try:
                path.unlink()
            except OSError:
                pass
        self._names = []

    def close(self) -> None:
        self.close_names()
        if self._map is not None:
            self._map.close()
            self._map = None


class ReceiveSegment:
    """The peer's segment, mapped; ``reader()`` copies a frame's tensors out, ``lender()`` gives
    them as views of the mapping (valid until the peer writes its next frame: a server that
    has answered). Mapped writable, so that a view can be used as any tensor (an optimizer may
    work on a gradient in place): the peer only writes its segment, never reads it back."""

    def __init__(self, announce_read: Callable[[int], bytes], *, peer: str, check: bool) -> None:
        size = announce_read(1)[0]
        name = announce_read(size).decode("ascii", errors="replace")
        nbytes = int.from_bytes(announce_read(8), "little")
        token = announce_read(_TOKEN_BYTES)
        if not _NAME.fullmatch(name):
            raise PeerDataError(f"{peer} named the shared-memory segment {name!r}, not sg-<hex>")
        path = DIRECTORY / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as e:
            raise PeerDataError(
                f"{peer}'s shared-memory segment {name} cannot be opened: {e}"
            ) from None
        try:
            info = os.fstat(fd)
            if (
                not stat.S_ISREG(info.st_mode)
                or info.st_uid != os.getuid()
                or info.st_size < nbytes
                or nbytes <= 0
            ):
                raise PeerDataError(
                    f"{peer}'s shared-memory segment {name} is not a file of this user of "
                    f"{nbytes} bytes"
                )
            self._map = mmap.mmap(fd, nbytes)
            self._view = memoryview(self._map)
        finally:
            os.close(fd)
        try:
            path.unlink()  # both sides hold their mapping; the name is no longer needed
        except OSError:
            pass
        if check and self._map[:_TOKEN_BYTES] != token:
            raise PeerDataError(f"{peer}'s shared-memory segment {name} does not hold its token")

    def reader(self) -> Callable[[memoryview], None]:
        offset = 0
        view = self._view

        def read_into(buffer: memoryview) -> None:
            nonlocal offset
            if offset + len(buffer) > len(view):
                raise PeerDataError(
                    f"a frame's tensors need more than the {len(view)} bytes of the peer's "
                    "shared-memory segment"
                )
            buffer[:] = view[offset : offset + len(buffer)]
            offset += len(buffer)

        return read_into

    def lender(self) -> Callable[[torch.dtype, list[int], int], torch.Tensor]:
        offset = 0
        view = self._view

        def lend(dtype: torch.dtype, shape: list[int], nbytes: int) -> torch.Tensor:
            nonlocal offset
            if offset + nbytes > len(view):
                raise PeerDataError(
                    f"a frame's tensors need more than the {len(view)} bytes of the peer's "
                    "shared-memory segment"
                )
            lent = torch.frombuffer(view[offset : offset + nbytes], dtype=dtype).view(shape)
            offset += nbytes
            return lent

        return lend

    def close(self) -> None:
        try:
            self._view.release()
            self._map.close()
        except BufferError:
            pass  # a lent view is still alive: the mapping goes with the last of them


def tensor_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
