"""The rendezvous store, sealed with the job's secret: unreadable and unforgeable to outsiders.

``SealedStore`` wraps torch's ``TCPStore`` (which has no credentials) so that, without the job's
secret (``cluster.job_secret``): key names are HMACs of the real names, so an outsider cannot
claim a key first; values are encrypted (SHAKE-256 keystream under a per-value random nonce) and
authenticated (HMAC-SHA256 over key, nonce and ciphertext), so a value an outsider writes or
moves from another key is a ``RendezvousError`` naming the key's owner and the store's address;
counters (``add``) are sealed values updated with ``compare_set``. Every process of the job,
torch's own code included (gloo's connection set-up), goes through the wrapper. An outsider who
reaches the port can still overwrite or delete keys: the job then fails with that named error
(a denial of service, not an entry).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
from collections.abc import Callable, Sequence

import torch.distributed as dist

from stratagem.cluster.job_secret import key_for
from stratagem.errors import RendezvousError

_NONCE = 16
_TAG = 32
_MAGIC = b"SGS1"


class SealedStore(dist.Store):
    """``base`` with every key name and value sealed under ``secret``."""

    def __init__(self, base: dist.Store, secret: bytes, *, where: str) -> None:
        super().__init__()
        self._base = base
        self._names = key_for(secret, "store-names")
        self._cipher = key_for(secret, "store-cipher")
        self._mac = key_for(secret, "store-mac")
        self._where = where  # "the rendezvous of worker 0 (localhost:2222)", for errors

    # ------------------------------------------------------------------ sealing

    def _key(self, key: str) -> str:
        return "sg/" + hmac.new(self._names, key.encode("utf-8"), hashlib.sha256).hexdigest()

    def _seal(self, sealed_key: str, value: bytes) -> bytes:
        nonce = os.urandom(_NONCE)
        stream = hashlib.shake_256(self._cipher + nonce).digest(len(value)) if value else b""
        body = _xor(value, stream)
        tag = self._tag(sealed_key, nonce, body)
        return _MAGIC + nonce + body + tag

    def _open(self, key: str, sealed_key: str, raw: bytes) -> bytes:
        raw = bytes(raw)
        if len(raw) < len(_MAGIC) + _NONCE + _TAG or not raw.startswith(_MAGIC):
            raise self._forged(key, f"a record of {len(raw)} bytes in no format this job writes")
        nonce = raw[len(_MAGIC) : len(_MAGIC) + _NONCE]
        body, tag = raw[len(_MAGIC) + _NONCE : -_TAG], raw[-_TAG:]
        if not hmac.compare_digest(tag, self._tag(sealed_key, nonce, body)):
            raise self._forged(key, "a record that fails the job secret's check")
        stream = hashlib.shake_256(self._cipher + nonce).digest(len(body)) if body else b""
        return _xor(body, stream)

    def _tag(self, sealed_key: str, nonce: bytes, body: bytes) -> bytes:
        message = sealed_key.encode("utf-8") + b"|" + nonce + body
        return hmac.new(self._mac, message, hashlib.sha256).digest()

    def _forged(self, key: str, what: str) -> RendezvousError:
        return RendezvousError(
            f"the rendezvous at {self._where} holds, under {key!r}, {what}: a process without "
            "the job's secret wrote into it, or a task of this job was given another secret "
            "(every task of a job needs the same STRATAGEM_JOB_SECRET)"
        )

    # ------------------------------------------------------------------ the Store interface

    def set(self, key: str, value: str | bytes) -> None:
        k = self._key(key)
        self._base.set(k, self._seal(k, _bytes(value)))

    def get(self, key: str) -> bytes:
        k = self._key(key)
        return self._open(key, k, self._base.get(k))

    def _update(
        self, key: str, change: Callable[[bytes | None], bytes | None]
    ) -> tuple[bytes | None, bytes | None]:
        """Replace ``key``'s value by ``change(old)`` (old is None for a missing key; a change of
        None leaves the record as it is), atomically: (old, the value written or None)."""
        k = self._key(key)
        while True:
            current = bytes(self._base.get(k)) if self._base.check([k]) else b""
            old = self._open(key, k, current) if current else None
            value = change(old)
            if value is None:
                return old, None
            sealed = self._seal(k, value)
            # Atomic: it stores ``sealed`` only if the record is still ``current``; the random
            # nonce makes ``sealed`` ours alone, so equality says our update won.
            if bytes(self._base.compare_set(k, current, sealed)) == sealed:
                return old, value

    def add(self, key: str, amount: int) -> int:
        def added(old: bytes | None) -> bytes:
            return str(amount + (0 if old is None else int(old.decode("ascii")))).encode("ascii")

        _, value = self._update(key, added)
        assert value is not None
        return int(value.decode("ascii"))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        expected_b, desired_b = _bytes(expected), _bytes(desired)

        def swapped(old: bytes | None) -> bytes | None:
            # torch's rule: a missing key is "expected" only by an empty expected value.
            matches = (old is None and not expected_b) or old == expected_b
            return desired_b if matches else None

        old, written = self._update(key, swapped)
        if written is not None:
            return written
        return expected_b if old is None else old

    def append(self, key: str, value: str | bytes) -> None:
        self._update(key, lambda old: (old or b"") + _bytes(value))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        sealed = [self._key(key) for key in keys]  # one round trip, as the base store's
        return [
            self._open(k, s, raw) for k, s, raw in zip(keys, sealed, self._base.multi_get(sealed))
        ]

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        for key, value in zip(keys, values):
            self.set(key, value)

    def check(self, keys: Sequence[str]) -> bool:
        return self._base.check([self._key(k) for k in keys])

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        sealed = [self._key(k) for k in keys]
        if timeout is None:
            self._base.wait(sealed)
        else:
            self._base.wait(sealed, timeout)

    def delete_key(self, key: str) -> bool:
        return self._base.delete_key(self._key(key))

    def num_keys(self) -> int:
        return self._base.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._base.set_timeout(timeout)

    @property
    def timeout(self) -> datetime.timedelta:  # type: ignore[override]
        return self._base.timeout

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> SealedStore:
        # torch clones the store for each new process group (a mesh's dimensions): the clone
        # talks to the same server over its own connection, sealed alike.
        twin = SealedStore.__new__(SealedStore)
        dist.Store.__init__(twin)
        twin._base = self._base.clone()
        twin._names, twin._cipher, twin._mac = self._names, self._cipher, self._mac
        twin._where = self._where
        return twin


def _xor(a: bytes, b: bytes) -> bytes:
    if not a:
        return b""
    return (int.from_bytes(a, "big") ^ int.from_bytes(b, "big")).to_bytes(len(a), "big")


def _bytes(value: str | bytes) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)


def sealed(base: dist.Store, secret: bytes | None, *, where: str) -> dist.Store:
    """``base`` sealed with ``secret``; ``base`` itself when the job runs insecure."""
    return base if secret is None else SealedStore(base, secret, where=where)
